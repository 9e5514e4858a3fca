"""The registry of pipeline schedules, by the name `--schedule` takes.

    gpipe          all forwards, then all backwards (Huang et al., 2019)
    1f1b           stage i (from 1) warms up with #stages - i + 1 forwards (Narayanan et al., 2021)
    eager-1f1b     warms up with 2 (#stages - i) + 1 forwards, so each microbatch's transfer to
                   the next stage overlaps other microbatches' compute (cross-mesh paper, §4)
    eager-1f1b-wd  eager-1f1b with backward weight delaying: each backward splits into B (input
                   gradients, sent at once) and W (weight gradients), and the sends overlap W
                   (same section); W(m) follows B(m) directly, the least delay, which the
                   simulator finds no slower than longer ones on tools/bench_schedules.py's
                   GPT and U-Transformer
    zb-h1          1f1b's warm-up with backwards split into B and W (Qi et al., ICLR 2024, ZB-H1):
                   stage i (from 1) runs W(m) right after B(m + i - 1), so B reaches earlier
                   stages sooner and the held-back W fill the cool-down; the forwards in flight
                   (Eq. 5) are 1f1b's, and with F, B and W of equal cost the bubble is a third
                   of 1f1b's, (#stages - 1) / 3B of the compute against (#stages - 1) / B.
                   Stage i also keeps i - 1 stashes until their W, so every stage holds as
                   many as 1f1b's first; the memory check, which reads the streams, counts them
    zb-h2          eager-1f1b's warm-up, 2 (#stages - i) + 1 forwards, with backwards split into B
                   and W (Qi et al., ICLR 2024, ZB-H2): stage i runs W(m) right after
                   B(m + 2 (i - 1)), so with F, B and W of equal cost each stage works without
                   a gap from its first F to its last W (the paper's parallelogram, §2.2) once
                   B >= 2 #stages - 1. Steps then
                   overlap only when a stage starts its next step as soon as its own ends (no
                   barrier at the optimizer step: the paper's post-validation, which hlopar's
                   executors do not do); the simulator's `steady_period` prices that. The first
                   stage keeps 2 #stages - 1 forwards in flight, about twice 1f1b's (Eq. 5),
                   and every stage as many stashes until their W, which Eq. 5 does not count
    interleaved-1f1b
                   v chunks of layers per mesh, stage c p + j on mesh j of p (Narayanan et al.,
                   SC'21, §2.2: Megatron's order, `chunked.interleaved_order`): mesh j warms up
                   with 2 (p - j - 1) + (v - 1) p + 1 chunk forwards, then 1F1B over chunks; the
                   bubble is (p - 1) / (v B) of the compute, at v times the transfers. Needs B
                   a multiple of p when v > 1; with one chunk per mesh it is eager-1f1b's order
    zb-v           two chunks per mesh placed as a V (stages j and 2p - 1 - j on mesh j), backwards
                   split into B and W (Qi et al., ICLR 2024, §4: `chunked.zero_bubble_v_order`);
                   each mesh holds at most 2p chunk stashes, 1f1b's first stage's memory, and with
                   F, B and W of equal cost works without a gap from its first task to its last

Not registered: DualPipeV (DeepSeek-V3), whose gain is a forward chunk and a backward chunk
of one mesh running at once, overlapped. The executor core runs a mesh's stream one
instruction after the other (a RUN is one executable call), so it cannot overlap them, and
on CPU devices two programs on the same devices would not overlap either
(docs/stage_construction.md, "Virtual stages").

The first six are warm-up-then-1F1B orders of one stage per mesh (`Schedule`); GPipe is the
one whose warm-up is every microbatch. The last two run several stages per mesh (a
topology whose meshes repeat, `PipelineTopology.meshes`) and give each mesh's order whole
(`Schedule.mesh_order`). A variant is `dataclasses.replace(get_schedule("eager-1f1b-wd"), weight_delay=2)`.
`DEFAULT_SCHEDULE` is the one default schedule (the passes', the local executor's, and the one
"auto" prefers on ties; `parallelize`'s and `hlopar-compile`'s default is "auto",
`passes.plan_options.DEFAULT_PLAN_SCHEDULE`);
`ScheduleName` is the option type whose choices are the registry's names, `ScheduleOption` the
planner's, which also take `AUTO_SCHEDULE` ("auto": the planner chooses).
"""

from __future__ import annotations

from typing import Literal

