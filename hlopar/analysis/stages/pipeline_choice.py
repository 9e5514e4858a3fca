"""The pipeline as one choice: schedule, microbatch count, stages and submeshes together.

Stage construction asks this for the plan of one schedule (the user's) or of the best of
several (`schedule=auto`). Every candidate (schedule, count) shares the layers' arrays
(`span_costs.LayerArrays`, from the layer ILPs, solved once for all of them): per count, one
span table per distinct in-flight rule (Eq. 5: 1f1b and zb-h1 share one, eager-1f1b,
eager-1f1b-wd and zb-h2 another; `span_tables` computes what they share once) and one DP per
table (`stage_dp`, its best plan and its
runner-ups). How candidates are ranked:

- `by="eq2"` (one schedule): the DP's own Eq. 2 latency, as Alpa ranks plans; only the
  DP's best plan per count.
- `by="simulation"`: each of those plans run through the schedule's instruction streams in
  the simulator (`analysis.schedules.simulate`): a stage's compute is its span latency less
  the share that receives from other meshes, split into forward and backward by the span's
  forward latencies (W half the backward where a schedule splits it: `StageCost`'s default),
  and the bytes the layers of two stages read from each other go over the link in the
  simulator instead, so a schedule that overlaps them gains. Iteration time with the barrier
  at the optimizer step, as hlopar's executors run a step (not `steady_period`); with
  `PipelineSpace.host`, at least what the in-process runtime's one host thread does
  (`HostLaunches`, `schedules.HostThread`). With `by="eq2"` the plan picked is simulated
  too (`Candidate.simulated`: what the report predicts its step by).
  A plan is kept only where each stage also fits with the stashes it holds under that
  schedule (`Schedule.stashes`: a zero-bubble stage keeps a stash until its W, more than
  the DP's Eq. 5 count for every stage but the first).
  A simulation costs time in proportion to the count (GPT-1.3B's plans of 1024 microbatches
  on 24 stages: seconds each), a bound on what it can return almost nothing
  (`schedules.iteration_lower_bound`): plans are simulated in the order of their bounds,
  and those that could be neither the choice nor its runner-up are not (`_simulated`).

Schedules of several stages per mesh (`Schedule.mesh_order`: interleaved-1f1b, zb-v) are
planned on p meshes of ONE submesh shape and one logical shape (p times the submesh's size
is every device; p >= 2), v chunks each (`VIRTUAL_CHUNKS`, or the schedule's own count): the
layers cut into v p contiguous stages, stage k on mesh `Schedule.placed(p, v)[k]`. The cut is
the DP's of Eq. 3-4 with exactly v p stages on that one submesh (its devices counted once per
chunk), on a span table whose in-flight rule is each chunk's own stashes
(`Schedule.chunk_stashes`, to W where backwards split); a plan is kept only where each mesh
fits with its chunks' memories summed (the sum of the chunks' peaks, an upper bound of the
mesh's); where the DP's plans fit chunk by chunk and not summed, the table is made again with
each chunk within 1/v of the memory (the sum met by construction, remat where it fits). The
DP's best plan and runner-ups of every (submesh, logical shape, v) are ranked in the
simulator, whatever `by` says: Eq. 2 does not see the interleaving. Their `total_latency` is
the DP's Eq. 2 over the v p stages.

Counts: the layers may be a split step's (`split`: the arrays are per microbatch of that
many); another count is priced from them scaled to the whole batch (`LayerArrays.scaled`),
the count itself from them as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from hlopar.analysis.schedules import (
    Edge,
    HostThread,
    PipelineTopology,
    Schedule,
    StageCost,
    build_streams,
    get_schedule,
    iteration_lower_bound,
    simulate,
)
from hlopar.analysis.stages.span_costs import LayerArrays, SpanTable, span_tables
from hlopar.analysis.stages.stage_dp import Slicing, stage_dp

__all__ = [
    "MESH_MARGIN",
    "VIRTUAL_CHUNKS",
    "Candidate",
    "Choice",
    "HostLaunches",
    "PipelineSpace",
    "choose_pipeline",
    "simulated_step",
]

# Chunks per mesh priced for a schedule that takes any count (interleaved 1F1B): each chunk
# more divides the bubble further but adds a transfer per microbatch and chunk boundary, and
# a span table, a DP and simulations per count; Megatron's runs use a few (Narayanan et al.).
VIRTUAL_CHUNKS = (2, 3, 4)

# A plan of more meshes is chosen in simulation only where predicted faster by this much a mesh
# more: each mesh adds costs the model leaves out or prices low in process (its launches'
# bookkeeping, the batch's slices placed per microbatch, accumulators zeroed), and near-ties
# are within the predictions' spread. Measured (issue 31, docs/performance.md "One host
# thread"): two-mesh plans at one microbatch predicted 0.1-3% faster than one mesh ran 1.1-1.2x
# slower.
MESH_MARGIN = 0.05


def _mesh_factor(meshes: int) -> float:
    return (1.0 + MESH_MARGIN) ** max(meshes - 1, 0)


@dataclass(frozen=True)
class PipelineSpace:
    """What every candidate shares: the span table's inputs (`span_costs.span_table`), the
    cluster's devices, and the DP's options; `split`, where the layers are a split step's,
    its count of microbatches."""

    layers: LayerArrays
    received: np.ndarray
    meshes_of_submesh: Sequence[Sequence[int]]
    submesh_sizes: Sequence[int]
    num_devices: int
    transfer_seconds: Callable[[float, int], float]
    memory_per_device: float
    max_stages: int
    remat: str = "never"
    num_stages: int | None = None
    epsilon: float = 1e-6
    split: int | None = None
    mesh_shapes: Sequence[tuple[int, ...]] = ()  # logical shape of each logical mesh g (empty: one per submesh)
    host: HostLaunches | None = None  # one host thread plays every mesh (None: not priced)


@dataclass(frozen=True)
class HostLaunches:
    """What one host thread pays to launch a stage's fragment runs (`schedules.HostThread`,
    `ClusterPreset.dispatch_s`): `launch_s` each, `device_s` per device the fragment spans,
    and `value_s` per value: per layer of the stage `values[0 | 1 | 2, l]`, the values its
    forward | backward | update hands over (`layer_costs.boundary_values`: from above, as the
    latencies count them); with `shares_cores`, the `devices` of the process (every device
    of the cluster, used or not) compute on that host's cores (CPU devices), and the launches
    their latencies price (`LayerArrays.launch_s` per run, `counted_value_s` per value) are
    left out of the devices' work (`schedules.HostThread.counted`)."""

    launch_s: float
    device_s: float
    values: np.ndarray  # (3, L)
    value_s: float
    devices: int
    shares_cores: bool = False
    counted_value_s: float = 0.0  # what the latencies price a value handed over at (`value_launch_s`)


