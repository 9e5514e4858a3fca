"""The transports' unit-op semantics, without Ray: what a sender packs of a planned transfer
and what the receiver rebuilds from it, for any layouts and strategies, also when each mesh
is split over several workers (one per host) that each hold only their devices' shards; the
mailbox's waits are bounded."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.resharding import STRATEGIES, HostModel, MeshLayout, plan_transfer
from hlopar.analysis.sharding import ShardingSpec
from hlopar.codegen.transfers import PlannedTransfer
from hlopar.dialect.transfers import UnitOp
from hlopar.runtime.mesh_processes import Pieces, gather_pieces, routes, worker_layout
from hlopar.runtime.transports import Mailbox, Payload, TransportError, pack, transport_kind, unpack, unpack_shards

MESH_SHAPES = {1: [(1,)], 2: [(2,), (1, 2)], 3: [(3,)], 4: [(4,), (2, 2), (1, 4)]}


def planned(shape, src: MeshLayout, dst: MeshLayout, strategy: str = "broadcast") -> PlannedTransfer:
    plan = plan_transfer(shape, 4, src, dst, HostModel(devices_per_host=4), strategy=strategy)
    return PlannedTransfer(tuple(shape), tuple(p.op for p in plan.ops), src, dst, plan.strategy, plan.predicted_time)


@st.composite
def layouts(draw, size: int, names: tuple[str, str], physical: tuple[int, ...], rank: int):
    shape = draw(st.sampled_from(MESH_SHAPES[size]))
    mesh = DeviceMesh.of(shape, names[: len(shape)], device_ids=draw(st.permutations(range(size))))
    dims: list[list[str]] = [[] for _ in range(rank)]
    for name in mesh.axis_names:
        where = draw(st.integers(-1, rank - 1))
        if where >= 0:
            dims[where].append(name)
    return MeshLayout(mesh, ShardingSpec(tuple(tuple(d) for d in dims)), physical)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_unpack_rebuilds_what_pack_sent(data):
    rank = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    src_size, dst_size = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 2, 4]))
    devices = data.draw(st.permutations(range(8)))
    src = data.draw(layouts(src_size, ("a", "b"), tuple(devices[:src_size]), rank))
    dst = data.draw(layouts(dst_size, ("x", "y"), tuple(devices[src_size : src_size + dst_size]), rank))
    transfer = planned(shape, src, dst, data.draw(st.sampled_from(STRATEGIES)))
    array = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    payload = pack(transfer, array)
    # One box per unit op, each sent once whatever its number of receivers.
    assert payload.array is None and len(payload.boxes) == len(transfer.ops)
    assert payload.nbytes == sum(4 * int(np.prod([hi - lo for lo, hi in op.box])) for op in transfer.ops)
    np.testing.assert_array_equal(unpack(transfer, payload), array)


def shards_of(array: np.ndarray, layout: MeshLayout, devices) -> Pieces:
    """What a worker owning `devices` holds of `array` laid out by `layout`."""
    boxes = {d: b for b, holders in layout.held_boxes(array.shape) for d in holders if d in devices}
    return Pieces(
        array.shape, tuple(boxes.values()), tuple(array[tuple(slice(lo, hi) for lo, hi in b)] for b in boxes.values())
    )


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_workers_of_meshes_across_hosts_exchange_only_their_unit_ops(data):
    """Meshes on 4 hosts x 2 devices: each sending worker packs the ops of its devices for
    each receiving worker, which fills exactly its own devices' shards from what it gets."""
    rank = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    devices = data.draw(st.permutations(range(8)))
    src = data.draw(layouts(4, ("a", "b"), tuple(devices[:4]), rank))
    dst = data.draw(layouts(4, ("x", "y"), tuple(devices[4:]), rank))
    transfer = planned(shape, src, dst, data.draw(st.sampled_from(STRATEGIES)))
    layout = worker_layout({"s": src.physical_devices, "d": dst.physical_devices}, devices_per_host=2)
    array = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    paths = routes(transfer, layout, "s", "d")
    sent = {key: pack(transfer, shards_of(array, src, layout.slots[key[0]].devices), ops) for key, ops in paths.items()}
    assert sum(len(p.boxes) for p in sent.values()) == sum(
        len({layout.owner("d", r) for r in op.receivers}) for op in transfer.ops
    )  # once per receiving worker
    for slot in layout.of_mesh("d"):
        shards = unpack_shards(transfer, [p for (_, to), p in sent.items() if to == slot.name], slot.devices)
        assert set(shards) == set(slot.devices)
        held = {d: b for b, holders in dst.held_boxes(shape) for d in holders}
        for device, shard in shards.items():
            if device in held:  # else an empty shard (uneven split)
                np.testing.assert_array_equal(shard, array[tuple(slice(lo, hi) for lo, hi in held[device])])
    with pytest.raises(TransportError, match="does not hold box"):
        pack(transfer, Pieces(shape, (), ()))  # a worker holding none of the value


