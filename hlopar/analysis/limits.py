"""What the planner handles: the bounds on cluster sizes, mesh shapes and other option values,
with the reason for each, checked before any work (pass options, `hlopar-compile`'s flags,
`hlopar.Cluster`). Each check raises `ValueError` with a message that names the limit and why.

Plain Python, no jaxlib: `hlopar-compile` checks its flags with it before it forks. The limits
were measured (docs/performance.md, "Planning time and cluster size").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from hlopar.analysis.stages.submeshes import logical_mesh_shapes, submesh_shapes

__all__ = [
    "MAX_COUNT",
    "MAX_DEVICES",
    "MAX_LOGICAL_MESHES",
    "MAX_SECONDS",
    "MAX_WORKERS",
    "check_argument",
    "check_cluster",
    "check_cluster_dimension",
    "check_count",
    "check_mesh_shape",
    "check_number",
    "check_positive",
    "check_seconds",
    "check_workers",
    "logical_mesh_count",
]

# Stage construction plans each distinct layer on every 2-D logical mesh of every submesh,
# (1, 1), (1, 2), ..., (1, M), (2, M), ..., (N, M): one ILP each (`stages.submeshes`). Their
# number sets the planning time: GPT-39B on 8 x 8 devices (62 logical meshes) plans in 45-104 s
# on the 2-core machine of docs/performance.md, and the time grows with the count (measured:
# docs/performance.md, "Planning time and cluster size"). 400 logical meshes is then about
# 5-11 minutes for such a model: `PLANNING_BUDGET`. 16 x 8, 32 x 8, 8 x 16 and 1 x 1024 fit;
# 64 x 8 (769) and 1024 x 1 (7,262) do not.
MAX_LOGICAL_MESHES = 400
PLANNING_BUDGET = "about 10 minutes for a model like GPT-39B"
# No cluster or mesh has more devices (and counting a cluster's logical meshes stays instant).
MAX_DEVICES = 1024
# Counts (microbatches, layers, chunks, indices, seeds) are written into the IR and numpy
# arrays as 32- or 64-bit integers: one that does not fit 31 bits is a mistake, not a request.
MAX_COUNT = 2**31 - 1
# Time limits and budgets: at most a week (CP-SAT and the DFS take seconds as a double; a
# limit of 1e300 s means "no limit", which the planner does not offer: it must answer).
MAX_SECONDS = 7 * 24 * 3600.0
# Processes forked to solve layer ILPs: each holds a copy-on-write image of the planner.
MAX_WORKERS = 256


def check_count(value: int, *, low: int = 0, high: int = MAX_COUNT, what: str = "a count") -> None:
    """An integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"expected an integer, got {value!r}")
    if value < low:
        raise ValueError(f"expected {'a positive integer' if low == 1 else f'an integer >= {low}'}, got {value}")
    if value > high:
        raise ValueError(f"{value} is more than {high:,}, the most hlopar takes for {what}")


def check_number(value: float, *, positive: bool = False, high: float = math.inf, what: str = "this value") -> None:
    """A finite number >= 0 (> 0 if `positive`), at most `high`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"expected a number {'> 0' if positive else '>= 0'}, got {value:g}")
    if value > high:
        raise ValueError(f"{value:g} is more than {high:g}, the most hlopar takes for {what}")


def check_positive(value: float) -> None:
    """A finite number > 0 (bytes of memory, a bandwidth, a DP step)."""
    check_number(value, positive=True)


def check_seconds(value: float) -> None:
    """A time limit: > 0 s, at most `MAX_SECONDS`."""
    check_number(value, positive=True, high=MAX_SECONDS, what="a time limit (a week)")


def check_workers(value: int) -> None:
    """Worker processes: 1 to `MAX_WORKERS`."""
    check_count(value, low=1, high=MAX_WORKERS, what="worker processes (each a forked copy of the planner)")


def check_cluster_dimension(value: int) -> None:
    """Hosts, or devices per host: a positive integer no larger than a whole cluster's limit."""
    check_count(
        value,
        low=1,
        high=MAX_DEVICES,
        what=f"a cluster's hosts or devices per host: it plans for at most "
        f"{MAX_DEVICES:,} devices in all, its time growing with them",
    )


def check_cluster(num_hosts: int, devices_per_host: int) -> None:
    """A cluster of `num_hosts` x `devices_per_host` devices the planner plans within `PLANNING_BUDGET`."""
    check_cluster_dimension(num_hosts)
    check_cluster_dimension(devices_per_host)
    devices = num_hosts * devices_per_host
    if devices > MAX_DEVICES:
        raise ValueError(
            f"a cluster of {num_hosts:,} x {devices_per_host:,} = {devices:,} devices is more than "
            f"{MAX_DEVICES:,}, the most hlopar plans for (its planning time grows with the devices)"
        )
    meshes = logical_mesh_count(num_hosts, devices_per_host)
    if meshes > MAX_LOGICAL_MESHES:
        raise ValueError(
            f"a cluster of {num_hosts:,} x {devices_per_host:,} devices has {meshes:,} logical meshes "
            f"(every 2-D shape of every submesh) for stage construction to plan each layer on, more "
            f"than {MAX_LOGICAL_MESHES:,}, the most it plans within {PLANNING_BUDGET} (GPT-39B on "
            f"8 x 8, 62 logical meshes: 45-104 s); plan for fewer hosts"
        )


def logical_mesh_count(num_hosts: int, devices_per_host: int) -> int:
    """How many logical meshes stage construction plans each layer on (Alpa §5.2)."""
    return sum(len(logical_mesh_shapes(s)) for s in submesh_shapes(num_hosts, devices_per_host))


def check_mesh_shape(shape: Sequence[int]) -> None:
    """A logical mesh: positive sizes, at most `MAX_DEVICES` devices. Any number of axes:
    past `strategies.FULL_ENUMERATION_AXES` a factor gets at most one axis, so the strategies
    grow with the axes, not with their subsets (Shardy's tests plan on 7 axes of 2)."""
    if not shape:
        raise ValueError("a mesh has at least one axis")
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"mesh sizes are positive integers, got {'x'.join(map(str, shape))}")
    devices = math.prod(shape)
    if devices > MAX_DEVICES:
        raise ValueError(
            f"a mesh of {'x'.join(map(str, shape))} = {devices:,} devices is more than {MAX_DEVICES:,}, "
            f"the most hlopar plans for (a mesh is a cluster's devices, and clusters are bounded by "
            f"planning time)"
        )


def check_argument(name: str, check: Callable[[Any], None], value: Any) -> None:
    """`check(value)`, its `ValueError` naming the argument or option (`name: why`)."""
    try:
        check(value)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
