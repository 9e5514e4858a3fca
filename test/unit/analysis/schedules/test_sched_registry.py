"""Schedule registry and task orders: every task once, in-flight bounds of the papers' formulas."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopar.analysis.schedules import (
    AUTO_SCHEDULE,
    DEFAULT_SCHEDULE,
    ONE_STAGE_SCHEDULES,
    SCHEDULES,
    Schedule,
    ScheduleName,
    ScheduleOption,
    Task,
    UnknownScheduleError,
    get_schedule,
    max_in_flight,
)

SHAPES = st.tuples(st.integers(1, 9), st.integers(1, 30))


def test_registry_names():
    assert list(SCHEDULES) == [
        "gpipe",
        "1f1b",
        "eager-1f1b",
        "eager-1f1b-wd",
        "zb-h1",
        "zb-h2",
        "interleaved-1f1b",
        "zb-v",
    ]
    assert tuple(list(SCHEDULES)[:6]) == ONE_STAGE_SCHEDULES  # one stage per mesh
    assert get_schedule("1f1b") is SCHEDULES["1f1b"]
    assert get_schedule(SCHEDULES["gpipe"]) is SCHEDULES["gpipe"]
    assert [s.split_backward for s in SCHEDULES.values()] == [False, False, False, True, True, True, False, True]
    assert DEFAULT_SCHEDULE in SCHEDULES
    assert typing.get_args(ScheduleName) == tuple(sorted(SCHEDULES))
    assert typing.get_args(ScheduleOption) == tuple(sorted((*SCHEDULES, AUTO_SCHEDULE)))
    assert AUTO_SCHEDULE == "auto" and AUTO_SCHEDULE not in SCHEDULES


def test_stashes_count_what_a_split_backward_keeps_until_w():
    """Stage k of 4 at 8 microbatches: the stashes held at once, each from its F to its W (B
    where the backward is whole); equal to Eq. 5's in-flight count (the DP's, knowing a stage
    only by the stages after it) except where W is held back."""
    held = {name: [SCHEDULES[name].stashes(4, k, 8) for k in range(4)] for name in ONE_STAGE_SCHEDULES}
    assert held == {
        "gpipe": [8, 8, 8, 8],
        "1f1b": [4, 3, 2, 1],
        "eager-1f1b": [7, 5, 3, 1],
        "eager-1f1b-wd": [7, 5, 3, 1],  # W right after its B
        "zb-h1": [4, 4, 4, 4],  # 1f1b's warm-up p - k, plus k W held back
        "zb-h2": [7, 7, 7, 7],  # eager's 2 (p - k) - 1, plus 2k
    }
    for name in ONE_STAGE_SCHEDULES:
        schedule = SCHEDULES[name]
        in_flight = [schedule.in_flight(4 - k, 8) for k in range(4)]
        assert (in_flight == held[name]) == (schedule.weight_lag is None), name


def test_unknown_schedule_lists_valid_names():
    valid = "valid: gpipe, 1f1b, eager-1f1b, eager-1f1b-wd"
    with pytest.raises(UnknownScheduleError, match=f"unknown schedule 'pipedream'; {valid}"):
        get_schedule("pipedream")


def test_bad_shapes():
    with pytest.raises(ValueError, match="at least one stage"):
        SCHEDULES["1f1b"].tasks(0, 4)
    with pytest.raises(ValueError, match="at least one microbatch"):
        SCHEDULES["1f1b"].tasks(4, 0)
    with pytest.raises(ValueError, match="weight_delay"):
        dataclasses.replace(SCHEDULES["eager-1f1b-wd"], weight_delay=-1)


def test_paper_figure_4_orders():
    """4 stages, 8 microbatches: 1F1B warms up with 4, 3, 2, 1 forwards; eager with 7, 5, 3, 1."""
    one = [" ".join(map(str, o)) for o in SCHEDULES["1f1b"].tasks(4, 8)]
    assert one[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert one[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    eager = [" ".join(map(str, o)) for o in SCHEDULES["eager-1f1b"].tasks(4, 8)]
    assert eager[0] == "F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7"
    assert eager[1] == "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 B4 B5 B6 B7"
    gpipe = SCHEDULES["gpipe"].stage_tasks(4, 2, 3)
    assert [str(t) for t in gpipe] == ["F0", "F1", "F2", "B0", "B1", "B2"]
    wd = SCHEDULES["eager-1f1b-wd"].stage_tasks(4, 3, 3)
    assert [str(t) for t in wd] == ["F0", "B0", "W0", "F1", "B1", "W1", "F2", "B2", "W2"]


def test_weight_delay_moves_w_later():
    later = dataclasses.replace(SCHEDULES["eager-1f1b-wd"], weight_delay=2)
    assert [str(t) for t in later.stage_tasks(2, 1, 4)] == [
        "F0",
        "B0",
        "F1",
        "B1",
        "W0",
        "F2",
        "B2",
        "W1",
        "F3",
        "B3",
        "W2",
        "W3",
    ]


@settings(max_examples=60, deadline=None)
@given(SHAPES, st.sampled_from(ONE_STAGE_SCHEDULES), st.integers(0, 4))
def test_every_task_once_in_order(shape, name, delay):
    stages, micro = shape
    schedule = SCHEDULES[name]
    if schedule.weight_delay is not None:
        schedule = dataclasses.replace(schedule, weight_delay=delay)
    kinds = "FBW" if schedule.split_backward else "FB"
    for order in schedule.tasks(stages, micro):
        assert sorted(order) == sorted(Task(k, m) for k in kinds for m in range(micro))
        pos = {t: i for i, t in enumerate(order)}
        for m in range(micro):
            assert pos[Task("F", m)] < pos[Task("B", m)]
            if schedule.split_backward:
                assert pos[Task("B", m)] < pos[Task("W", m)]
        for kind in kinds:
            assert [t.microbatch for t in order if t.kind == kind] == list(range(micro))


@settings(max_examples=60, deadline=None)
@given(SHAPES)
def test_in_flight_bounds(shape):
    """Stage i (from 1): 1F1B at most #stages - i + 1 forwards in flight, eager 2 (#stages - i) + 1."""
    stages, micro = shape
    for k in range(stages):
        i = k + 1
        assert max_in_flight(SCHEDULES["1f1b"].stage_tasks(stages, k, micro)) == min(micro, stages - i + 1)
        for name in ("eager-1f1b", "eager-1f1b-wd"):
            assert max_in_flight(SCHEDULES[name].stage_tasks(stages, k, micro)) == min(micro, 2 * (stages - i) + 1)
        assert max_in_flight(SCHEDULES["gpipe"].stage_tasks(stages, k, micro)) == micro