@dataclass(frozen=True)
class Candidate:
    """The best plan of one (schedule, count), or why it has none (`plan` None). `seconds`:
    what it was ranked by (simulated step time, or Eq. 2); `total_latency` its Eq. 2 latency;
    `table` the span table its stages read; `others` the DP's other plans, by Eq. 2."""

    schedule: str
    microbatches: int
    plan: Slicing | None
    table: SpanTable | None
    seconds: float
    total_latency: float
    bubble_fraction: float | None = None
    evaluated_t_max: int = 0
    why: str = ""
    others: tuple[Slicing, ...] = ()
    chunks: int = 1  # stages per mesh (`plan`'s v p stages on p meshes where > 1)
    at_least: float = np.inf  # not simulated (`_simulated`): a bound of its simulated step time
    simulated: float | None = None  # its simulated step time (ranked by Eq. 2: the best's only)

    @property
    def score(self) -> float:
        """What simulated candidates are ranked by: the time, `MESH_MARGIN` more per mesh
        beyond the first (inf without a plan)."""
        if self.plan is None:
            return np.inf
        return self.seconds * _mesh_factor(len(self.plan.stages) // self.chunks)

    @property
    def placement(self) -> tuple[int, ...]:
        """The mesh (0..p-1) of each stage of `plan`."""
        num_meshes = len(self.plan.stages) // self.chunks
        return (
            tuple(range(num_meshes))
            if self.chunks == 1
            else get_schedule(self.schedule).placed(num_meshes, self.chunks)
        )


@dataclass(frozen=True)
class Choice:
    """Every (schedule, count) tried, best first (its order on ties: the order given; those
    not simulated after those simulated, by their bounds), and the seconds the span tables,
    the DPs and the simulations took."""

    candidates: tuple[Candidate, ...]
    timings: dict[str, float]

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].plan is not None else None

    def runner_up(self, chosen: Candidate, *, same_count: bool = False) -> Candidate | None:
        """The best candidate of another schedule than `chosen`'s (another count of the same
        schedule says less), with `same_count` only of `chosen`'s count; None if none has a plan."""
        return next(
            (
                c
                for c in self.candidates
                if c.plan is not None
                and c.schedule != chosen.schedule
                and (not same_count or c.microbatches == chosen.microbatches)
            ),
            None,
        )


