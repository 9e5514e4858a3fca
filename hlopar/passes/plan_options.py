"""The planning pipeline's options: one frozen object, and each mode's names, defined once.

`parallelize` (hlopar/api.py), `hlopar-compile` (hlopar/cli/compile.py) and the
`hlopar-auto-parallel` pass (passes/auto_parallel.py) each turn their own spelling of an
option (an argument, a flag, a pass option) into a `PlanOptions` at their edge, and read
their choices, defaults and refusals from here: `METHODS`, `RNG_MODES`, `REMAT_MODES`
(`analysis.stages.span_costs`, whose DP reads it) and the schedule registry
(`analysis.schedules`: `PLANNED_SCHEDULES`, `DEFAULT_SCHEDULE`, `ScheduleName`, and `AUTO_SCHEDULE`, "auto":
the planner chooses). A schedule name becomes a `Schedule` there, once; the options hold the
`Schedule`, or "auto" until the plan settles it (`passes.planning`: `Plan.options` holds the one
chosen). The pipeline itself: `passes.planning`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hlopar.analysis.limits import check_argument, check_count, check_positive
from hlopar.analysis.schedules import AUTO_SCHEDULE, DEFAULT_SCHEDULE, PLANNED_SCHEDULES, Schedule, get_schedule
from hlopar.analysis.stages.span_costs import REMAT_MODES

__all__ = [
    "DEFAULT_PLAN_SCHEDULE",
    "METHODS",
    "REMAT_MODES",
    "RNG_MODES",
    "SCHEDULE_NAMES",
    "PlanOptions",
    "check_choice",
    "remat_mode",
    "schedule_named",
]

# "auto": stages, submeshes and each stage's intra-op plan chosen (one stage on every device is
# one of the choices); "shard": one stage on one mesh of every device, intra-op only;
# "pipeline": stages as "auto", each replicated over its submesh (inter-op only, to compare).
METHODS = ("auto", "shard", "pipeline")
# hlopar-split-microbatches' rng: "exact" refuses whole-shape generators under several
# microbatches; "per-microbatch" lets them draw per microbatch (with a warning).
RNG_MODES = ("exact", "per-microbatch")
SCHEDULE_NAMES = (*PLANNED_SCHEDULES, AUTO_SCHEDULE)  # what the planner places
# `parallelize`'s and `hlopar-compile`'s default: the planner chooses (issue 29). The passes'
# option and these options default to the registry's `DEFAULT_SCHEDULE`, which is also what
# "auto" prefers on ties.
DEFAULT_PLAN_SCHEDULE = AUTO_SCHEDULE


def check_choice(name: str, choices: Sequence[str], value: Any) -> None:
    """Refuses a value that is not one of `choices`, naming the option and the choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def schedule_named(name: str | Schedule) -> Schedule | str:
    """The registered schedule of that name, or "auto" (`schedule must be one of ...` otherwise)."""
    if not isinstance(name, Schedule):
        check_choice("schedule", SCHEDULE_NAMES, name)
    return AUTO_SCHEDULE if name == AUTO_SCHEDULE else get_schedule(name)


def remat_mode(remat: str | bool) -> str:
    """`parallelize`'s remat: True is "always", False "never", else one of `REMAT_MODES`."""
    remat = {True: "always", False: "never"}[remat] if isinstance(remat, bool) else remat
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be True, False or one of {', '.join(REMAT_MODES)}, got {remat!r}")
    return remat


@dataclass(frozen=True)
class PlanOptions:
    """What to plan, whoever asks (docs/training_step.md, docs/stage_construction.md).

    `schedule`: a registered `Schedule`, or "auto" (the planner chooses it, with the
    microbatches where `microbatches` is None: `passes.planning`).
    `microbatches`: per step; None lets the pipeline choose (`passes.planning`, its
    microbatch policy). `split`: rewrite the step into the step of one microbatch first
    (hlopar-split-microbatches; `parallelize` and `hlopar-compile` always do).
    `batch_args` / `loss_result`: the batch arguments and the loss result in the step's own
    numbering (default: found by the split pass). `stage_loops`: each stage runs its
    iterations of a scanned layer stack as a loop (hlopar-reroll-stage-loops).
    `unstack_layers`: unroll scans over stacked layers so that stages can cut between them.
    `layers`: operator clustering's number of layers (None: chosen). `stages`: exactly this
    many pipeline stages (None: stage construction chooses; "shard" is one). `idle_hosts`: the
    stages may leave whole hosts idle where that is predicted faster. `memory_per_device`:
    bytes (None: the cluster preset's). (The compiled memory check is codegen's, after the
    plan: `codegen.bundle.write_bundle`'s `memory_check`.)"""

    method: str = "auto"
    schedule: Schedule | str = get_schedule(DEFAULT_SCHEDULE)  # noqa: RUF009 (a Schedule is frozen)
    microbatches: int | None = None
    split: bool = True
    batch_args: tuple[int, ...] | None = None
    loss_result: int | None = None
    rng: str = "exact"
    remat: str = "auto"
    stage_loops: bool = False
    unstack_layers: bool = True
    layers: int | None = None
    stages: int | None = None
    idle_hosts: bool = False
    memory_per_device: float | None = None

    def __post_init__(self) -> None:
        check_choice("method", METHODS, self.method)
        if not isinstance(self.schedule, Schedule) and self.schedule != AUTO_SCHEDULE:
            raise TypeError(
                f"schedule must be a Schedule or {AUTO_SCHEDULE!r} (passes.plan_options.schedule_named), "
                f"got {self.schedule!r}"
            )
        check_choice("rng", RNG_MODES, self.rng)
        check_choice("remat", REMAT_MODES, self.remat)
        for name in ("microbatches", "layers", "stages"):
            if getattr(self, name) is not None:
                check_argument(name, lambda n: check_count(n, low=1), getattr(self, name))
        if self.method == "shard" and self.idle_hosts:
            raise ValueError(
                "idle_hosts needs method 'auto' or 'pipeline': method 'shard' plans one mesh of every device"
            )
        if self.method == "shard" and self.stages not in (None, 1):
            raise ValueError(f"stages={self.stages} needs method 'auto' or 'pipeline': method 'shard' plans one stage")
        for index in self.batch_args or ():
            check_argument("batch_args", check_count, index)
        if self.loss_result is not None:
            check_argument("loss_result", check_count, self.loss_result)
        if self.memory_per_device is not None:
            check_argument("memory_per_device", check_positive, self.memory_per_device)

    @property
    def schedule_name(self) -> str:
        return self.schedule if isinstance(self.schedule, str) else self.schedule.name

    def cache_key(self) -> dict:
        """The options as `parallelize`'s plan cache keys them: those it always had, and the
        others where they are not their default (an older key stays the same)."""
        key = {
            "microbatches": self.microbatches,
            "schedule": self.schedule_name,
            "method": self.method,
            "batch_args": list(self.batch_args) if self.batch_args is not None else None,
            "rng": self.rng,
            "remat": self.remat,
            "stage_loops": self.stage_loops,
        }
        for name in ("loss_result", "layers", "stages", "memory_per_device"):
            if getattr(self, name) is not None:
                key[name] = getattr(self, name)
        if self.idle_hosts:
            key["idle_hosts"] = True
        return key
