"""Resharding: the collectives that turn a tensor's layout into another (Alpa §4.1, Table 2).

A conversion from spec `src` to spec `dst` on one mesh takes at most three steps, each axis
treated by what happens to it (`n_a` = the size of mesh axis a):

1. *Slice* (free): where `src` splits a dimension over a prefix of the axes `dst` splits it
   over, each device cuts the extra axes out of data it already holds (Table 2, #1).
2. *All-gather* the axes `src` uses and `dst` does not (#2, #3), named after the per-device
   size once gathered.
3. *All-to-all* over the axes both use but in another dimension, or at another place in the
   same dimension's major-to-minor order (#4, #5), named after the final per-device size.

An axis that stays in the common major-side prefix of its dimension costs nothing, and
further new axes are sliced out for free before the all-to-all. Sizes are per device,
rounded up per dimension as XLA pads uneven shards. Mesh axes of size 1 split nothing and
are ignored. The ILP asks for every pair of strategies on every edge, so results are cached
per (shape, dtype size, src, dst, mesh): all arguments are hashable values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hlopar.analysis.auto_sharding.cluster import LogicalMesh
from hlopar.analysis.auto_sharding.collectives import Collective
from hlopar.analysis.sharding import ShardingSpec

__all__ = ["per_device_bytes", "resharding_collectives", "resharding_cost"]

_CACHE_SIZE = 1 << 16


def per_device_bytes(shape: Sequence[int], dtype_bytes: int, spec: ShardingSpec, mesh: LogicalMesh) -> int:
    """Bytes of one device's tile of a `shape` tensor laid out as `spec` (ceil per dimension)."""
    shape = tuple(shape)
    _check_rank(shape, spec, "spec")
    elements = 1
    for size, axes in zip(shape, spec.dims):
        elements *= -(-size // mesh.axes_size(axes)) if axes else size
    return elements * dtype_bytes


def resharding_collectives(
    shape: Sequence[int], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    """The collectives, in order, that turn layout `src` into `dst`; `()` when slicing suffices."""
    return _collectives(_as_shape(shape), dtype_bytes, src, dst, mesh)


def resharding_cost(
    shape: Sequence[int], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> float:
    """Seconds the resharding takes on `mesh`: the sum of its collectives' alpha-beta costs."""
    return _cost(_as_shape(shape), dtype_bytes, src, dst, mesh)


def _as_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return shape if type(shape) is tuple else tuple(shape)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cost(shape: tuple[int, ...], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> float:
    return sum((c.cost(mesh) for c in _collectives(shape, dtype_bytes, src, dst, mesh)), 0.0)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _collectives(
    shape: tuple[int, ...], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    _check_rank(shape, src, "source spec")
    _check_rank(shape, dst, "target spec")
    src, dst = _without_trivial_axes(src, mesh), _without_trivial_axes(dst, mesh)
    if src == dst:
        return ()
    src_axes, dst_axes = set(src.used_axes), set(dst.used_axes)
    gathered: set[str] = set()
    moved: set[str] = set()
    after_gather = []
    for have, want in zip(src.dims, dst.dims):
        if want[: len(have)] == have:
            # step 1: slice the new axes that follow; one arriving from elsewhere stops it
            extra = want[len(have) :]
            arriving = next((i for i, a in enumerate(extra) if a in src_axes), len(extra))
            after_gather.append(have + extra[:arriving])
            continue
        kept = _common_prefix(have, want)
        gathered.update(a for a in have if a not in dst_axes)
        moved.update(a for a in have[kept:] if a in dst_axes)
        after_gather.append(tuple(a for a in have if a in dst_axes))
    order = mesh.axis_names
    steps = []
    if gathered:
        nbytes = per_device_bytes(shape, dtype_bytes, ShardingSpec(tuple(after_gather)), mesh)
        steps.append(Collective("all-gather", tuple(a for a in order if a in gathered), nbytes))
    if moved:
        nbytes = per_device_bytes(shape, dtype_bytes, dst, mesh)
        steps.append(Collective("all-to-all", tuple(a for a in order if a in moved), nbytes))
    return tuple(steps)


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _without_trivial_axes(spec: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec:
    """`spec` without axes of size 1 (checking that every axis is on `mesh`)."""
    if all(mesh.axis(name).size > 1 for name in spec.used_axes):
        return spec
    return ShardingSpec(tuple(tuple(a for a in axes if mesh.axis(a).size > 1) for axes in spec.dims))


def _check_rank(shape: tuple[int, ...], spec: ShardingSpec, what: str) -> None:
    if spec.rank != len(shape):
        raise ValueError(f"{what} {spec} has rank {spec.rank} but the tensor shape {shape} has rank {len(shape)}")
