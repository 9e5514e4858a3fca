"""Pipeline schedules as per-stage task orders: warm-up forwards, then one forward one backward.

GPipe, 1F1B and eager-1F1B differ only in how many forwards stage k runs before its first
backward (its warm-up); after that a stage alternates backward and forward until its forwards
run out, then runs the remaining backwards. Backward weight delaying (cross-mesh resharding
paper, §4) splits each backward into B (gradients of the stage's inputs, which other stages
wait for) and W (gradients of its weights, which nobody waits for) and moves W later, so the
gradient sends overlap with it. Zero-bubble pipelines (Qi et al., ICLR 2024) split it the
same way and place W, per stage, where the pipeline would otherwise idle (`weight_lag`).

Stages are counted from 0 here; the papers count them from 1 (stage i = k + 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FORWARD", "BACKWARD", "WEIGHT", "Task", "Schedule", "max_in_flight", "max_stashes"]

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"

# (num_stages, stage, num_microbatches) -> forwards before the first backward, before clamping.
WarmupRule = Callable[[int, int, int], int]
# (num_stages, stage, num_microbatches) -> how many backwards B(m) waits for before W(m) runs.
WeightLagRule = Callable[[int, int, int], int]


@dataclass(frozen=True, order=True)
class Task:
    """One computation of one stage: its forward F, backward B or weight-gradient W on a microbatch."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A named schedule: its warm-up rule and, when backwards are split, where W runs.

    Backwards are whole unless one of two W placements is given. `weight_delay`: W(m) runs
    after the `weight_delay`-th F or B that follows B(m) on the stage (0: right after B(m)).
    `weight_lag`, a rule per stage like the warm-up: W(m) runs right after B(m + lag). Either
    way any W still pending at the end runs last, in microbatch order.
    """

    name: str
    warmup_rule: WarmupRule
    description: str = ""
    weight_delay: int | None = None
    weight_lag: WeightLagRule | None = None

    def __post_init__(self) -> None:
        if self.weight_delay is not None and self.weight_delay < 0:
            raise ValueError(f"weight_delay must be >= 0 or None, got {self.weight_delay}")
        if self.weight_delay is not None and self.weight_lag is not None:
            raise ValueError("give weight_delay or weight_lag, not both")

    @property
    def split_backward(self) -> bool:
        return self.weight_delay is not None or self.weight_lag is not None

    def warmup(self, num_stages: int, stage: int, num_microbatches: int) -> int:
        """Forwards stage `stage` runs before its first backward, at least 1 and at most B."""
        _check_shape(num_stages, num_microbatches)
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} out of range for {num_stages} stages")
        return max(1, min(num_microbatches, self.warmup_rule(num_stages, stage, num_microbatches)))

    def stage_tasks(self, num_stages: int, stage: int, num_microbatches: int) -> list[Task]:
        """The ordered tasks of one stage."""
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

    def in_flight(self, stages_after: int, num_microbatches: int) -> int:
        """Microbatches whose activations a stage holds at once (forward run, its B not yet)
        when `stages_after` stages run from it to the last, itself included: the factor of
        mem_act in Alpa's Eq. 5, which the stage DP reads. The DP knows a stage only by the
        stages after it, so this counts stage 0 of a `stages_after`-stage pipeline: every
        warm-up rule counts the stages from a stage to the last. What a split backward keeps
        from B(m) to W(m) (B's carry, W's inputs) is not in this count."""
        return max_in_flight(self.stage_tasks(stages_after, 0, num_microbatches))

    def stashes(self, num_stages: int, stage: int, num_microbatches: int) -> int:
        """Microbatches whose stash stage `stage` of a `num_stages`-stage pipeline holds at
        once, each from its F to its W where backwards are split (W reads the stash too), else
        to its B: what the stage's memory holds of activations, which `in_flight` (the DP's
        Eq. 5 count, knowing only the stages after a stage) undercounts for a W held back."""
        return max_stashes(self.stage_tasks(num_stages, stage, num_microbatches))

    def tasks(self, num_stages: int, num_microbatches: int) -> list[list[Task]]:
        """Per stage, its ordered tasks."""
        _check_shape(num_stages, num_microbatches)
        return [self.stage_tasks(num_stages, k, num_microbatches) for k in range(num_stages)]


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
    """Most microbatches whose F ran and whose task of kind `ends` did not, over the order."""
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
