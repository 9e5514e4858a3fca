"""Executing plans on the 8 local CPU devices delivers exactly the destination layout.

The property test draws tensor shapes (uneven ones included), sharding specs, mesh pairs
with arbitrary device orders and physical placements, cluster shapes, strategies,
algorithms and chunk counts; every device of the destination mesh must end up with
exactly its slice of the tensor.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlopar.analysis.device_slices import all_device_slices
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.resharding import ALGORITHMS, STRATEGIES, HostModel, MeshLayout, plan_transfer
from hlopar.analysis.sharding import ShardingSpec
from hlopar.dialect.transfers import UnitOp
from hlopar.runtime.local_transfer import TransferError, assemble, execute_ops, execute_plan, shard_array

MESH_SHAPES = {1: [(1,)], 2: [(2,), (1, 2)], 3: [(3,), (3, 1)], 4: [(4,), (2, 2), (1, 4)], 5: [(5,)], 6: [(2, 3), (6,)]}


@st.composite
def layouts(draw, size: int, names: tuple[str, str], physical: tuple[int, ...], rank: int):
    shape = draw(st.sampled_from(MESH_SHAPES[size]))
    order = draw(st.permutations(range(size)))
    mesh = DeviceMesh.of(shape, names[: len(shape)], device_ids=order)
    dims: list[list[str]] = [[] for _ in range(rank)]
    for name in draw(st.permutations(mesh.axis_names)):
        where = draw(st.integers(-1, rank - 1))  # -1: the tensor is replicated over this axis
        if where >= 0:
            dims[where].append(name)
    return MeshLayout(mesh, ShardingSpec(tuple(tuple(d) for d in dims)), physical)


@st.composite
def transfers(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank)))
    src_size = draw(st.integers(1, 4))
    dst_size = draw(st.integers(1, 8 - src_size if 8 - src_size < 6 else 6).filter(lambda n: n in MESH_SHAPES))
    devices = draw(st.permutations(range(8)))
    src = draw(layouts(src_size, ("a", "b"), tuple(devices[:src_size]), rank))
    dst = draw(layouts(dst_size, ("x", "y"), tuple(devices[src_size : src_size + dst_size]), rank))
    model = HostModel(devices_per_host=draw(st.integers(1, 4)))
    options = dict(
        strategy=draw(st.sampled_from(STRATEGIES)),
        algorithm=draw(st.sampled_from(ALGORITHMS)),
        chunks=draw(st.sampled_from([0, 1, 2, 5])),
    )
    return shape, src, dst, model, options


def expected_shards(array: np.ndarray, layout: MeshLayout) -> dict[int, np.ndarray]:
    slices = all_device_slices(array.shape, layout.sharding, layout.mesh)
    return {layout.physical(d): array[index] for d, index in slices.items()}


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers())
def test_executing_any_plan_delivers_the_destination_layout(case):
    shape, src, dst, model, options = case
    array = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    plan = plan_transfer(shape, 4, src, dst, model, **options)
    result = execute_plan(plan, shard_array(array, src))
    expected = expected_shards(array, dst)
    assert set(result) == set(expected)
    devices = jax.devices()
    for device, shard in result.items():
        assert shard.devices() == {devices[device]}
        np.testing.assert_array_equal(np.asarray(shard), expected[device])


def test_even_result_is_a_jax_array_with_the_destination_sharding():
    shape = (8, 12)
    src = MeshLayout(DeviceMesh.of((2, 2), ("a", "b")), ShardingSpec.of("a", "b"), (0, 1, 2, 3))
    dst = MeshLayout(DeviceMesh.of((2, 2), ("x", "y")), ShardingSpec.of(None, ("y", "x")), (7, 6, 5, 4))
    array = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    plan = plan_transfer(shape, 4, src, dst, HostModel(devices_per_host=2))
    result = assemble(execute_plan(plan, shard_array(array, src)), shape, dst)
    np.testing.assert_array_equal(np.asarray(result), array)
    for shard in result.addressable_shards:  # jax agrees on which device holds what
        np.testing.assert_array_equal(np.asarray(shard.data), array[shard.index])


def test_broadcast_receivers_forward_what_they_received():
    """A chain whose first receiver does not need the box cannot deliver it."""
    shape = (4,)
    src = MeshLayout(DeviceMesh.of((1,), ("a",)), ShardingSpec.of(None), (0,))
    dst = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (1, 2))
    shards = shard_array(np.arange(4.0, dtype=np.float32), src)
    bad = [UnitOp(0, "broadcast", 0, (1, 2), ((0, 4),), 16, chunks=2)]
    with pytest.raises(TransferError, match="device 1 does not need box"):
        execute_ops(bad, shape, src, dst, shards)


def test_missing_data_is_reported():
    shape = (4,)
    src = MeshLayout(DeviceMesh.of((1,), ("a",)), ShardingSpec.of(None), (0,))
    dst = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (1, 2))
    shards = shard_array(np.arange(4.0, dtype=np.float32), src)
    partial = [UnitOp(0, "send_recv", 0, (1,), ((0, 2),), 8)]
    with pytest.raises(TransferError, match="device 2 is missing 2 of its 2 elements"):
        execute_ops(partial, shape, src, dst, shards)
    wrong_sender = [UnitOp(0, "send_recv", 3, (1,), ((0, 2),), 8)]
    with pytest.raises(TransferError, match="device 3 does not hold"):
        execute_ops(wrong_sender, shape, src, dst, shards)
