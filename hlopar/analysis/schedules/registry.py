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

All are warm-up-then-1F1B orders (`Schedule`); GPipe is the one whose warm-up is every
microbatch. A variant is `dataclasses.replace(get_schedule("eager-1f1b-wd"), weight_delay=2)`.
"""

from __future__ import annotations

from hlopar.analysis.schedules.tasks import Schedule

__all__ = ["SCHEDULES", "UnknownScheduleError", "get_schedule"]


class UnknownScheduleError(ValueError):
    """A schedule name that is not in the registry."""


def _all_forwards(num_stages: int, stage: int, num_microbatches: int) -> int:
    return num_microbatches


def _one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> int:
    return num_stages - stage  # #stages - i + 1 with i = stage + 1


def _eager(num_stages: int, stage: int, num_microbatches: int) -> int:
    return 2 * (num_stages - stage - 1) + 1  # 2 (#stages - i) + 1 with i = stage + 1


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", _all_forwards, "all forwards, then all backwards"),
    "1f1b": Schedule("1f1b", _one_f_one_b, "warm-up of #stages - i + 1 forwards, then 1F1B"),
    "eager-1f1b": Schedule("eager-1f1b", _eager, "warm-up of 2 (#stages - i) + 1 forwards, then 1F1B"),
    "eager-1f1b-wd": Schedule(
        "eager-1f1b-wd", _eager, "eager-1f1b; weight gradients after the input-gradient sends", weight_delay=0
    ),
}


def get_schedule(name: str | Schedule) -> Schedule:
    """The registered schedule of that name (a `Schedule` is returned as it is)."""
    if isinstance(name, Schedule):
        return name
    try:
        return SCHEDULES[name]
    except KeyError:
        raise UnknownScheduleError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}") from None
