"""Stage construction: layers → pipeline stages on submeshes (Alpa §5.2, Eq. 2–4, Algorithm 1).

The input is the table of t_intra: `latency[i, j, m, s-1]` is the latency of layers i..j
(inclusive) on submesh choice m when s stages, this one included, run from it to the last
(s matters through memory, Eq. 5); inf where it does not fit or j < i. A plan slices the L
layers into S consecutive stages, stage k (from 0) with s = S-k, on submeshes whose sizes sum
to exactly the D devices (§5.1: no device left idle), and costs Eq. 2:
T = Σ t_i + (B-1)·max t_i.

Eq. 3's F(s, k, d; t_max) is the least Σ t over slicings of layers k.. into s stages on d
devices with every stage at most t_max, and T*(t_max) = min_s F(s, 0, D; t_max) + (B-1)·t_max
(Eq. 4). The candidates for t_max are the table's distinct values, grouped so that each group
spans less than ε and evaluated at its largest value: the result is within (B-1)·ε of the
optimum, and exactly the optimum with ε = 0.

Which t_max to evaluate is a branch and bound over the sorted candidates, a strengthening of
the paper's early pruning (stop once B·t_max >= T*): Σ t is nonincreasing in t_max, so a plan
first feasible at a candidate between two evaluated ones costs at least the right one's Σ t
plus (B-1) times its own t_max; a whole gap is skipped once that bound reaches the best T, or
when both ends have the same Σ t; and evaluating at t_max finds a plan whose true maximum may
be lower, which settles every candidate in between at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Stage", "StagePlan", "Slicing", "brute_force_stages", "stage_dp"]


@dataclass(frozen=True)
class Stage:
    """Layers start_layer..end_layer (inclusive) on submesh choice `submesh_index`."""

    start_layer: int
    end_layer: int
    submesh_index: int
    latency: float


@dataclass(frozen=True)
class Slicing:
    """One plan and its Eq. 2 cost: total_latency = sum_latency + (B-1)·t_max."""

    stages: tuple[Stage, ...]
    total_latency: float
    t_max: float
    sum_latency: float


@dataclass(frozen=True)
class StagePlan:
    """The best plan (least T*, then least t_max), how many t_max the DP evaluated, and the
    best plans of the other evaluated t_max with other stage lists, best first."""

    stages: tuple[Stage, ...]
    total_latency: float
    t_max: float
    sum_latency: float
    evaluated_t_max: int
    runner_ups: tuple[Slicing, ...]


@dataclass(frozen=True)
class _Problem:
    """The table as, per s, its usable entries in (k, i, m) order: stage layers k..i on m with
    s stages to go, leaving at least s-1 layers and s-1 devices to the stages after it."""

    num_layers: int
    num_devices: int
    sizes: np.ndarray  # (M,)
    k: tuple[np.ndarray, ...]  # [s-1] → (n_s,)
    i: tuple[np.ndarray, ...]
    m: tuple[np.ndarray, ...]
    value: tuple[np.ndarray, ...]
    num_stages: int | None = None  # only plans of this many stages (None: any)

    @property
    def max_stages(self) -> int:
        return len(self.k)


def _as_4d(latency: np.ndarray, num_devices: int) -> np.ndarray:
    """A 3-D table (no dependence on s) repeated for s = 1..min(L, D)."""
    table = np.asarray(latency, dtype=float)
    if table.ndim == 3 and table.shape[0] > 0:
        table = np.repeat(table[..., None], max(1, min(table.shape[0], num_devices)), axis=3)
    return table


def _problem(
    latency: np.ndarray, submesh_sizes: Sequence[int], num_devices: int, num_stages: int | None = None
) -> _Problem:
    table = _as_4d(latency, num_devices)
    if table.ndim != 4 or table.shape[0] != table.shape[1] or table.shape[0] == 0:
        raise ValueError(f"latency must have shape (L, L, M, S) or (L, L, M), got {np.shape(latency)}")
    num_layers, _, num_submeshes, depth = table.shape
    sizes = np.asarray(submesh_sizes, dtype=np.int64)
    if sizes.shape != (num_submeshes,):
        raise ValueError(f"{len(sizes)} submesh sizes for a table with {num_submeshes} submesh choices")
    if np.any(sizes < 1):
        raise ValueError("submesh sizes must be positive")
    if num_devices < 1:
        raise ValueError(f"num_devices must be positive, got {num_devices}")
    if num_stages is not None and not 1 <= num_stages <= min(depth, num_layers, num_devices):
        raise ValueError(
            f"{num_stages} stages: between 1 and {min(depth, num_layers, num_devices)} here "
            f"({num_layers} layers, {num_devices} devices)"
        )
    if np.any(np.isnan(table)) or np.any(table < 0):
        raise ValueError("latencies must be non-negative (inf where infeasible), not NaN")
    ks, is_, ms, values = [], [], [], []
    k, i, m = np.meshgrid(np.arange(num_layers), np.arange(num_layers), np.arange(num_submeshes), indexing="ij")
    for s in range(1, (num_stages or min(depth, num_layers, num_devices)) + 1):
        value = table[:, :, :, s - 1]
        keep = (i >= k) & (i <= num_layers - s) & (sizes[m] <= num_devices - (s - 1)) & np.isfinite(value)
        ks.append(k[keep])
        is_.append(i[keep])
        ms.append(m[keep])
        values.append(value[keep])
    return _Problem(num_layers, num_devices, sizes, tuple(ks), tuple(is_), tuple(ms), tuple(values), num_stages)


def _min_sum(problem: _Problem, t_max: float) -> tuple[float, tuple[Stage, ...]] | None:
    """min_s F(s, 0, D; t_max) of Eq. 3–4 and its stages (fewest stages on ties), or None;
    F(S, 0, D; t_max) where the problem fixes S stages.

    F[s][k, d] for all k, d at once: every usable entry (k, i, m) with t <= t_max adds its t
    to F[s-1][i+1, d - size_m], and the least per k is kept (a segmented min over entries
    sorted by k). Work per s: usable entries × (D+1)."""
    L, D = problem.num_layers, problem.num_devices
    sizes = problem.sizes
    tables = [np.full((L + 1, D + 1), np.inf)]
    tables[0][L, 0] = 0.0
    for s in range(1, problem.max_stages + 1):
        previous = tables[-1]
        reachable = np.isfinite(previous).any(axis=1)
        k, i, m, value = problem.k[s - 1], problem.i[s - 1], problem.m[s - 1], problem.value[s - 1]
        use = np.flatnonzero((value <= t_max) & reachable[i + 1])
        current = np.full((L + 1, D + 1), np.inf)
        tables.append(current)
        if len(use) == 0:
            break
        shifted = np.full((len(sizes), L + 1, D + 1), np.inf)
        for index, size in enumerate(sizes):
            if size <= D:
                shifted[index, :, size:] = previous[:, : D + 1 - size]
        k, i, m, value = k[use], i[use], m[use], value[use]
        candidates = shifted[m, i + 1] + value[:, None]
        firsts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
        current[k[firsts]] = np.minimum.reduceat(candidates, firsts, axis=0)
    totals = np.array([table[0, D] for table in tables[1:]])
    if problem.num_stages is not None:  # F of the other counts: not plans here
        totals = np.where(np.arange(1, len(totals) + 1) == problem.num_stages, totals, np.inf)
    if len(totals) == 0 or not np.isfinite(totals.min()):
        return None
    num_stages = int(np.argmin(totals)) + 1
    return float(totals[num_stages - 1]), _backtrack(problem, tables, num_stages, t_max)


def _backtrack(problem: _Problem, tables: list[np.ndarray], num_stages: int, t_max: float) -> tuple[Stage, ...]:
    """The stages behind F[num_stages][0, D]: at each state the first entry (shortest span,
    then lowest submesh index) whose t + F[s-1][i+1, d-size] reproduces F[s][k, d] exactly (the
    same float additions as the forward pass)."""
    stages = []
    k, d = 0, problem.num_devices
    for s in range(num_stages, 0, -1):
        target = tables[s][k, d]
        ks, i, m, value = problem.k[s - 1], problem.i[s - 1], problem.m[s - 1], problem.value[s - 1]
        for e in np.flatnonzero((ks == k) & (value <= t_max) & (problem.sizes[m] <= d)):
            rest = d - int(problem.sizes[m[e]])
            if value[e] + tables[s - 1][i[e] + 1, rest] == target:
                stages.append(Stage(k, int(i[e]), int(m[e]), float(value[e])))
                k, d = int(i[e]) + 1, rest
                break
        else:  # pragma: no cover - the forward pass guarantees a match
            raise AssertionError("stage DP backtrack lost its path")
    return tuple(stages)


def _candidate_groups(problem: _Problem, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Distinct finite latencies grouped left to right into runs spanning less than ε: each
    group's (smallest, largest) value; the DP runs at the largest."""
    values = np.unique(np.concatenate(problem.value)) if problem.value else np.zeros(0)
    if epsilon <= 0 or len(values) == 0:
        return values, values
    lows, highs = [], []
    start = 0
    while start < len(values):
        end = int(np.searchsorted(values, values[start] + epsilon, side="left"))
        lows.append(values[start])
        highs.append(values[end - 1])
        start = end
    return np.array(lows), np.array(highs)


