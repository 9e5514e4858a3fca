"""Pipeline schedules as per-stage task orders: warm-up forwards, then one forward one backward.

GPipe, 1F1B and eager-1F1B differ only in how many forwards stage k runs before its first
backward (its warm-up); after that a stage alternates backward and forward until its forwards
run out, then runs the remaining backwards. Backward weight delaying (cross-mesh resharding
paper, §4) splits each backward into B (gradients of the stage's inputs, which other stages
wait for) and W (gradients of its weights, which nobody waits for) and moves W later, so the
gradient sends overlap with it. Zero-bubble pipelines (Qi et al., ICLR 2024) split it the
same way and place W, per stage, where the pipeline would otherwise idle (`weight_lag`).

Several stages may share a mesh (virtual stages: v chunks of layers per mesh, Narayanan et
al., SC'21): a schedule for them (`mesh_order`) gives each mesh's tasks in one order, each task
naming its chunk, and its `placement` says which stage chunk c of mesh j is: "loop" stage
c p + j (interleaved 1F1B), "v" stage j for chunk 0 and 2p - 1 - j for chunk 1 (ZB-V's V).

Stages are counted from 0 here; the papers count them from 1 (stage i = k + 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "LOOP",
    "V_SHAPE",
    "Task",
    "Schedule",
    "max_in_flight",
    "max_stashes",
    "stage_placement",
]

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"

# (num_stages, stage, num_microbatches) -> forwards before the first backward, before clamping.
WarmupRule = Callable[[int, int, int], int]
# (num_stages, stage, num_microbatches) -> how many backwards B(m) waits for before W(m) runs.
WeightLagRule = Callable[[int, int, int], int]
# (num_meshes, chunks, mesh, num_microbatches) -> the mesh's tasks in order, each naming its chunk.
MeshOrderRule = Callable[[int, int, int, int], "list[Task]"]

LOOP, V_SHAPE = "loop", "v"  # chunk c of mesh j holds stage c p + j; or j, then 2p - 1 - j (v = 2)


def stage_placement(placement: str, num_meshes: int, chunks: int) -> tuple[int, ...]:
    """The mesh (0..p-1) of each stage 0..v p - 1 under `placement` (module docstring)."""
    if num_meshes < 1 or chunks < 1:
        raise ValueError(f"need at least one mesh and one chunk, got {num_meshes} meshes, {chunks} chunks")
    if placement == LOOP:
        return tuple(s % num_meshes for s in range(num_meshes * chunks))
    if placement == V_SHAPE:
        if chunks != 2:
            raise ValueError(f"the V placement holds 2 chunks per mesh, got {chunks}")
        return tuple(s if s < num_meshes else 2 * num_meshes - 1 - s for s in range(2 * num_meshes))
    raise ValueError(f"unknown placement {placement!r}; valid: {LOOP}, {V_SHAPE}")


@dataclass(frozen=True, order=True)
class Task:
    """One computation of one stage: its forward F, backward B or weight-gradient W on a
    microbatch; `chunk`: which of its mesh's stages (0 where a mesh holds one)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """A named schedule: its warm-up rule and, when backwards are split, where W runs.

    Backwards are whole unless one of two W placements is given. `weight_delay`: W(m) runs
    after the `weight_delay`-th F or B that follows B(m) on the stage (0: right after B(m)).
    `weight_lag`, a rule per stage like the warm-up: W(m) runs right after B(m + lag). Either
    way any W still pending at the end runs last, in microbatch order.

    A schedule for several stages per mesh gives `mesh_order` instead (its warm-up rule is
    then its order's on one chunk), its `placement`, `chunks` where it needs a fixed count
    (None: any), and `split` where its order holds W tasks.
    """

    name: str
    warmup_rule: WarmupRule
    description: str = ""
    weight_delay: int | None = None
    weight_lag: WeightLagRule | None = None
    mesh_order: MeshOrderRule | None = None
    placement: str = LOOP
    chunks: int | None = None
    split: bool = False

    def __post_init__(self) -> None:
        if self.weight_delay is not None and self.weight_delay < 0:
            raise ValueError(f"weight_delay must be >= 0 or None, got {self.weight_delay}")
        if self.weight_delay is not None and self.weight_lag is not None:
            raise ValueError("give weight_delay or weight_lag, not both")
        if self.mesh_order is not None and (self.weight_delay is not None or self.weight_lag is not None):
            raise ValueError("a mesh order places its own W tasks: give no weight_delay or weight_lag")
        stage_placement(self.placement, 1, self.chunks or (2 if self.placement == V_SHAPE else 1))

    @property
    def split_backward(self) -> bool:
        return self.weight_delay is not None or self.weight_lag is not None or self.split

    def allows(self, chunks: int) -> bool:
        """Whether the schedule runs with `chunks` stages per mesh."""
        if self.mesh_order is None:
            return chunks == 1
        return self.chunks is None or self.chunks == chunks

    def check_chunks(self, chunks: int) -> None:
        if not self.allows(chunks):
            wanted = "one stage" if self.mesh_order is None else f"{self.chunks} stages"
            raise ValueError(f"schedule {self.name} runs {wanted} per mesh, not {chunks}")

    def placed(self, num_meshes: int, chunks: int) -> tuple[int, ...]:
        """The mesh of each stage (`stage_placement` of this schedule's placement)."""
        self.check_chunks(chunks)
        return stage_placement(self.placement, num_meshes, chunks)

    def warmup(self, num_stages: int, stage: int, num_microbatches: int) -> int:
        """Forwards stage `stage` runs before its first backward, at least 1 and at most B."""
        _check_shape(num_stages, num_microbatches)
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        return max(1, min(num_microbatches, self.warmup_rule(num_stages, stage, num_microbatches)))

    def stage_tasks(self, num_stages: int, stage: int, num_microbatches: int) -> list[Task]:
        """The ordered tasks of one stage (one stage per mesh)."""
        if self.mesh_order is not None:
            return self.mesh_tasks(num_stages, 1, stage, num_microbatches)
        warmup = self.warmup(num_stages, stage, num_microbatches)
        order = [Task(FORWARD, m) for m in range(warmup)]
        for m in range(num_microbatches):
            order.append(Task(BACKWARD, m))
            if warmup + m < num_microbatches:
                order.append(Task(FORWARD, warmup + m))
        if self.weight_lag is not None:
            lag = self.weight_lag(num_stages, stage, num_microbatches)
            if lag < 0:
                raise ValueError(f"{self.name}: weight lag of stage {stage} must be >= 0, got {lag}")
            return _lag_weights(order, lag)
        if self.weight_delay is None:
            return order
        return _delay_weights(order, self.weight_delay)

    def mesh_tasks(self, num_meshes: int, chunks: int, mesh: int, num_microbatches: int) -> list[Task]:
        """The ordered tasks of mesh `mesh` of `num_meshes`, each holding `chunks` stages."""
        _check_shape(num_meshes, num_microbatches)
        self.check_chunks(chunks)
        if not 0 <= mesh < num_meshes:
            raise ValueError(f"mesh {mesh} out of range for {num_meshes} meshes")
        if self.mesh_order is None:
            return self.stage_tasks(num_meshes, mesh, num_microbatches)
        return self.mesh_order(num_meshes, chunks, mesh, num_microbatches)

    def in_flight(self, stages_after: int, num_microbatches: int) -> int:
        """Microbatches whose activations a stage holds at once (forward run, its B not yet)
        when `stages_after` stages run from it to the last, itself included: the factor of
        mem_act in Alpa's Eq. 5, which the stage DP reads. The DP knows a stage only by the
        stages after it, so this counts stage 0 of a `stages_after`-stage pipeline: every
        warm-up rule counts the stages from a stage to the last. What a split backward keeps
        from B(m) to W(m) (B's carry, W's inputs) is not in this count. With several stages
        per mesh, `chunk_in_flight`."""
        return max_in_flight(self.stage_tasks(stages_after, 0, num_microbatches))

    def stashes(self, num_stages: int, stage: int, num_microbatches: int) -> int:
        """Microbatches whose stash stage `stage` of a `num_stages`-stage pipeline holds at
        once, each from its F to its W where backwards are split (W reads the stash too), else
        to its B: what the stage's memory holds of activations, which `in_flight` (the DP's
        Eq. 5 count, knowing only the stages after a stage) undercounts for a W held back.
        With several stages per mesh, `chunk_stashes`."""
        return max_stashes(self.stage_tasks(num_stages, stage, num_microbatches))

    def tasks(self, num_stages: int, num_microbatches: int) -> list[list[Task]]:
        """Per stage, its ordered tasks (one stage per mesh)."""
        _check_shape(num_stages, num_microbatches)
        return [self.stage_tasks(num_stages, k, num_microbatches) for k in range(num_stages)]

    def chunk_tasks(self, num_meshes: int, chunks: int, num_microbatches: int) -> list[list[Task]]:
        """Per stage (0..v p - 1), its ordered tasks, taken from its mesh's order."""
        placed = self.placed(num_meshes, chunks)
        out: list[list[Task]] = [[] for _ in placed]
        for j in range(num_meshes):
            stages = [s for s, mesh in enumerate(placed) if mesh == j]
            for task in self.mesh_tasks(num_meshes, chunks, j, num_microbatches):
                out[stages[task.chunk]].append(Task(task.kind, task.microbatch))
        return out

    def chunk_in_flight(self, num_meshes: int, chunks: int, num_microbatches: int) -> tuple[int, ...]:
        """Per stage, Eq. 5's factor with chunks: the most of its own forwards whose B has not
        run. A mesh holds its chunks' together: at most the sum of theirs (`mesh_stashes`
        counts the peak of the sum itself)."""
        return tuple(max_in_flight(order) for order in self.chunk_tasks(num_meshes, chunks, num_microbatches))

    def chunk_stashes(self, num_meshes: int, chunks: int, num_microbatches: int) -> tuple[int, ...]:
        """Per stage, the most of its stashes held at once (to W where split, else to B)."""
        return tuple(max_stashes(order) for order in self.chunk_tasks(num_meshes, chunks, num_microbatches))

    def mesh_in_flight(self, num_meshes: int, chunks: int, mesh: int, num_microbatches: int) -> int:
        """Eq. 5's factor of a mesh with chunks: the most chunk forwards, of all its chunks
        together, whose B has not run (each a chunk's activations: 1/v of a stage's where the
        layers are cut evenly)."""
        return max_in_flight(self.mesh_tasks(num_meshes, chunks, mesh, num_microbatches))

    def mesh_stashes(self, num_meshes: int, chunks: int, mesh: int, num_microbatches: int) -> int:
        """The most stashes of all of a mesh's chunks held at once (to W where split, else B)."""
        return max_stashes(self.mesh_tasks(num_meshes, chunks, mesh, num_microbatches))


def _delay_weights(order: list[Task], delay: int) -> list[Task]:
    out: list[Task] = []
    pending: list[list[int]] = []  # [microbatch, tasks still to wait], in microbatch order
    for task in order:
        out.append(task)
        for item in pending:
            item[1] -= 1
        if task.kind == BACKWARD:
            pending.append([task.microbatch, delay])
        while pending and pending[0][1] <= 0:
            out.append(Task(WEIGHT, pending.pop(0)[0]))
    out.extend(Task(WEIGHT, m) for m, _ in pending)
    return out


def _lag_weights(order: list[Task], lag: int) -> list[Task]:
    out: list[Task] = []
    pending: list[int] = []  # microbatches whose B ran and W did not, in order
    for task in order:
        out.append(task)
        if task.kind == BACKWARD:
            pending.append(task.microbatch)
            if len(pending) > lag:
                out.append(Task(WEIGHT, pending.pop(0)))
    out.extend(Task(WEIGHT, m) for m in pending)
    return out


def max_in_flight(order: list[Task]) -> int:
    """Most forwards whose backward B has not run yet, over the order."""
    return _peak_live(order, BACKWARD)


def max_stashes(order: list[Task]) -> int:
    """Most microbatches whose F ran and whose last backward task (W where the order has W,
    else B) did not, over the order."""
    return _peak_live(order, WEIGHT if any(task.kind == WEIGHT for task in order) else BACKWARD)


def _peak_live(order: list[Task], ends: str) -> int:
    """Most (chunk, microbatch) whose F ran and whose task of kind `ends` did not, over the order."""
    live = peak = 0
    for task in order:
        if task.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif task.kind == ends:
            live -= 1
    return peak


def _check_shape(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"need at least one microbatch, got {num_microbatches}")