def test_custom_schedule():
    two = Schedule("two-ahead", lambda s, k, b: 2)
    assert [str(t) for t in two.stage_tasks(3, 0, 3)] == ["F0", "F1", "B0", "F2", "B1", "B2"]


def test_in_flight_of_eq5():
    """The stage DP's factor of mem_act, by the stages from a stage to the last."""
    assert SCHEDULES["gpipe"].in_flight(3, 8) == 8
    assert SCHEDULES["1f1b"].in_flight(3, 8) == 3
    assert SCHEDULES["1f1b"].in_flight(12, 8) == 8
    assert SCHEDULES["eager-1f1b"].in_flight(1, 8) == 1  # the last stage alternates at once
    assert SCHEDULES["eager-1f1b"].in_flight(3, 8) == 5
    assert SCHEDULES["eager-1f1b"].in_flight(6, 8) == 8
    with pytest.raises(ValueError, match="gpipe, 1f1b, eager-1f1b"):
        get_schedule("interleaved")
    with pytest.raises(ValueError, match="at least one stage"):
        SCHEDULES["1f1b"].in_flight(0, 4)


@settings(max_examples=60, deadline=None)
@given(SHAPES)
def test_in_flight_is_the_warmup_of_the_first_stage(shape):
    stages, micro = shape
    for schedule in map(SCHEDULES.get, ONE_STAGE_SCHEDULES):
        assert schedule.in_flight(stages, micro) == schedule.warmup(stages, 0, micro)
        for k in range(stages):  # warm-ups count the stages from a stage to the last
            assert schedule.in_flight(stages - k, micro) == max_in_flight(schedule.stage_tasks(stages, k, micro))