def test_the_pieces_of_every_worker_make_the_value():
    array = np.arange(24.0).reshape(4, 6)
    top, bottom = Pieces((4, 6), (((0, 2), (0, 6)),), (array[:2],)), Pieces((4, 6), (((2, 4), (0, 6)),), (array[2:],))
    np.testing.assert_array_equal(gather_pieces([top, bottom]), array)
    with pytest.raises(RuntimeError, match="cover 12 of 24"):
        gather_pieces([top])


def test_unplanned_transfers_move_the_whole_array():
    array = np.arange(6.0).reshape(2, 3)
    payload = pack(None, array)
    assert payload.boxes is None and payload.nbytes == array.nbytes
    np.testing.assert_array_equal(unpack(None, payload), array)


def test_sharded_destination_receives_only_its_slices():
    shape = (8, 4)
    src = MeshLayout(DeviceMesh.of((4,), ("a",)), ShardingSpec.of("a", None), (0, 1, 2, 3))
    dst = MeshLayout(DeviceMesh.of((4,), ("x",)), ShardingSpec.of("x", None), (4, 5, 6, 7))
    transfer = planned(shape, src, dst)
    array = np.arange(32.0, dtype=np.float32).reshape(shape)
    payload = pack(transfer, array)
    assert payload.nbytes == array.nbytes  # each row block once, not once per device
    np.testing.assert_array_equal(unpack(transfer, payload), array)


def test_bad_plans_are_refused():
    shape = (4,)
    src = MeshLayout(DeviceMesh.of((2,), ("a",)), ShardingSpec.of("a"), (0, 1))
    dst = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (2, 3))
    array = np.arange(4.0, dtype=np.float32)
    wrong_sender = PlannedTransfer(shape, (UnitOp(0, "send_recv", 1, (2,), ((0, 2),), 8),), src, dst, "x", 0.0)
    with pytest.raises(TransportError, match="device 1 does not hold box"):
        pack(wrong_sender, array)
    partial = PlannedTransfer(shape, (UnitOp(0, "send_recv", 0, (2,), ((0, 2),), 8),), src, dst, "x", 0.0)
    with pytest.raises(TransportError, match="device 3 is missing 2 of its 2 elements"):
        unpack(partial, pack(partial, array))
    wrong_receiver = PlannedTransfer(shape, (UnitOp(0, "send_recv", 0, (3,), ((0, 2),), 8),), src, dst, "x", 0.0)
    with pytest.raises(TransportError, match="device 3 does not need box"):
        unpack(wrong_receiver, pack(wrong_receiver, array))
    with pytest.raises(TransportError, match="expected 1 unit-op boxes"):
        unpack(partial, Payload(array=array))


def test_mailbox_waits_are_bounded():
    mailbox = Mailbox()
    clock = time.monotonic()
    with pytest.raises(TransportError, match="nothing arrived in 0.2 s"):
        mailbox.take((1, "t0", 0), 0.2)
    assert time.monotonic() - clock < 2
    threading.Timer(0.1, mailbox.put, ((1, "t0", 0), "payload")).start()
    assert mailbox.take((1, "t0", 0), 5) == "payload"
    mailbox.put((1, "t1", 0), "old")
    mailbox.put((2, "t1", 0), "new")
    mailbox.drop_before(2)
    assert mailbox.take((2, "t1", 0), 0.1) == "new"
    with pytest.raises(TransportError):
        mailbox.take((1, "t1", 0), 0.05)


def test_transport_is_chosen_by_device_kind():
    assert transport_kind("cpu") == "object-store"  # measured faster here (docs/runtime.md)
    assert transport_kind("gpu") == "collective"  # NCCL
    assert transport_kind("cpu", "collective") == "collective"
    assert transport_kind("gpu", "object-store") == "object-store"
    with pytest.raises(ValueError, match="unknown device kind"):
        transport_kind("tpu")
    with pytest.raises(ValueError, match="transport must be one of auto, object-store, collective"):
        transport_kind("cpu", "nccl")
