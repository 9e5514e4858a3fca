"""Unit communication tasks of a cross-mesh transfer (§2.2 of the cross-mesh resharding paper).

A transfer sends a tensor laid out by X_A on mesh A to the layout X_B on mesh B. Its unit
tasks are the boxes of the common refinement of both layouts: every non-empty intersection
of a distinct source box (all devices of A holding it can send it) with a distinct
destination box (every device of B holding it needs the whole intersection). Destination
boxes never overlap, so each unit task has exactly one set of receivers and every receiver
needs all of it; replication on either side, N-D tensors and uneven shapes (XLA's rule, see
`device_slices.py`) need nothing special.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hlopar.analysis.device_slices import all_device_slices, devices_holding
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import ShardingSpec, TensorSharding
from hlopar.dialect.transfers import Box, box_bytes

__all__ = ["MeshLayout", "UnitTask", "box_contains", "box_of", "box_slices", "unit_tasks"]


def box_of(index: Sequence[slice]) -> Box:
    return tuple((s.start, s.stop) for s in index)


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """`box` as slices of an array whose element 0 is at `origin` (None: the global array)."""
    if origin is None:
        return tuple(slice(lo, hi) for lo, hi in box)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def box_contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it is empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class MeshLayout:
    """A tensor's layout on one mesh, and where the mesh's devices physically are.

    `sharding` names mesh axes (sdy or the papers' spec); the ids it yields are the mesh's
    logical ids (`mesh.device_list`), and `devices[i]` is the physical device of logical
    id i. Without `devices` the logical ids are the physical ones.
    """

    mesh: DeviceMesh
    sharding: ShardingSpec | TensorSharding
    devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.devices is not None:
            devices = tuple(int(d) for d in self.devices)
            if len(devices) != self.mesh.size:
                raise ValueError(
                    f"mesh {self.mesh} has {self.mesh.size} devices but {len(devices)} physical ids were given"
                )
            if len(set(devices)) != len(devices):
                raise ValueError(f"physical device ids must be distinct, got {list(devices)}")
            object.__setattr__(self, "devices", devices)

    def physical(self, logical: int) -> int:
        return logical if self.devices is None else self.devices[logical]

    @property
    def physical_devices(self) -> tuple[int, ...]:
        return tuple(self.physical(d) for d in self.mesh.device_list)

    def device_boxes(self, shape: Sequence[int]) -> dict[int, Box]:
        """Physical device id -> the box of the global array it holds."""
        return {
            self.physical(d): box_of(index)
            for d, index in all_device_slices(tuple(shape), self.sharding, self.mesh).items()
        }

    def held_boxes(self, shape: Sequence[int]) -> list[tuple[Box, tuple[int, ...]]]:
        """Distinct non-empty boxes with the physical devices holding each (mesh order)."""
        return [
            (box_of(held.index), tuple(self.physical(d) for d in held.devices))
            for held in devices_holding(shape, self.sharding, self.mesh)
        ]


@dataclass(frozen=True)
class UnitTask:
    """One box to move: any of `senders` may send it, every one of `receivers` needs all of it."""

    index: int
    box: Box
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: int


def unit_tasks(shape: Sequence[int], src: MeshLayout, dst: MeshLayout, dtype_bytes: int) -> tuple[UnitTask, ...]:
    """The unit tasks of moving a tensor of `shape` from `src` to `dst`.

    Ordered by destination box, then source box: the order in which Alpa walks a transfer
    (the baselines' "arbitrary global order"). Raises `ValueError` when the meshes share a
    physical device, since a cross-mesh transfer is between disjoint meshes.
    """
    shared = sorted(set(src.physical_devices) & set(dst.physical_devices))
    if shared:
        raise ValueError(f"source and destination meshes share devices {shared}")
    src_boxes = src.held_boxes(shape)
    tasks: list[UnitTask] = []
    for dst_box, receivers in dst.held_boxes(shape):
        for src_box, senders in src_boxes:
            box = intersect(src_box, dst_box)
            if box is not None:
                tasks.append(UnitTask(len(tasks), box, senders, receivers, box_bytes(box, dtype_bytes)))
    return tuple(tasks)