def stage_dp(
    latency: np.ndarray,
    submesh_sizes: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    epsilon: float = 1e-6,
    num_runner_ups: int = 3,
    num_stages: int | None = None,
) -> StagePlan:
    """The plan of least Eq. 2 latency (module docstring): table `latency[i, j, m, s-1]`
    (a 3-D table means no dependence on s), `submesh_sizes[m]` devices per submesh choice,
    all `num_devices` used, B = `num_microbatches`; with `num_stages`, the best plan of exactly
    that many stages (a user's fixed pipeline depth; Σ t stays nonincreasing in t_max for one
    s, so the search is the same). Ties: the smaller t_max. Raises ValueError when no slicing
    fits (every way to use all devices hits an infeasible span)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be positive, got {num_microbatches}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be non-negative, got {epsilon}")
    problem = _problem(latency, submesh_sizes, num_devices, num_stages)
    lows, highs = _candidate_groups(problem, epsilon)
    search = _Search(problem, lows, highs, num_microbatches - 1)
    if len(highs) == 0 or search.evaluate(len(highs) - 1) is None:  # the loosest t_max: any plan at all?
        raise ValueError(
            f"no pipeline plan: no slicing of {problem.num_layers} layers into "
            f"{f'{num_stages} ' if num_stages else ''}stages on submeshes "
            f"of sizes {sorted(set(int(s) for s in problem.sizes))} uses exactly {num_devices} devices "
            "with every stage feasible (out of memory or no such submesh)"
        )
    search.run()
    return search.result(num_runner_ups)


class _Search:
    """Branch and bound over the candidate groups 0..n-1 (see the module docstring).

    `known[j]` = Σ t of the DP at group j (inf: infeasible), set by evaluating j or implied by
    an evaluation at a larger group whose plan's max falls in group j."""

    def __init__(self, problem: _Problem, lows: np.ndarray, highs: np.ndarray, weight: int) -> None:
        self.problem, self.lows, self.highs, self.weight = problem, lows, highs, weight
        self.known: dict[int, float] = {}
        self.plans: dict[tuple[Stage, ...], Slicing] = {}
        self.best: Slicing | None = None
        self.evaluations = 0

    def group_of(self, value: float) -> int:
        return int(np.searchsorted(self.lows, value, side="right")) - 1

    def evaluate(self, group: int) -> Slicing | None:
        """The DP at the group's largest value; its plan's own max settles the groups from the
        one holding that max up to this one (same Σ t, which a plan with a larger max cannot beat)."""
        self.evaluations += 1
        found = _min_sum(self.problem, float(self.highs[group]))
        if found is None:
            self.known[group] = np.inf
            return None
        total, stages = found
        t_max = max(stage.latency for stage in stages)
        plan = Slicing(stages, total + self.weight * t_max, t_max, total)
        self.known[group] = total
        self.known.setdefault(self.group_of(t_max), total)
        self.plans.setdefault(stages, plan)
        if self.best is None or (plan.total_latency, plan.t_max) < (self.best.total_latency, self.best.t_max):
            self.best = plan
        return plan

    def bound(self, left: int, right: int) -> float:
        """Least Eq. 2 cost of a plan whose max falls in groups left+1..right-1: its Σ t is at
        least Σ t at `right` (Σ t is nonincreasing in t_max) and at least its max."""
        low = float(self.lows[left + 1])
        return max(self.known[right], low) + self.weight * low

    def pruned(self, left: int, right: int) -> bool:
        if right - left <= 1 or (left >= 0 and self.known[left] == self.known[right]):
            return True
        bound, best = self.bound(left, right), self.best
        return bound > best.total_latency or (bound == best.total_latency and self.lows[left + 1] >= best.t_max)

    def run(self) -> None:
        """Intervals (left, right) of unevaluated groups between known ones, lowest bound first;
        left = -1 before the first group (whose feasibility is unknown)."""
        queue = [(0.0, -1, len(self.highs) - 1)]
        while queue:
            _, left, right = heapq.heappop(queue)
            if self.pruned(left, right):
                continue
            middle = (left + right) // 2 if left >= 0 else (right - 1) // 2
            plan = self.evaluate(middle)
            pieces = [(middle, right)]
            if plan is not None and self.group_of(plan.t_max) > left:
                pieces.append((left, self.group_of(plan.t_max)))
            for a, b in pieces:
                if not self.pruned(a, b):
                    heapq.heappush(queue, (self.bound(a, b), a, b))

    def result(self, count: int) -> StagePlan:
        best = self.best
        others = sorted(
            (p for p in self.plans.values() if p.stages != best.stages), key=lambda p: (p.total_latency, p.t_max)
        )
        return StagePlan(
            best.stages, best.total_latency, best.t_max, best.sum_latency, self.evaluations, tuple(others[:count])
        )


