"""`analysis.limits`: the bounds the planner's options and clusters are checked against, each
refusal naming the limit and why."""

from __future__ import annotations

import math
import time

import pytest

from hlopar.analysis.limits import (
    MAX_DEVICES,
    MAX_LOGICAL_MESHES,
    check_cluster,
    check_count,
    check_mesh_shape,
    check_number,
    check_seconds,
    logical_mesh_count,
)


@pytest.mark.parametrize("hosts, devices", [(1, 1), (8, 8), (32, 8), (16, 16), (1, 1024)])
def test_clusters_the_planner_handles(hosts, devices):
    check_cluster(hosts, devices)


@pytest.mark.parametrize(
    "hosts, devices, message",
    [
        (0, 4, "expected a positive integer, got 0"),
        (10**6, 8, "1000000 is more than 1,024, the most hlopar takes for a cluster's hosts or devices per host"),
        (2, 10**20, "is more than 1,024"),
        (2, 1024, "a cluster of 2 x 1,024 = 2,048 devices is more than 1,024"),
        (
            64,
            8,
            "has 769 logical meshes (every 2-D shape of every submesh) for stage construction to plan each "
            "layer on, more than 400, the most it plans within about 10 minutes",
        ),
        (1024, 1, "has 7,262 logical meshes"),
        (True, 4, "expected an integer, got True"),
        (2.0, 4, "expected an integer, got 2.0"),
    ],
)
def test_clusters_refused_with_the_limit_and_why(hosts, devices, message):
    clock = time.perf_counter()
    with pytest.raises(ValueError) as error:
        check_cluster(hosts, devices)
    assert message in str(error.value)
    assert time.perf_counter() - clock < 1  # never planning, nor counting for long


def test_logical_mesh_count_is_what_stage_construction_enumerates():
    assert logical_mesh_count(8, 8) == 62  # (1,1) 1, (1,2) 2, (1,4) 3, (1,8) 4, (2,8)..(8,8): 52
    assert logical_mesh_count(32, 8) <= MAX_LOGICAL_MESHES < logical_mesh_count(64, 8)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((100000, 100000), "a mesh of 100000x100000 = 10,000,000,000 devices is more than 1,024"),
        ((2, 0), "mesh sizes are positive integers, got 2x0"),
        ((), "a mesh has at least one axis"),
    ],
)
def test_mesh_shapes_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        check_mesh_shape(shape)
    check_mesh_shape((2, 4))
    check_mesh_shape((MAX_DEVICES,))
    check_mesh_shape((2,) * 7)  # Shardy's tests' meshes: past 4 axes a factor gets one axis


def test_counts_numbers_and_seconds():
    check_count(0)
    with pytest.raises(ValueError, match="expected an integer >= 0, got -1"):
        check_count(-1)
    with pytest.raises(ValueError, match="2147483648 is more than 2,147,483,647"):
        check_count(2**31)
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError):
            check_number(bad)
    with pytest.raises(ValueError, match="expected a number > 0, got 0"):
        check_seconds(0)
    with pytest.raises(ValueError, match="the most hlopar takes for a time limit"):
        check_seconds(1e300)
    check_seconds(0.5)