def choose_pipeline(
    space: PipelineSpace,
    schedules: Sequence[Schedule],
    counts: Sequence[int],
    *,
    by: Literal["eq2", "simulation"] = "simulation",
    num_runner_ups: int = 3,
) -> Choice:
    """Every (schedule, count)'s best plan, ranked (module docstring)."""
    candidates = []
    timings = {"span_costs": 0.0, "stage_dp": 0.0, "simulation": 0.0}
    for count in counts:
        layers, received, per_microbatch = _priced_at(space, count)
        flight_of = {
            schedule.name: tuple(schedule.in_flight(s, count) for s in range(1, space.max_stages + 1))
            for schedule in schedules
            if schedule.mesh_order is None
        }
        flights = list(dict.fromkeys(flight_of.values()))
        clock = time.perf_counter()
        tables = (
            span_tables(
                layers,
                received,
                space.meshes_of_submesh,
                space.transfer_seconds,
                space.submesh_sizes,
                microbatches=count,
                per_microbatch=per_microbatch,
                in_flights=[lambda s, f=flight: f[s - 1] for flight in flights],
                memory_per_device=space.memory_per_device,
                max_stages=space.max_stages,
                remat=space.remat,
            )
            if flights
            else []
        )
        timings["span_costs"] += time.perf_counter() - clock
        dps: dict[tuple[int, ...], tuple[SpanTable, object]] = {}
        for flight, table in zip(flights, tables):
            clock = time.perf_counter()
            try:
                result = stage_dp(
                    table.latency,
                    space.submesh_sizes,
                    space.num_devices,
                    count,
                    epsilon=space.epsilon,
                    num_runner_ups=num_runner_ups,
                    num_stages=space.num_stages,
                )
            except ValueError as error:
                result = str(error)
            timings["stage_dp"] += time.perf_counter() - clock
            dps[flight] = (table, result)
        for schedule in schedules:
            if schedule.mesh_order is not None:
                candidates.append(
                    _chunked_plans(space, schedule, count, layers, received, per_microbatch, num_runner_ups, timings)
                )
                continue
            flight = flight_of[schedule.name]
            table, result = dps[flight]
            if isinstance(result, str):
                candidates.append(Candidate(schedule.name, count, None, None, np.inf, np.inf, why=result))
                continue
            best = Slicing(result.stages, result.total_latency, result.t_max, result.sum_latency)
            if by == "eq2":
                candidates.append(
                    Candidate(
                        schedule.name,
                        count,
                        best,
                        table,
                        best.total_latency,
                        best.total_latency,
                        evaluated_t_max=result.evaluated_t_max,
                        others=result.runner_ups,
                    )
                )
                continue
            clock = time.perf_counter()
            plans = (best, *result.runner_ups)
            fitting = [
                _Priced(plan, table, result, plans) for plan in plans if _fits(space, schedule, count, table, plan)
            ]
            candidates.append(_Group.of(space, schedule, count, received, per_microbatch, fitting, 1))
            timings["simulation"] += time.perf_counter() - clock
    clock = time.perf_counter()
    candidates = _simulated(candidates, space.split)
    timings["simulation"] += time.perf_counter() - clock
    order = {id(c): k for k, c in enumerate(candidates)}
    ranked = sorted(candidates, key=lambda c: (c.score if by == "simulation" else c.seconds, c.at_least, order[id(c)]))
    if by == "eq2" and ranked and ranked[0].plan is not None and ranked[0].simulated is None:
        clock = time.perf_counter()
        best = ranked[0]
        _, received, per_microbatch = _priced_at(space, best.microbatches)
        seconds, _ = simulated_step(
            space, get_schedule(best.schedule), best.microbatches, best.table, best.plan, received, per_microbatch
        )
        ranked[0] = replace(best, simulated=seconds)
        timings["simulation"] += time.perf_counter() - clock
    return Choice(tuple(ranked), timings)


