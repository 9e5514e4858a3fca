"""Which part of a global tensor each device holds.

The cross-mesh resharding pass moves data between two layouts of the same tensor; it needs,
for every device of either mesh, the exact box of the global array that device has, and the
distinct boxes with the devices that hold each (any one of them can send it).

Uneven shapes follow XLA: a dimension of size d cut into n pieces has pieces of
ceil(d / n) elements, piece i covering [i * size, (i + 1) * size) clipped to [0, d], so the
trailing pieces may be short or empty (d=5, n=4: 2, 2, 1, 0 elements). Slices always carry
explicit bounds (never `slice(None)`), and empty ones start at d.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hlopar.analysis.gspmd import GspmdSharding
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import AxisRef, ShardingSpec, TensorSharding, axes_index, axes_size, unused_axes

__all__ = [
    "HeldSlice",
    "all_device_slices",
    "device_slice",
    "devices_holding",
    "dim_slice",
    "gspmd_device_slices",
    "shard_index",
]

Index = tuple[slice, ...]


class HeldSlice(NamedTuple):
    """One distinct box of the tensor and the devices holding a copy, in mesh order."""

    index: Index
    devices: tuple[int, ...]


def dim_slice(size: int, num_shards: int, shard: int) -> slice:
    """Piece `shard` of a dimension of `size` elements cut into `num_shards` (XLA's rule)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range for {num_shards} shards")
    step = -(-size // num_shards)
    return slice(min(shard * step, size), min((shard + 1) * step, size))


def _dim_refs(spec: ShardingSpec | TensorSharding) -> tuple[tuple[AxisRef, ...], ...]:
    if isinstance(spec, ShardingSpec):
        return tuple(tuple(AxisRef(name) for name in axes) for axes in spec.dims)
    return spec.dim_axes


def _resolve(spec: ShardingSpec | TensorSharding, mesh: DeviceMesh | None, shape: Sequence[int]) -> DeviceMesh:
    if isinstance(spec, TensorSharding):
        mesh = spec.resolve_mesh(mesh)
        spec.check(mesh)
    elif mesh is None:
        raise ValueError("a sharding spec needs a mesh")
    else:
        unused_axes(mesh, [r for refs in _dim_refs(spec) for r in refs])
    if len(shape) != len(_dim_refs(spec)):
        raise ValueError(f"shape {tuple(shape)} has rank {len(shape)} but the sharding has rank {len(_dim_refs(spec))}")
    return mesh


def shard_index(spec: ShardingSpec | TensorSharding, mesh: DeviceMesh | None, device_id: int) -> tuple[int, ...]:
    """Which piece of each dimension `device_id` holds (the first axis of a dim is major)."""
    mesh = spec.resolve_mesh(mesh) if isinstance(spec, TensorSharding) else mesh
    if mesh is None:
        raise ValueError("a sharding spec needs a mesh")
    coords = mesh.coords(device_id)
    return tuple(axes_index(mesh, refs, coords) for refs in _dim_refs(spec))


def device_slice(
    shape: Sequence[int], spec: ShardingSpec | TensorSharding, mesh: DeviceMesh | None, device_id: int
) -> Index:
    """The box of the global tensor of `shape` that `device_id` holds.

    Axes that split no dimension replicate; unreduced axes hold partial values of the same
    box, so they count as replication here too.
    """
    mesh = _resolve(spec, mesh, shape)
    index = shard_index(spec, mesh, device_id)
    return tuple(dim_slice(size, axes_size(mesh, refs), i) for size, refs, i in zip(shape, _dim_refs(spec), index))


def all_device_slices(
    shape: Sequence[int], spec: ShardingSpec | TensorSharding, mesh: DeviceMesh | None = None
) -> dict[int, Index]:
    """`device_slice` for every device of the mesh, in mesh order."""
    mesh = _resolve(spec, mesh, shape)
    refs = _dim_refs(spec)
    counts = [axes_size(mesh, r) for r in refs]
    devices = mesh.devices()
    result: dict[int, Index] = {}
    for position in np.ndindex(*mesh.shape):
        coords = dict(zip(mesh.axis_names, position))
        result[int(devices[position])] = tuple(
            dim_slice(size, n, axes_index(mesh, r, coords)) for size, n, r in zip(shape, counts, refs)
        )
    return result


def devices_holding(
    shape: Sequence[int], spec: ShardingSpec | TensorSharding, mesh: DeviceMesh | None = None
) -> tuple[HeldSlice, ...]:
    """The distinct non-empty boxes, each with the devices that hold it, sorted by box start.

    Together the boxes tile the tensor without overlap. Devices whose box is empty (the
    trailing pieces of uneven shapes) hold nothing and appear in no group.
    """
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    boxes: dict[tuple[tuple[int, int], ...], Index] = {}
    for device, index in all_device_slices(shape, spec, mesh).items():
        if any(s.stop == s.start for s in index):
            continue
        key = tuple((s.start, s.stop) for s in index)
        groups.setdefault(key, []).append(device)
        boxes[key] = index
    return tuple(HeldSlice(boxes[key], tuple(groups[key])) for key in sorted(groups))


def gspmd_device_slices(
    shape: Sequence[int], sharding: GspmdSharding, devices: Sequence[int] | None = None
) -> dict[int, Index]:
    """The box each device holds under a GSPMD sharding, read straight off its tile array.

    Replicated, manual and unreduced shardings name no devices: pass `devices`, which then all
    hold the whole tensor. This is independent of the mesh machinery, so tests use it to check
    that GSPMD <-> sdy conversions keep every device's tile.
    """
    full = tuple(slice(0, size) for size in shape)
    if sharding.kind == "maximal":
        return {sharding.devices[0]: full}
    if sharding.kind in ("replicated", "manual", "unreduced", "unknown"):
        if devices is None:
            raise ValueError(f"a {sharding.kind} sharding names no devices: pass them")
        return {d: full for d in devices}
    if sharding.kind != "tiled":
        raise ValueError(f"a {sharding.kind} sharding has no single tensor layout")
    if len(shape) != sharding.rank:
        raise ValueError(f"shape {tuple(shape)} does not have the sharding's rank {sharding.rank}")
    data = sharding.data_tile_shape
    array = sharding.device_array().reshape(data + (math.prod(sharding.tile_shape[sharding.rank :]),))
    result: dict[int, Index] = {}
    for position in np.ndindex(*array.shape):
        tile = position[: sharding.rank]
        result[int(array[position])] = tuple(dim_slice(s, n, i) for s, n, i in zip(shape, data, tile))
    return result