from hlopar.analysis.schedules.chunked import interleaved_order, zero_bubble_v_order
from hlopar.analysis.schedules.tasks import V_SHAPE, Schedule

__all__ = [
    "AUTO_SCHEDULE",
    "DEFAULT_SCHEDULE",
    "ONE_STAGE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "SCHEDULES",
    "ScheduleName",
    "ScheduleOption",
    "UnknownScheduleError",
    "get_schedule",
]


class UnknownScheduleError(ValueError):
    """A schedule name that is not in the registry."""


def _all_forwards(num_stages: int, stage: int, num_microbatches: int) -> int:
    return num_microbatches


def _one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> int:
    return num_stages - stage  # #stages - i + 1 with i = stage + 1


def _eager(num_stages: int, stage: int, num_microbatches: int) -> int:
    return 2 * (num_stages - stage - 1) + 1  # 2 (#stages - i) + 1 with i = stage + 1


def _lag_of_stage(num_stages: int, stage: int, num_microbatches: int) -> int:
    return stage  # i - 1 with i = stage + 1: the last stage holds back the most W


def _twice_lag_of_stage(num_stages: int, stage: int, num_microbatches: int) -> int:
    return 2 * stage  # 2 (i - 1): the fewest held-back W that close every stage's gaps


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", _all_forwards, "all forwards, then all backwards"),
    "1f1b": Schedule("1f1b", _one_f_one_b, "warm-up of #stages - i + 1 forwards, then 1F1B"),
    "eager-1f1b": Schedule("eager-1f1b", _eager, "warm-up of 2 (#stages - i) + 1 forwards, then 1F1B"),
    "eager-1f1b-wd": Schedule(
        "eager-1f1b-wd", _eager, "eager-1f1b; weight gradients after the input-gradient sends", weight_delay=0
    ),
    "zb-h1": Schedule(
        "zb-h1",
        _one_f_one_b,
        "1f1b's warm-up; stage i's W(m) after B(m + i - 1), filling the cool-down",
        weight_lag=_lag_of_stage,
    ),
    "zb-h2": Schedule(
        "zb-h2",
        _eager,
        "eager-1f1b's warm-up; stage i's W(m) after B(m + 2 (i - 1)), filling each stage's gaps",
        weight_lag=_twice_lag_of_stage,
    ),
    "interleaved-1f1b": Schedule(
        "interleaved-1f1b",
        _eager,
        "v chunks per mesh (stage c p + j on mesh j); Megatron's order, bubble (p - 1) / (v B)",
        mesh_order=interleaved_order,
    ),
    "zb-v": Schedule(
        "zb-v",
        _eager,
        "2 chunks per mesh as a V (stages j, 2p - 1 - j), B/W split; no gap between a mesh's first and last task",
        mesh_order=zero_bubble_v_order,
        placement=V_SHAPE,
        chunks=2,
        split=True,
    ),
}

# One stage per mesh: the warm-up-then-1F1B orders (`Schedule.stage_tasks`), which Eq. 3-4's DP
# plans on submeshes of any sizes.
ONE_STAGE_SCHEDULES = tuple(name for name, schedule in SCHEDULES.items() if schedule.mesh_order is None)
# What stage construction plans, `parallelize(schedule=...)` and `hlopar-compile --schedule`
# take, and "auto" chooses among: every registered schedule (those of several stages per mesh
# on p meshes of one submesh shape, `analysis.stages.pipeline_choice`).
PLANNED_SCHEDULES = tuple(SCHEDULES)

DEFAULT_SCHEDULE = "eager-1f1b"
# Not a schedule: the planner chooses one of `SCHEDULES` (every one runs on hlopar's runtimes)
# with the stages and the microbatches, by simulated step time (`analysis.stages.pipeline_choice`).
AUTO_SCHEDULE = "auto"

# Pass options list their choices in this order (`hlopar-opt` always printed them sorted).
ScheduleName = Literal[tuple(sorted(SCHEDULES))]
ScheduleOption = Literal[tuple(sorted((*SCHEDULES, AUTO_SCHEDULE)))]  # a name, or auto


def get_schedule(name: str | Schedule) -> Schedule:
    """The registered schedule of that name (a `Schedule` is returned as it is)."""
    if isinstance(name, Schedule):
        return name
    try:
        return SCHEDULES[name]
    except KeyError:
        raise UnknownScheduleError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}") from None
