"""Load balancing and scheduling of unit tasks (§3.2 of the cross-mesh paper, Eq. 1–4).

Pure functions over a *problem*: for each task, its options (one per sender host, the
lowest-indexed sender first), each with a duration and the resources it holds. A schedule
picks one option per task and a global order; `list_schedule` (the simulator) turns that
into times, each task starting once every earlier task on one of its resources is done.
Searching orders is enough: sorting an optimal schedule by start time and list-scheduling
that order never starts a task later.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hlopar.analysis.resharding.simulator import list_schedule

__all__ = [
    "ALGORITHMS",
    "Option",
    "Schedule",
    "SearchBudget",
    "dfs",
    "ensemble",
    "greedy_in_order",
    "load_balance",
    "makespan",
    "naive",
    "randomized_greedy",
    "run_algorithm",
    "schedule_bound",
    "task_classes",
]

ALGORITHMS: tuple[str, ...] = ("naive", "greedy-in-order", "load-balance", "dfs", "randomized-greedy", "ensemble")

Resource = Hashable


@dataclass(frozen=True)
class Option:
    """One way to carry out a task. `sender_resource` is the resource its sender side holds."""

    duration: float
    resources: frozenset[Resource]
    sender_host: int
    sender_resource: Resource

    def __post_init__(self) -> None:
        if self.sender_resource not in self.resources:
            raise ValueError(f"sender resource {self.sender_resource!r} is not among {set(self.resources)}")


Problem = Sequence[Sequence[Option]]
# (task, option) pairs in the global order.
Schedule = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SearchBudget:
    """Limits of the searches; the DFS stops at whichever budget runs out first."""

    dfs_seconds: float = 0.25
    dfs_nodes: int = 50_000
    dfs_max_tasks: int = 400  # deeper trees are not searched (recursion depth)
    greedy_trials: int = 16
    greedy_restarts: int = 8
    greedy_seconds: float = 0.3  # no new restart after this (the first always runs)
    seed: int = 0


def makespan(problem: Problem, schedule: Schedule) -> float:
    return list_schedule([(problem[t][k].duration, problem[t][k].resources) for t, k in schedule]).makespan


def naive(problem: Problem) -> Schedule:
    """Lowest-indexed sender, tasks in their given order."""
    return tuple((t, 0) for t in range(len(problem)))


def greedy_in_order(problem: Problem) -> Schedule:
    """The baselines of §5.1.2: each task in its given order (Alpa's: destination box, then
    source box) to the sender host with the least load so far, and executed in that order.

    Unlike `load_balance` nothing is sorted: the paper's baselines pick "the sender with the
    lowest load for the next data slice" and run "with Alpa's order".
    """
    load: Counter[int] = Counter()
    schedule = []
    for t, options in enumerate(problem):
        k = min(range(len(options)), key=lambda k: (load[options[k].sender_host], k))
        load[options[k].sender_host] += options[k].duration
        schedule.append((t, k))
    return tuple(schedule)


def load_balance(problem: Problem) -> Schedule:
    """Eq. 4 by the classical greedy: longest task first, to the least-loaded sender host."""
    order = sorted(range(len(problem)), key=lambda t: -min(o.duration for o in problem[t]))
    load: Counter[int] = Counter()
    schedule = []
    for t in order:
        k = min(range(len(problem[t])), key=lambda k: (load[problem[t][k].sender_host], k))
        load[problem[t][k].sender_host] += problem[t][k].duration
        schedule.append((t, k))
    return tuple(schedule)


def randomized_greedy(problem: Problem, budget: SearchBudget = SearchBudget()) -> Schedule:
    """Rounds of the largest set of non-overlapping tasks, found by random orders (§3.2).

    Each round tries `greedy_trials` random orders of the remaining tasks, adding every task
    (on its least-loaded free sender host) that overlaps nothing chosen so far, and keeps
    the set that engages the most NIC sides (then the most work). The whole is restarted up
    to `greedy_restarts` times (no new restart after `greedy_seconds`, none once a schedule
    meets the bound) and the best schedule kept.
    """
    rng = random.Random(budget.seed)
    deadline = time.perf_counter() + budget.greedy_seconds
    floor = schedule_bound(problem) * (1 + 1e-9)
    best: Schedule = ()
    best_span = math.inf
    for _ in range(max(1, budget.greedy_restarts)):
        schedule = _greedy_rounds(problem, max(1, budget.greedy_trials), rng)
        span = makespan(problem, schedule)
        if span < best_span * (1 - 1e-12):
            best, best_span = schedule, span
        if best_span <= floor or time.perf_counter() > deadline:
            break
    return best


def _greedy_rounds(problem: Problem, trials: int, rng: random.Random) -> Schedule:
    # Identical tasks conflict with each other, so a round takes at most one of each class:
    # the random orders are over classes, which keeps a round linear in the classes.
    classes = task_classes(problem)
    pointer = [0] * len(classes)
    active = list(range(len(classes)))
    load: Counter[int] = Counter()
    order: list[tuple[int, int]] = []
    while active:
        best_set: list[tuple[int, int, int]] = []
        best_score = (-1, -1.0)
        for _ in range(trials):
            perm = active[:]
            rng.shuffle(perm)
            used: set[Resource] = set()
            chosen = []
            for c in perm:
                t = classes[c][pointer[c]]
                options = range(len(problem[t]))
                if len(options) > 1:
                    options = sorted(options, key=lambda k: (load[problem[t][k].sender_host], rng.random()))
                for k in options:
                    if used.isdisjoint(problem[t][k].resources):
                        chosen.append((t, k, c))
                        used |= problem[t][k].resources
                        break
            score = (len(used), sum(problem[t][k].duration for t, k, _ in chosen))
            if score > best_score:
                best_set, best_score = chosen, score
        best_set.sort()
        for t, k, c in best_set:
            order.append((t, k))
            load[problem[t][k].sender_host] += problem[t][k].duration
            pointer[c] += 1
        active = [c for c in active if pointer[c] < len(classes[c])]
    return tuple(order)


def task_classes(problem: Problem) -> list[list[int]]:
    """Tasks with identical options (durations, resources), each class in index order."""
    signatures: dict[tuple, list[int]] = {}
    for t, options in enumerate(problem):
        key = tuple((o.duration, o.resources, o.sender_resource) for o in options)
        signatures.setdefault(key, []).append(t)
    return list(signatures.values())


class _OutOfBudget(Exception):
    pass


def dfs(problem: Problem, budget: SearchBudget = SearchBudget(), incumbent: Schedule | None = None) -> Schedule:
    """Depth-first branch and bound over (next task, its sender), within the budget.

    Only canonical orders are explored: start times never decrease along the order, and of
    tasks with identical options only the lowest-indexed remaining one is tried. A branch
    is pruned when its bound reaches the best completion time found: per resource, its
    ready time plus the work every remaining task must put on it (Eq. 4 with senders fixed
    where there is no choice), and the remaining work averaged over all sender resources.
    The search ends early once the best equals the bound at the root (it is optimal).
    """
    n = len(problem)
    start_best = list(incumbent) if incumbent is not None else None
    best_span = makespan(problem, incumbent) if incumbent is not None else math.inf
    if n == 0 or n > budget.dfs_max_tasks:
        return tuple(start_best) if start_best is not None else load_balance(problem)
    search = _Search(problem, budget, best_span, start_best)
    search.run()
    if search.best_order is None:
        return load_balance(problem)
    return tuple(search.best_order)


class _Search:
    """State of one DFS (mutable, local to a call)."""

    def __init__(self, problem: Problem, budget: SearchBudget, best_span: float, best_order):
        self.problem = problem
        self.budget = budget
        self.best_span = best_span
        self.best_order = best_order
        self.classes = task_classes(problem)
        self.pointer = [0] * len(self.classes)
        self.min_duration = [min(o.duration for o in options) for options in problem]
        self.forced: list[dict[Resource, float]] = []
        self.forced_left: defaultdict[Resource, float] = defaultdict(float)
        for t, options in enumerate(problem):
            common = frozenset.intersection(*(o.resources for o in options))
            self.forced.append({r: self.min_duration[t] for r in common})
            for r in common:
                self.forced_left[r] += self.min_duration[t]
        self.senders = {o.sender_resource for options in problem for o in options}
        self.ready: defaultdict[Resource, float] = defaultdict(float)
        self.order: list[tuple[int, int]] = []
        total = sum(self.min_duration)
        self.eps = 1e-9 * max(total, 1e-30)
        self.root_bound = max(max(self.forced_left.values(), default=0.0), total / len(self.senders))
        self.nodes = 0
        self.deadline = time.perf_counter() + budget.dfs_seconds

    def run(self) -> None:
        if self.best_span <= self.root_bound + self.eps:
            return
        with contextlib.suppress(_OutOfBudget):
            self._visit(0.0, 0.0, sum(self.min_duration), self.root_bound)

    def _visit(self, last_start: float, sender_sum: float, work_left: float, bound: float) -> bool:
        """Extends the order; True once an optimal schedule is known (stop everything)."""
        if len(self.order) == len(self.problem):
            span = max(self.ready.values(), default=0.0)
            if span < self.best_span - self.eps:
                self.best_span, self.best_order = span, list(self.order)
            return self.best_span <= self.root_bound + self.eps
        self.nodes += 1
        if self.nodes > self.budget.dfs_nodes or (self.nodes % 128 == 0 and time.perf_counter() > self.deadline):
            raise _OutOfBudget
        children = []
        for c, members in enumerate(self.classes):
            if self.pointer[c] == len(members):
                continue
            t = members[self.pointer[c]]
            for k, option in enumerate(self.problem[t]):
                start = max(self.ready[r] for r in option.resources)
                if start < last_start - self.eps:
                    continue
                end = start + option.duration
                child = max(bound, end)
                for r in option.resources:
                    child = max(child, end + self.forced_left[r] - self.forced[t].get(r, 0.0))
                new_sum = sender_sum + sum(end - self.ready[r] for r in option.resources if r in self.senders)
                new_left = work_left - self.min_duration[t]
                child = max(child, (new_sum + new_left) / len(self.senders))
                if child < self.best_span - self.eps:
                    children.append((child, end, t, k, c, start, new_sum, new_left))
        children.sort()
        for child, end, t, k, c, start, new_sum, new_left in children:
            if child >= self.best_span - self.eps:
                break
            option = self.problem[t][k]
            saved = {r: self.ready[r] for r in option.resources}
            for r in option.resources:
                self.ready[r] = end
            for r, d in self.forced[t].items():
                self.forced_left[r] -= d
            self.pointer[c] += 1
            self.order.append((t, k))
            done = self._visit(start, new_sum, new_left, child)
            self.order.pop()
            self.pointer[c] -= 1
            for r, d in self.forced[t].items():
                self.forced_left[r] += d
            self.ready.update(saved)
            if done:
                return True
        return False


def ensemble(problem: Problem, budget: SearchBudget = SearchBudget()) -> tuple[str, Schedule]:
    """Every algorithm, keeping the schedule with the least completion time (and its name).

    The DFS starts from the best of the others as its incumbent, so it only spends its
    budget looking for something strictly better. Ties keep the earlier algorithm; once a
    schedule meets `schedule_bound` nothing can beat it and the rest are skipped.
    """
    floor = schedule_bound(problem) * (1 + 1e-9)
    best_name, best = "naive", naive(problem)
    best_span = makespan(problem, best)
    for name in ("load-balance", "randomized-greedy", "dfs"):
        if best_span <= floor:
            break
        schedule = dfs(problem, budget, incumbent=best) if name == "dfs" else run_algorithm(name, problem, budget)
        span = makespan(problem, schedule)
        if span < best_span * (1 - 1e-12):
            best_name, best, best_span = name, schedule, span
    return best_name, best


def schedule_bound(problem: Problem) -> float:
    """No schedule of `problem` ends earlier: the DFS's bound at its root."""
    return _Search(problem, SearchBudget(), math.inf, None).root_bound if problem else 0.0


def run_algorithm(name: str, problem: Problem, budget: SearchBudget = SearchBudget()) -> Schedule:
    """The schedule of one named algorithm (`ensemble`: the best of all)."""
    if name == "naive":
        return naive(problem)
    if name == "greedy-in-order":
        return greedy_in_order(problem)
    if name == "load-balance":
        return load_balance(problem)
    if name == "dfs":
        return dfs(problem, budget)
    if name == "randomized-greedy":
        return randomized_greedy(problem, budget)
    if name == "ensemble":
        return ensemble(problem, budget)[1]
    raise ValueError(f"unknown algorithm {name!r} (one of {', '.join(ALGORITHMS)})")