def _priced_at(space: PipelineSpace, count: int) -> tuple[LayerArrays, np.ndarray, bool]:
    """The layers' arrays and received bytes that price `count` microbatches, and whether they
    are per microbatch already (the split's own count)."""
    if space.split is None:
        return space.layers, space.received, False
    if count == space.split:
        return space.layers, space.received, True
    return space.layers.scaled(space.split), np.asarray(space.received) * space.split, False


@dataclass(frozen=True)
class _Priced:
    """A plan to simulate, with what its candidate would say of it: the span table it reads,
    the DP result and the DP's plans it came from (`chunks` stages per mesh)."""

    plan: Slicing
    table: SpanTable
    result: object
    plans: tuple[Slicing, ...]
    chunks: int = 1


@dataclass(frozen=True)
class _Group:
    """The plans of one (schedule, count) that fit, each with what its simulation reads and a
    time that simulation never undercuts (`iteration_lower_bound`, shrunk by a relative 1e-9
    so that rounding never lets it pass a time it ties)."""

    schedule: Schedule
    count: int
    priced: tuple[_Priced, ...]
    # (bound, costs, topology, comm, host)
    runs: tuple[tuple[float, list[StageCost], PipelineTopology, Callable, HostThread | None], ...]
    chunks: int  # stages per mesh; 0 where the plans have several counts of chunks

    @classmethod
    def of(cls, space, schedule, count, received, per_microbatch, priced: Sequence[_Priced], chunks: int) -> _Group:
        runs = []
        for p in priced:
            num_meshes = len(p.plan.stages) // p.chunks
            placement = None if p.chunks == 1 else schedule.placed(num_meshes, p.chunks)
            costs, topology, comm, host = _simulation_of(
                space, count, p.table, p.plan, received, per_microbatch, placement
            )
            bound = iteration_lower_bound(topology, costs, comm, count, schedule.split_backward) * (1 - 1e-9)
            runs.append((bound, costs, topology, comm, host))
        return cls(schedule, count, tuple(priced), tuple(runs), chunks)

    @property
    def bound(self) -> float:
        return min((run[0] for run in self.runs), default=np.inf)

    def best(self) -> Candidate:
        """The fastest plan in simulation (`Candidate.score`: of more meshes, faster by
        `MESH_MARGIN` a mesh; the first of equal scores), or why none fits. Plans are simulated
        in the order of their bounds; one whose bound is above the best score so far is not:
        it cannot win."""
        schedule, count = self.schedule, self.count
        if not self.priced:
            held = (
                "stashes (held until W)"
                if self.chunks == 1
                else f"{self.chunks} chunks per mesh (their memories summed)"
            )
            why = f"no plan of the stage DP fits {schedule.name}'s {held} in memory"
            return Candidate(schedule.name, count, None, None, np.inf, np.inf, why=why)
        best, best_at, best_score = None, -1, np.inf
        for k in sorted(range(len(self.runs)), key=lambda k: self.runs[k][0]):
            bound, costs, topology, comm, host = self.runs[k]
            if best is not None and (bound, k) > (best_score, best_at):
                if bound > best_score:
                    break  # so are the bounds after it (a score is at least its time)
                continue
            result = simulate(build_streams(topology, schedule, count), costs, comm, host)
            p = self.priced[k]
            score = result.iteration_time * _mesh_factor(len(p.plan.stages) // p.chunks)
            if best is None or (score, k) < (best_score, best_at):
                best, best_at, best_score = result, k, score
        p = self.priced[best_at]
        return Candidate(
            schedule.name,
            count,
            p.plan,
            p.table,
            best.iteration_time,
            p.plan.total_latency,
            best.bubble_fraction,
            evaluated_t_max=p.result.evaluated_t_max,
            others=tuple(q for q in p.plans if q.stages != p.plan.stages),
            chunks=p.chunks,
            simulated=best.iteration_time,
        )


def _simulated(slots: Sequence[Candidate | _Group], keep: int | None) -> list[Candidate]:
    """Each group's best (`_Group.best`), taken in the order of their bounds. A group of
    another count than `keep` (a split step's own) whose bound is above the best time found so
    far, and either of the best's schedule or above the best time of the other schedules too,
    is not simulated: it could be neither the choice nor its runner-up (`Choice.runner_up`),
    and the others only rank below them. Its candidate says so, with its bound."""
    done: dict[int, Candidate] = {}
    found: list[Candidate] = []
    groups = sorted((k for k, slot in enumerate(slots) if isinstance(slot, _Group)), key=lambda k: slots[k].bound)
    for k in groups:
        group = slots[k]
        if group.priced and group.count != keep and found:  # (without plans: why none fits)
            first = min(found, key=lambda c: c.score)
            second = min((c.score for c in found if c.schedule != first.schedule), default=None)
            if group.bound > first.score and (
                group.schedule.name == first.schedule or (second is not None and group.bound > second)
            ):
                why = (
                    f"not simulated: a step takes at least {group.bound:.4g} s (a lower bound), more than "
                    f"{first.seconds:.4g} s ({first.schedule}, B={first.microbatches})"
                )
                done[k] = Candidate(
                    group.schedule.name, group.count, None, None, np.inf, np.inf, why=why, at_least=group.bound
                )
                continue
        done[k] = group.best()
        if done[k].plan is not None:
            found.append(done[k])
    return [done.get(k, slot) for k, slot in enumerate(slots)]


def _chunked_plans(
    space, schedule, count, layers, received, per_microbatch, num_runner_ups, timings
) -> Candidate | _Group:
    """A several-stages-per-mesh schedule's plans that fit, over every (submesh, logical
    shape, chunks per mesh) (module docstring), or why none does."""
    num_layers = layers.latency.shape[1]
    fitting: list[_Priced] = []  # every (submesh, logical shape, v)'s DP plans that fit, in that order
    whys = []
    for m, size in enumerate(space.submesh_sizes):
        num_meshes = space.num_devices // size
        if num_meshes < 2 or num_meshes * size != space.num_devices or not space.meshes_of_submesh[m]:
            continue
        chunks, flights = [], []
        for v in (schedule.chunks,) if schedule.chunks else VIRTUAL_CHUNKS:
            stages = v * num_meshes
            if stages > num_layers or (space.num_stages is not None and stages != space.num_stages):
                continue
            try:
                held = schedule.chunk_stashes(num_meshes, v, count)
            except ValueError as error:  # interleaved-1f1b: the count is not a multiple of p
                whys.append(str(error))
                continue
            chunks.append(v)
            flights.append(lambda s, f=held: f[len(f) - s] if s <= len(f) else count)
        if not chunks:
            continue
        priced = _ChunkPricing(space, schedule, count, layers, received, per_microbatch, num_runner_ups, timings, m)
        for group in _shape_groups(space, m):
            tables = priced.tables(group, flights, space.memory_per_device, max(chunks) * num_meshes)
            for v, flight, table in zip(chunks, flights, tables):
                found = priced.fitting(table, num_meshes, v)
                if isinstance(found, _Unfit):
                    # Each chunk fits, a mesh's chunks together not: each chunk within 1/v of
                    # the memory, which the table meets by rematerializing where it can.
                    tighter = priced.tables(group, [flight], space.memory_per_device / v, v * num_meshes)[0]
                    found = priced.fitting(tighter, num_meshes, v)
                    if isinstance(found, str):
                        found = f"{_unfit(schedule, v)}; nor with each chunk in 1/{v} of it: {found}"
                    elif isinstance(found, _Unfit):
                        found = f"{_unfit(schedule, v)}; nor with each chunk in 1/{v} of it: {_unfit(schedule, v)}"
                if isinstance(found, str):
                    whys.append(f"{num_meshes} meshes of {size} device(s), {v} chunks: {found}")
                else:
                    fitting += found
    if not fitting:
        why = "; ".join(dict.fromkeys(whys)) or (
            f"no {schedule.name} plan: it needs at least 2 meshes of one submesh size and "
            f"{min(VIRTUAL_CHUNKS if schedule.chunks is None else (schedule.chunks,))} or more layers per mesh"
        )
        return Candidate(schedule.name, count, None, None, np.inf, np.inf, why=why)
    clock = time.perf_counter()
    group = _Group.of(space, schedule, count, received, per_microbatch, fitting, 0)
    timings["simulation"] += time.perf_counter() - clock
    return group


@dataclass(frozen=True)
class _ChunkPricing:
    """What pricing one (schedule, count) on submesh `submesh` with chunks reads."""

    space: PipelineSpace
    schedule: Schedule
    count: int
    layers: LayerArrays
    received: np.ndarray
    per_microbatch: bool
    num_runner_ups: int
    timings: dict
    submesh: int

    def tables(self, group, in_flights, memory: float, max_stages: int) -> list[SpanTable]:
        """Span tables with only the submesh's logical meshes `group`, one per in-flight rule."""
        clock = time.perf_counter()
        sizes = self.space.submesh_sizes
        found = span_tables(
            self.layers,
            self.received,
            [group if k == self.submesh else [] for k in range(len(sizes))],
            self.space.transfer_seconds,
            sizes,
            microbatches=self.count,
            per_microbatch=self.per_microbatch,
            in_flights=in_flights,
            memory_per_device=memory,
            max_stages=max_stages,
            remat=self.space.remat,
        )
        self.timings["span_costs"] += time.perf_counter() - clock
        return found

    def fitting(self, table: SpanTable, num_meshes: int, chunks: int) -> list[_Priced] | _Unfit | str:
        """The DP's v p stages on the table (the submesh's devices counted once per chunk):
        those of its plans that fit their meshes; `_Unfit` where it found plans and none fit;
        why where it found none."""
        space, count = self.space, self.count
        num_stages = chunks * num_meshes
        clock = time.perf_counter()
        try:
            result = stage_dp(
                table.latency,
                space.submesh_sizes,
                num_stages * space.submesh_sizes[self.submesh],
                count,
                epsilon=space.epsilon,
                num_runner_ups=self.num_runner_ups,
                num_stages=num_stages,
            )
        except ValueError:  # its words count the submesh's devices once per chunk: say it here
            return f"no cut of the layers into {num_stages} stages fits in memory chunk by chunk"
        finally:
            self.timings["stage_dp"] += time.perf_counter() - clock
        clock = time.perf_counter()
        plans = (Slicing(result.stages, result.total_latency, result.t_max, result.sum_latency), *result.runner_ups)
        fit = [
            _Priced(plan, table, result, plans, chunks)
            for plan in plans
            if _meshes_fit(space, self.schedule, count, table, plan, num_meshes, chunks)
        ]
        self.timings["simulation"] += time.perf_counter() - clock
        return fit or _Unfit()


class _Unfit:
    """The DP found plans and none fits its meshes with their chunks' memories summed."""


def _unfit(schedule: Schedule, chunks: int) -> str:
    return f"no plan of the stage DP fits {schedule.name}'s {chunks} chunks per mesh (their memories summed) in memory"


def _shape_groups(space: PipelineSpace, m: int) -> list[list[int]]:
    """The logical meshes of submesh m by logical shape (a mesh's chunks share one shape)."""
    if not space.mesh_shapes:
        return [list(space.meshes_of_submesh[m])]
    groups: dict[tuple[int, ...], list[int]] = {}
    for g in space.meshes_of_submesh[m]:
        groups.setdefault(tuple(space.mesh_shapes[g]), []).append(g)
    return list(groups.values())


def _meshes_fit(space, schedule, count, table, plan, num_meshes: int, chunks: int) -> bool:
    """Whether each mesh holds its chunks: per phase, the sum of its chunks' memories (the
    forward and backward's with each chunk's stashes, `Schedule.chunk_stashes`; the update's)."""
    placement = schedule.placed(num_meshes, chunks)
    stashes = schedule.chunk_stashes(num_meshes, chunks, count)
    num_stages = len(plan.stages)
    held, updating = np.zeros(num_meshes), np.zeros(num_meshes)
    for k, stage in enumerate(plan.stages):
        at = (stage.start_layer, stage.end_layer, stage.submesh_index, num_stages - k - 1)
        held[placement[k]] += table.base_memory[at] + table.stash_bytes[at] * stashes[k]
        updating[placement[k]] += table.update_memory[at]
    return bool(np.all(np.maximum(held, updating) <= space.memory_per_device))


def _fits(space: PipelineSpace, schedule: Schedule, count: int, table: SpanTable, plan: Slicing) -> bool:
    num_stages = len(plan.stages)
    for k, stage in enumerate(plan.stages):
        at = (stage.start_layer, stage.end_layer, stage.submesh_index, num_stages - k - 1)
        held = table.base_memory[at] + table.stash_bytes[at] * schedule.stashes(num_stages, k, count)
        if max(held, table.update_memory[at]) > space.memory_per_device:
            return False
    return True


def simulated_step(
    space: PipelineSpace,
    schedule: Schedule,
    count: int,
    table: SpanTable,
    plan: Slicing,
    received: np.ndarray,
    per_microbatch: bool,
    placement: Sequence[int] | None = None,
) -> tuple[float, float]:
    """The simulated step time and bubble fraction of `plan` under `schedule` (module
    docstring); `received` the bytes per step (per microbatch where `per_microbatch`) that
    layer b reads from layer a, at [a, b]; `placement` the mesh of each stage where meshes
    hold several (None: stage k on mesh k)."""
    costs, topology, comm, host = _simulation_of(space, count, table, plan, received, per_microbatch, placement)
    result = simulate(build_streams(topology, schedule, count), costs, comm, host)
    return result.iteration_time, result.bubble_fraction


def _simulation_of(space, count, table, plan, received, per_microbatch, placement):
    """What `simulated_step` simulates: the stages' costs, the topology, the links and the
    host thread (`_host_thread`)."""
    num_stages = len(plan.stages)
    costs = []
    for k, stage in enumerate(plan.stages):
        i, j, m = stage.start_layer, stage.end_layer, stage.submesh_index
        compute = max(float(table.latency[i, j, m, num_stages - k - 1]) - float(table.transfer[i, j, m]), 0.0)
        forward = compute / 3 if table.forward is None else float(table.forward[i, j, m, num_stages - k - 1])
        forward = min(forward, compute)
        costs.append(StageCost(forward, compute - forward))
    per_micro = np.asarray(received, dtype=float) / (1 if per_microbatch else count)
    spans = [(s.start_layer, s.end_layer + 1) for s in plan.stages]
    edges = []
    for a in range(num_stages):
        for b in range(a + 1, num_stages):
            forward = per_micro[spans[a][0] : spans[a][1], spans[b][0] : spans[b][1]].sum()
            backward = per_micro[spans[b][0] : spans[b][1], spans[a][0] : spans[a][1]].sum()
            if forward > 0 or backward > 0:
                edges.append(Edge(a, b, int(forward), int(backward)))
    meshes = () if placement is None else tuple(f"m{j + 1}" for j in placement)
    topology = PipelineTopology(num_stages, tuple(edges), meshes=meshes)
    size_of = {mesh: space.submesh_sizes[s.submesh_index] for mesh, s in zip(topology.meshes, plan.stages)}

    def comm(src: str, dst: str, nbytes: int) -> float:
        return space.transfer_seconds(nbytes, size_of[dst]) if nbytes > 0 else 0.0

    return costs, topology, comm, _host_thread(space, count, plan, size_of)


def _host_thread(space: PipelineSpace, count: int, plan: Slicing, size_of: dict[str, int]) -> HostThread | None:
    """The host thread of `space.host` for `plan`: each stage's launches (a forward, a
    backward, an update), each mesh's share of the devices, the launches the latencies hold.
    None where not priced, or for one stage of one microbatch: that plan runs as one
    executable (`codegen.one_program`), its one launch in its latency. (Priced as one launch
    with every value its layers hand over, it came out dearer than two meshes at one
    microbatch, which then ran 1.1-1.2x slower: docs/performance.md, "One host thread".)"""
    host = space.host
    if host is None or (len(plan.stages) == 1 and count == 1):
        return None
    each = space.layers.launch_s  # a run's launch in the latencies: (2 + 1/B) a microbatch (`span_costs`)
    launch, counted = {}, {}
    for k, stage in enumerate(plan.stages):
        fixed = host.launch_s + host.device_s * space.submesh_sizes[stage.submesh_index]
        forward, backward, update = (
            float(v) for v in host.values[:, stage.start_layer : stage.end_layer + 1].sum(axis=1)
        )
        launch[k] = tuple(fixed + values * host.value_s for values in (forward, backward, update))
        counted[k] = (
            each + forward * host.counted_value_s,
            each * (1 + 1 / count) + (backward + update / count) * host.counted_value_s,
        )
    share = {mesh: size / host.devices for mesh, size in size_of.items()} if host.shares_cores else None
    return HostThread(launch, share, counted)
