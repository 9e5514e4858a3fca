"""A discrete-event simulation of the per-mesh instruction streams of one training step.

Each mesh has a compute stream (RUN, ACCUMULATE, UPDATE) and a communication side split in
two streams, send and receive, since links are full duplex (cross-mesh paper, §3). An
instruction starts once its deps are done and everything before it on its stream is done;
a SEND also waits for the links it needs (`CommModel.links`), first come first served, and
carries the transfer; its RECV completes when the SEND does. FREE runs on no stream.
Peak memory counts the buffers instructions allocate (stashes, sent and received tensors),
not parameters or optimizer state, which do not depend on the schedule.

Where one host thread plays every mesh (`HostThread`: the in-process runtime), the step takes
at least that thread's work (its launches and copies, one after the other), and, where the
devices compute on the host's cores, its work and the devices' summed: the simulated time is
the larger of the event loop's and that bound.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hlopar.analysis.schedules.costs import CommModel, HostThread, StageCost, as_comm_model
from hlopar.analysis.schedules.instructions import (
    ACCUMULATE,
    FREE,
    RECV,
    RUN,
    SEND,
    UPDATE,
    Instruction,
    PipelineStreams,
)
from hlopar.analysis.schedules.tasks import BACKWARD, FORWARD, WEIGHT
from hlopar.analysis.schedules.topology import PipelineTopology

__all__ = [
    "COMPUTE",
    "SEND_STREAM",
    "RECV_STREAM",
    "Event",
    "SimResult",
    "DeadlockError",
    "iteration_lower_bound",
    "simulate",
]

COMPUTE, SEND_STREAM, RECV_STREAM = "compute", "send", "recv"
_STREAM_OF = {RUN: COMPUTE, ACCUMULATE: COMPUTE, UPDATE: COMPUTE, SEND: SEND_STREAM, RECV: RECV_STREAM}


class DeadlockError(RuntimeError):
    """Streams that cannot progress: `stuck` maps each blocked instruction to what it waits for."""

    def __init__(self, message: str, stuck: dict[str, list[str]]):
        super().__init__(message)
        self.stuck = stuck


@dataclass(frozen=True)
class Event:
    """When one instruction ran."""

    id: str
    mesh: str
    stream: str  # compute, send, recv, or "" for FREE
    op: str
    kind: str
    microbatch: int | None
    peer: str  # the other mesh of a SEND or RECV
    start: float
    end: float

    @property
    def label(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return {RUN: f"{self.kind}{mb}", ACCUMULATE: f"A{mb}", UPDATE: "U"}.get(self.op, f"{self.kind}{mb}")


@dataclass(frozen=True)
class SimResult:
    """What a run of the streams took. `events` and `peak_memory` are made from the run when
    first read: the planner ranks thousands of runs by their time alone."""

    schedule: str
    meshes: tuple[str, ...]
    iteration_time: float
    bubble_fraction: float  # idle compute time over meshes x iteration time
    compute_busy: dict[str, float]
    # The run: the instructions, each one's stream (None for FREE), start and end times.
    run: tuple[list[Instruction], list[tuple[str, str] | None], list[float], list[float]] = field(
        repr=False, compare=False
    )

    @functools.cached_property
    def events(self) -> tuple[Event, ...]:
        insts, stream_key, start, finish = self.run
        return tuple(
            Event(
                inst.id,
                inst.mesh,
                key[1] if key else "",
                inst.op,
                inst.kind,
                inst.microbatch,
                inst.peer,
                start[i],
                finish[i],
            )
            for i, (inst, key) in enumerate(zip(insts, stream_key))
        )

    @functools.cached_property
    def peak_memory(self) -> dict[str, int]:
        """Bytes per mesh."""
        return self.peak_live()

    def peak_live(self, counted: Callable[[str], bool] = lambda buffer: True) -> dict[str, int]:
        """Per mesh, the most bytes of the buffers `counted` (by name) live at once: a buffer
        lives from its allocating instruction's start to its FREE's end (frees first at equal
        times)."""
        insts, _, start, finish = self.run
        changes: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
        for i, inst in enumerate(insts):
            changes.setdefault(inst.mesh, [])
            for name, nbytes in inst.allocates:
                if counted(name):
                    changes[inst.mesh].append((start[i], 1, nbytes))
            if inst.op == FREE and counted(inst.buffer):
                changes[inst.mesh].append((finish[i], 0, -inst.nbytes))
        peaks = {}
        for mesh, items in changes.items():
            live = peak = 0
            for _, _, delta in sorted(items):
                live += delta
                peak = max(peak, live)
            peaks[mesh] = peak
        return peaks

    @property
    def steady_period(self) -> float:
        """Step time, at most, when steps run back to back and each mesh starts its next step
        once its own streams are through: no barrier between meshes at the optimizer step, the
        zero-bubble paper's post-validation (Qi et al., 2024, §4). Shifting the whole step by
        the longest stream's span (first start to last end) keeps every dependency and stream
        order; links shared across steps are not modelled. hlopar's executors end a step on all
        meshes together, so their step time is `iteration_time`, which this never exceeds."""
        spans: dict[tuple[str, str], list[float]] = {}
        for e in self.events:
            if e.stream:
                span = spans.setdefault((e.mesh, e.stream), [e.start, e.end])
                span[0], span[1] = min(span[0], e.start), max(span[1], e.end)
        return max((end - start for start, end in spans.values()), default=0.0)

    @property
    def steady_bubble_fraction(self) -> float:
        """Idle compute over meshes x `steady_period`: the bubble of back-to-back steps."""
        period = self.steady_period
        if period <= 0:
            return 0.0
        return sum(period - busy for busy in self.compute_busy.values()) / (len(self.meshes) * period)


def simulate(  # noqa: C901 (one event loop; reason in the docstring)
    streams: PipelineStreams,
    costs: Sequence[StageCost],
    comm: CommModel | Callable[[str, str, int], float] | None = None,
    host: HostThread | None = None,
) -> SimResult:
    """Run `streams` with per-stage `costs` (indexed by stage) and transfers priced by `comm`
    (default: alpha-beta at 10 Gbps); raises `DeadlockError` if some stream cannot finish.
    `host`: the thread that plays every mesh, where one does (module docstring).

    One function on purpose: a discrete-event loop whose small closures (`push`, `offer`)
    share its queues and clocks; split into functions they would hand a dozen values around."""
    comm = as_comm_model(comm)
    stream_of = {s.mesh: s for s in streams.streams}
    for s in streams.streams:
        for stage in s.stages:
            if not 0 <= stage < len(costs):
                raise ValueError(f"no cost for stage {stage} of mesh {s.mesh} ({len(costs)} given)")
    insts: list[Instruction] = list(streams.instructions())
    index = {inst.id: i for i, inst in enumerate(insts)}
    n = len(insts)

    def duration(inst: Instruction) -> float:
        stream = stream_of[inst.mesh]
        if inst.op == UPDATE:  # a mesh's one update: all its stages'
            return sum(costs[k].update for k in stream.stages)
        cost = costs[stream.stage_of(inst)]
        if inst.op == RUN:
            return cost.run_time(inst.kind, streams.split_backward)
        if inst.op == ACCUMULATE:
            return cost.accumulate
        if inst.op == SEND:
            return comm.time(inst.mesh, inst.peer, inst.nbytes)
        return 0.0

    stream_key: list[tuple[str, str] | None] = [
        (inst.mesh, _STREAM_OF[inst.op]) if inst.op in _STREAM_OF else None for inst in insts
    ]
    queues: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in enumerate(stream_key):
        if key is not None:
            queues[key].append(i)
    head = {key: 0 for key in queues}
    stream_free = {key: 0.0 for key in queues}
    link_free: dict[str, float] = defaultdict(float)
    deps = [sorted({index[d] for d in inst.deps}) for inst in insts]
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for d in ds:
            dependents[d].append(i)
    start: list[float | None] = [None] * n
    finish: list[float | None] = [None] * n
    heap: list[tuple[float, int, int]] = []
    seq = 0

    def push(i: int, t: float) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, i))
        seq += 1

    def offer(i: int) -> None:
        """Queue i if its deps are done and it heads its stream."""
        key = stream_key[i]
        if waiting[i] or (key is not None and queues[key][head[key]] != i):
            return
        t = max((finish[d] for d in deps[i]), default=0.0)
        push(i, max(t, stream_free[key]) if key is not None else t)

    for q in queues.values():
        offer(q[0])
    for i, key in enumerate(stream_key):
        if key is None:
            offer(i)

    done = 0
    while heap:
        t, _, i = heapq.heappop(heap)
        inst = insts[i]
        links = comm.links(inst.mesh, inst.peer) if inst.op == SEND else ()
        ready = max((link_free[link] for link in links), default=0.0)
        if ready > t:
            push(i, ready)
            continue
        start[i], finish[i] = t, t + duration(inst)
        for link in links:
            link_free[link] = finish[i]
        done += 1
        key = stream_key[i]
        if key is not None:
            stream_free[key] = finish[i]
            head[key] += 1
            if head[key] < len(queues[key]):
                offer(queues[key][head[key]])
        for j in dependents[i]:
            waiting[j] -= 1
            if not waiting[j]:
                offer(j)

    if done < n:
        stuck = {}
        for key, q in queues.items():
            if head[key] < len(q):
                i = q[head[key]]
                stuck[insts[i].id] = [insts[d].id for d in deps[i] if finish[d] is None]
        lines = [f"{s} ({insts[index[s]].describe()}) waits for {', '.join(w) or 'nothing'}" for s, w in stuck.items()]
        raise DeadlockError(
            f"deadlock: {n - done} of {n} instructions never run; stream heads:\n  " + "\n  ".join(lines), stuck
        )

    total = max(max(finish, default=0.0), _host_bound(streams, insts, start, finish, host) if host else 0.0)
    busy = {mesh: 0.0 for mesh in streams.meshes}
    for i, key in enumerate(stream_key):
        if key is not None and key[1] == COMPUTE:
            busy[key[0]] += finish[i] - start[i]
    meshes = streams.meshes
    idle = sum(total - busy[m] for m in meshes)
    bubble = idle / (len(meshes) * total) if total > 0 else 0.0
    return SimResult(streams.schedule, meshes, total, bubble, busy, (insts, stream_key, start, finish))


def _host_bound(
    streams: PipelineStreams, insts: list[Instruction], start: list, finish: list, host: HostThread
) -> float:
    """The host thread's work (`HostThread`): every fragment run's launch (a RUN names its
    executables where a program is known: each is a launch) and every transfer; plus, where
    devices share its cores, every compute instruction's time times its mesh's share, less
    the launches those times already hold (`HostThread.counted`, per microbatch: a stage's
    forward RUN stands for its microbatch)."""
    stream_of = {s.mesh: s for s in streams.streams}
    host_work = device_work = 0.0
    for i, inst in enumerate(insts):
        if inst.op == SEND:
            host_work += finish[i] - start[i]
        elif inst.op in (RUN, UPDATE):
            stream = stream_of[inst.mesh]
            stages = stream.stages if inst.op == UPDATE else (stream.stage_of(inst),)
            for stage in stages:
                forward, backward, update = host.launch.get(stage, (0.0, 0.0, 0.0))
                if inst.op == UPDATE:
                    host_work += update
                else:
                    host_work += (forward if inst.kind == FORWARD else backward) * max(1, len(inst.executables))
        if host.share is not None and inst.op in (RUN, ACCUMULATE, UPDATE):
            share = host.share.get(inst.mesh, 1.0)
            device_work += (finish[i] - start[i]) * share
            if inst.op == RUN and inst.kind == FORWARD:
                device_work -= sum(host.counted.get(stream_of[inst.mesh].stage_of(inst), (0.0, 0.0))) * share
    return host_work + max(device_work, 0.0)


def iteration_lower_bound(
    topology: PipelineTopology,
    costs: Sequence[StageCost],
    comm: CommModel | Callable[[str, str, int], float] | None,
    num_microbatches: int,
    split_backward: bool,
) -> float:
    """A time `simulate` never undercuts for any schedule's streams on `topology` (the planner
    skips a plan whose bound is above the best time already simulated; it costs O(stages +
    edges), a simulation O(microbatches x stages)).

    Every compute instruction of a mesh runs after the earliest forward of one of its stages
    can start, and its compute stream runs them one at a time, so the step takes at least
    that start plus their durations. A stage's forward of any microbatch starts no earlier
    than its inputs' forwards of that microbatch ended and their activations arrived (a
    transfer takes at least `comm.time`; links shared only delay it): the longest path to
    the stage through the forward edges."""
    comm = as_comm_model(comm)
    meshes = topology.meshes
    earliest = [0.0] * topology.num_stages
    for k in range(topology.num_stages):  # edges go from lower to higher stages
        for e in topology.inputs(k):
            moved = 0.0 if meshes[e.src] == meshes[k] else comm.time(meshes[e.src], meshes[k], e.nbytes)
            earliest[k] = max(earliest[k], earliest[e.src] + costs[e.src].forward + moved)
    bound = 0.0
    for mesh in topology.mesh_names:
        stages = topology.stages_on(mesh)
        busy = 0.0
        for k in stages:
            cost = costs[k]
            kinds = (FORWARD, BACKWARD, WEIGHT) if split_backward else (FORWARD, BACKWARD)
            per_microbatch = sum(cost.run_time(kind, split_backward) for kind in kinds) + cost.accumulate
            busy += num_microbatches * per_microbatch + cost.update
        bound = max(bound, min(earliest[k] for k in stages) + busy)
    return bound