def test_zb_h1_task_order():
    """Qi et al. (2024), ZB-H1: 1F1B's warm-up; stage k runs W(m) right after B(m + k)."""
    zb = [" ".join(map(str, o)) for o in SCHEDULES["zb-h1"].tasks(4, 6)]
    assert zb == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5",
    ]
    assert [" ".join(map(str, o)) for o in SCHEDULES["zb-h1"].tasks(2, 3)] == [
        "F0 F1 B0 W0 F2 B1 W1 B2 W2",
        "F0 B0 F1 B1 W0 F2 B2 W1 W2",
    ]
    # without the W, each stage's order is 1F1B's
    for stages, micro in ((4, 6), (3, 2), (5, 12)):
        for zb_order, one in zip(SCHEDULES["zb-h1"].tasks(stages, micro), SCHEDULES["1f1b"].tasks(stages, micro)):
            assert [t for t in zb_order if t.kind != "W"] == one


def _held_until_w(order: list[Task]) -> int:
    """Most microbatches whose forward ran and whose W has not."""
    live = peak = 0
    for task in order:
        live += {"F": 1, "W": -1}.get(task.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages, micro", [(1, 1), (2, 3), (4, 6), (4, 8), (4, 2), (5, 12), (8, 16)])
def test_zb_h1_in_flight_is_1f1b(stages, micro):
    """Activations in flight (F run, B not): 1F1B's on every stage, so Eq. 5 is unchanged; from F to
    W every stage holds min(#stages, B), the first stage's count under 1F1B (the paper's peak)."""
    zb, one = SCHEDULES["zb-h1"], SCHEDULES["1f1b"]
    for k in range(stages):
        assert max_in_flight(zb.stage_tasks(stages, k, micro)) == max_in_flight(one.stage_tasks(stages, k, micro))
        assert zb.in_flight(stages - k, micro) == one.in_flight(stages - k, micro) == min(stages - k, micro)
        assert _held_until_w(zb.stage_tasks(stages, k, micro)) == min(stages, micro)


def test_zb_h2_task_order():
    """Qi et al. (2024), ZB-H2: eager-1F1B's warm-up (2 (p - k) - 1 forwards on stage k, from 0);
    stage k runs W(m) right after B(m + 2k), so the last stage holds back the most W."""
    zb = [" ".join(map(str, o)) for o in SCHEDULES["zb-h2"].tasks(4, 8)]
    assert zb == [
        "F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 F7 B5 W1 B6 W2 B7 W3 W4 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7",
    ]
    for stages, micro in ((4, 8), (3, 2), (5, 12)):
        for zb_order, eager in zip(
            SCHEDULES["zb-h2"].tasks(stages, micro), SCHEDULES["eager-1f1b"].tasks(stages, micro)
        ):
            assert [t for t in zb_order if t.kind != "W"] == eager


@pytest.mark.parametrize("stages, micro", [(1, 1), (2, 3), (4, 3), (4, 8), (4, 7), (5, 12), (8, 16)])
def test_zb_h2_in_flight_is_twice_1f1b(stages, micro):
    """Eq. 5's count for ZB-H2 is min(2s - 1, B) for a stage with s stages from it to the last,
    eager-1F1B's; from F to W every stage holds min(2p - 1, B), the paper's peak of (2p - 1) M_B
    activations (Qi et al., 2024, §2.2) against 1F1B's p M_B."""
    zb = SCHEDULES["zb-h2"]
    for k in range(stages):
        assert zb.in_flight(stages - k, micro) == min(2 * (stages - k) - 1, micro)
        assert max_in_flight(zb.stage_tasks(stages, k, micro)) == min(2 * (stages - k) - 1, micro)
        assert _held_until_w(zb.stage_tasks(stages, k, micro)) == min(2 * stages - 1, micro)


def test_weight_placements_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        dataclasses.replace(SCHEDULES["zb-h1"], weight_delay=0)
    with pytest.raises(ValueError, match="weight lag of stage 1"):
        dataclasses.replace(SCHEDULES["zb-h1"], weight_lag=lambda s, k, b: -k).stage_tasks(3, 1, 4)