def brute_force_stages(
    latency: np.ndarray,
    submesh_sizes: Sequence[int],
    num_devices: int,
    num_microbatches: int,
    num_stages: int | None = None,
) -> StagePlan:
    """Every slicing × submesh assignment using exactly all devices, scored by Eq. 2 (for tests
    on small L and D); least (T, t_max). Same inputs and errors as `stage_dp`."""
    table = _as_4d(latency, num_devices)
    num_layers, _, num_submeshes, depth = table.shape
    sizes = list(submesh_sizes)
    best, evaluated = None, 0
    counts = [num_stages] if num_stages is not None else range(1, min(num_layers, depth) + 1)
    for num_stages in counts:
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            starts, ends = (0,) + cuts, cuts + (num_layers,)
            for choice in itertools.product(range(num_submeshes), repeat=num_stages):
                if sum(sizes[m] for m in choice) != num_devices:
                    continue
                times = [
                    float(table[a, b - 1, m, num_stages - n - 1])
                    for n, (a, b, m) in enumerate(zip(starts, ends, choice))
                ]
                if not all(np.isfinite(times)):
                    continue
                evaluated += 1
                t_max, total = max(times), sum(times)
                plan = Slicing(
                    tuple(Stage(a, b - 1, m, t) for a, b, m, t in zip(starts, ends, choice, times)),
                    total + (num_microbatches - 1) * t_max,
                    t_max,
                    total,
                )
                if best is None or (plan.total_latency, plan.t_max) < (best.total_latency, best.t_max):
                    best = plan
    if best is None:
        raise ValueError("no pipeline plan: no slicing uses exactly all devices with every stage feasible")
    return StagePlan(best.stages, best.total_latency, best.t_max, best.sum_latency, evaluated, ())
