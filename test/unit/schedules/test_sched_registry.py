"""Schedule registry and task orders: every task once, in-flight bounds of the papers' formulas."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopar.analysis.schedules import SCHEDULES, Schedule, Task, UnknownScheduleError, get_schedule, max_in_flight

SHAPES = st.tuples(st.integers(1, 9), st.integers(1, 30))


def test_registry_names():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "eager-1f1b", "eager-1f1b-wd"]
    assert get_schedule("1f1b") is SCHEDULES["1f1b"]
    assert get_schedule(SCHEDULES["gpipe"]) is SCHEDULES["gpipe"]
    assert [s.split_backward for s in SCHEDULES.values()] == [False, False, False, True]


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
@given(SHAPES, st.sampled_from(list(SCHEDULES)), st.integers(0, 4))
def test_every_task_once_in_order(shape, name, delay):
    stages, micro = shape
    schedule = SCHEDULES[name]
    if schedule.split_backward:
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
