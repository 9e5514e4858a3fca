"""Carry out a planned cross-mesh transfer on the local jax devices, to prove plans correct.

Each unit op moves data the way it says, device to device: a broadcast sends its box chunk
by chunk down its chain, each receiver forwarding the chunk *it received*; send/recv sends
the whole box to each receiver; Alpa's scatter/all-gather sends one part per receiver and
then rotates the parts around the receivers' ring. Copies are `jax.device_put` of the data a
device holds (read as numpy) onto the next device; receivers assemble their shards on the
host and put them on their device. Physical device ids are positions in `jax.devices()`
unless a mapping is given.

The executor checks the plan as it runs: a sender must hold the box it sends, a receiver
must need it, and at the end every element of every destination shard must have arrived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hlopar.analysis.device_slices import all_device_slices
from hlopar.analysis.resharding.plan import TransferPlan
from hlopar.analysis.resharding.unit_tasks import MeshLayout, box_contains, box_slices
from hlopar.analysis.sharding import ShardingSpec, TensorSharding
from hlopar.codegen.transfers import PlannedTransfer
from hlopar.dialect.transfers import Box, UnitOp

__all__ = [
    "TransferError",
    "assemble",
    "execute_ops",
    "execute_plan",
    "gather_shards",
    "local_devices",
    "run_planned_transfer",
    "shard_array",
]


class TransferError(RuntimeError):
    """A plan that cannot be carried out, or that leaves a destination shard incomplete."""


def local_devices() -> dict[int, jax.Device]:
    return dict(enumerate(jax.devices()))


def shard_array(
    array: np.ndarray, layout: MeshLayout, devices: Mapping[int, jax.Device] | None = None
) -> dict[int, jax.Array]:
    """Each physical device of the layout gets its slice of `array`, on that device."""
    devices = devices or local_devices()
    boxes = layout.device_boxes(array.shape)
    return {d: jax.device_put(array[box_slices(box)], devices[d]) for d, box in boxes.items()}


def _split(box: Box, dim: int, parts: int) -> list[Box]:
    lo, hi = box[dim]
    step = (hi - lo) // parts
    return [box[:dim] + ((lo + i * step, lo + (i + 1) * step),) + box[dim + 1 :] for i in range(parts)]


class _Receivers:
    """Destination shards being filled on the host, with a mask of what has arrived."""

    def __init__(self, boxes: Mapping[int, Box], dtype):
        self.boxes = dict(boxes)
        self.data = {d: np.zeros([hi - lo for lo, hi in b], dtype) for d, b in boxes.items()}
        self.seen = {d: np.zeros(self.data[d].shape, bool) for d in boxes}

    def store(self, device: int, box: Box, values: np.ndarray, op: UnitOp) -> None:
        if device not in self.boxes:
            raise TransferError(f"op of task {op.task}: device {device} is not in the destination mesh")
        if not box_contains(self.boxes[device], box):
            raise TransferError(f"op of task {op.task}: device {device} does not need box {list(box)}")
        where = box_slices(box, self.boxes[device])
        self.data[device][where] = values.reshape(self.data[device][where].shape)
        self.seen[device][where] = True


def execute_ops(
    ops: Sequence[UnitOp],
    shape: Sequence[int],
    src: MeshLayout,
    dst: MeshLayout,
    src_shards: Mapping[int, jax.Array],
    devices: Mapping[int, jax.Device] | None = None,
) -> dict[int, jax.Array]:
    """Runs the ops in order; returns each destination device's shard, on that device."""
    devices = devices or local_devices()
    shape = tuple(shape)
    src_boxes = src.device_boxes(shape)
    dst_boxes = dst.device_boxes(shape)
    dtype = next(iter(src_shards.values())).dtype
    sink = _Receivers(dst_boxes, dtype)

    def read(device: int, box: Box, op: UnitOp) -> jax.Array:
        if device not in src_shards or not box_contains(src_boxes[device], box):
            raise TransferError(f"op of task {op.task}: device {device} does not hold box {list(box)}")
        return jax.device_put(
            np.ascontiguousarray(np.asarray(src_shards[device])[box_slices(box, src_boxes[device])]), devices[device]
        )

    def move(data: jax.Array, device: int) -> jax.Array:
        return jax.device_put(np.asarray(data), devices[device])

    for op in ops:
        if op.kind == "broadcast":
            packed = np.asarray(read(op.sender, op.box, op)).reshape(-1)
            bounds = np.linspace(0, packed.shape[0], op.chunks + 1).round().astype(int)
            received: dict[int, list[np.ndarray]] = {r: [] for r in op.receivers}
            for lo, hi in zip(bounds, bounds[1:]):
                chunk = packed[lo:hi]
                for receiver in op.receivers:  # down the chain: each hop copies what the last one got
                    chunk = move(chunk, receiver)
                    received[receiver].append(np.asarray(chunk))
            for receiver, chunks in received.items():
                sink.store(receiver, op.box, np.concatenate(chunks), op)
        elif op.kind == "send_recv":
            data = read(op.sender, op.box, op)
            for receiver in op.receivers:
                sink.store(receiver, op.box, np.asarray(move(data, receiver)), op)
        elif op.kind == "scatter_allgather":
            parts = _split(op.box, op.split_dim, len(op.receivers))
            held = {r: {i: move(read(op.sender, part, op), r)} for i, (r, part) in enumerate(zip(op.receivers, parts))}
            ring = len(op.receivers)
            for step in range(ring - 1):  # receiver i passes part (i - step) to receiver i + 1
                sends = [(op.receivers[i], op.receivers[(i + 1) % ring], (i - step) % ring) for i in range(ring)]
                for giver, taker, part in sends:
                    held[taker][part] = move(held[giver][part], taker)
            for receiver, pieces in held.items():
                for i, data in pieces.items():
                    sink.store(receiver, parts[i], np.asarray(data), op)
        else:
            raise TransferError(f"unknown unit op kind {op.kind!r}")

    for device, seen in sink.seen.items():
        if not seen.all():
            missing = int(seen.size - seen.sum())
            raise TransferError(f"device {device} is missing {missing} of its {seen.size} elements after the transfer")
    return {d: jax.device_put(sink.data[d], devices[d]) for d in sink.data}


def execute_plan(
    plan: TransferPlan, src_shards: Mapping[int, jax.Array], devices: Mapping[int, jax.Device] | None = None
) -> dict[int, jax.Array]:
    """Runs a plan's ops in slot order (see `execute_ops`)."""
    return execute_ops([p.op for p in plan.ops], plan.shape, plan.src, plan.dst, src_shards, devices)


def run_planned_transfer(
    transfer: PlannedTransfer, array, devices: Mapping[int, jax.Device] | None = None
) -> np.ndarray:
    """Carries out a decoded `hlopar.cross_mesh_transfer` (`codegen.transfers`) on the global
    value `array` (host or device): splits it over the source devices by the source layout,
    runs the unit ops device to device, and returns the destination's global value, put back
    together on the host, checking that the destination shards cover it and replicas agree."""
    devices = devices or local_devices()
    array = np.asarray(array).reshape(transfer.shape)
    shards = execute_ops(
        transfer.ops, transfer.shape, transfer.src, transfer.dst, shard_array(array, transfer.src, devices), devices
    )
    pieces = {}
    for logical, index in all_device_slices(transfer.shape, transfer.dst.sharding, transfer.dst.mesh).items():
        device = transfer.dst.physical(logical)
        pieces[device] = (index, np.asarray(shards[device]))
    return gather_shards(transfer.shape, array.dtype, pieces, TransferError)


def gather_shards(
    shape: Sequence[int],
    dtype,
    pieces: Mapping[int, tuple[tuple[slice, ...], np.ndarray]],
    error: type[Exception] = TransferError,
) -> np.ndarray:
    """The global value from each destination device's (index, shard), raising `error` when
    two replicas of an element differ or an element is in no shard."""
    gathered = np.empty(tuple(shape), dtype)
    seen = np.zeros(tuple(shape), bool)
    for device, (index, shard) in pieces.items():
        if seen[index].any() and not np.array_equal(
            gathered[index][seen[index]], shard[seen[index]], equal_nan=np.issubdtype(dtype, np.inexact)
        ):
            raise error(f"device {device} received a replica that differs from another's")
        gathered[index] = shard
        seen[index] = True
    if not seen.all():
        raise error(f"the shards cover {int(seen.sum())} of {seen.size} elements")
    return gathered


def assemble(
    shards: Mapping[int, jax.Array],
    shape: Sequence[int],
    layout: MeshLayout,
    devices: Mapping[int, jax.Device] | None = None,
) -> jax.Array:
    """The destination shards as one global `jax.Array` with the layout's `NamedSharding`.

    Only for layouts jax can express: whole mesh axes (no sub-axes) and dimensions the
    shard counts divide.
    """
    devices = devices or local_devices()
    spec = layout.sharding.to_spec() if isinstance(layout.sharding, TensorSharding) else layout.sharding
    assert isinstance(spec, ShardingSpec)
    grid = np.array([devices[layout.physical(d)] for d in layout.mesh.device_list], dtype=object)
    mesh = Mesh(grid.reshape(layout.mesh.shape), layout.mesh.axis_names)
    sharding = NamedSharding(mesh, PartitionSpec(*(axes or None for axes in spec.dims)))
    by_device = {devices[d]: array for d, array in shards.items()}
    arrays = [by_device[device] for device in sharding.addressable_devices_indices_map(tuple(shape))]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
