"""Unit tasks: intersections of source and destination boxes, with who holds and who needs them."""

from __future__ import annotations

import pytest

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.resharding import MeshLayout, unit_tasks
from hlopar.analysis.resharding.paper_cases import parse_paper_spec
from hlopar.analysis.sharding import ShardingSpec, TensorSharding


def layout(shape, spec, devices, names=("x", "y"), device_ids=None):
    return MeshLayout(DeviceMesh.of(shape, names[: len(shape)], device_ids), parse_paper_spec(spec), devices)


def test_case3_has_one_task_per_pair_of_hosts():
    src = layout((2, 4), "RS0R", range(8))
    dst = layout((2, 4), "S0RR", range(8, 16))
    tasks = unit_tasks((4, 4, 2), src, dst, dtype_bytes=2)
    assert [(t.box, t.senders, t.receivers, t.nbytes) for t in tasks] == [
        (((0, 2), (0, 2), (0, 2)), (0, 1, 2, 3), (8, 9, 10, 11), 16),
        (((0, 2), (2, 4), (0, 2)), (4, 5, 6, 7), (8, 9, 10, 11), 16),
        (((2, 4), (0, 2), (0, 2)), (0, 1, 2, 3), (12, 13, 14, 15), 16),
        (((2, 4), (2, 4), (0, 2)), (4, 5, 6, 7), (12, 13, 14, 15), 16),
    ]
    assert [t.index for t in tasks] == [0, 1, 2, 3]


def test_uneven_halves_to_thirds():
    """(2,) -> (3,) over 5 elements: XLA's rule gives source [0,3) [3,5) and destination [0,2) [2,4) [4,5)."""
    src = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (0, 1))
    dst = MeshLayout(DeviceMesh.of((3,), ("x",)), ShardingSpec.of("x"), (2, 3, 4))
    tasks = unit_tasks((5,), src, dst, dtype_bytes=4)
    assert [(t.box, t.senders, t.receivers) for t in tasks] == [
        (((0, 2),), (0,), (2,)),
        (((2, 3),), (0,), (3,)),
        (((3, 4),), (1,), (3,)),
        (((4, 5),), (1,), (4,)),
    ]


def test_devices_with_empty_shards_receive_nothing():
    src = MeshLayout(DeviceMesh.of((1,), ("x",)), ShardingSpec.of(None), (0,))
    dst = MeshLayout(DeviceMesh.of((4,), ("x",)), ShardingSpec.of("x"), (1, 2, 3, 4))
    tasks = unit_tasks((2,), src, dst, dtype_bytes=4)
    assert [t.receivers for t in tasks] == [(1,), (2,)]


def test_replication_on_both_sides_is_one_task():
    src = layout((2, 3), "RRR", (0, 1, 2, 4, 5, 6))
    dst = layout((3, 2), "RRR", (8, 9, 12, 13, 16, 17))
    (task,) = unit_tasks((4, 4, 4), src, dst, dtype_bytes=2)
    assert task.senders == (0, 1, 2, 4, 5, 6) and task.receivers == (8, 9, 12, 13, 16, 17)
    assert task.nbytes == 128


def test_logical_device_order_and_physical_placement():
    """Logical ids (sdy device_ids) index the physical list; senders follow the mesh order."""
    src = MeshLayout(DeviceMesh.of((2,), ("x",), device_ids=(1, 0)), ShardingSpec.of("x"), (10, 11))
    dst = MeshLayout(DeviceMesh.of((1,), ("x",)), ShardingSpec.of(None), (20,))
    tasks = unit_tasks((4,), src, dst, dtype_bytes=1)
    # Mesh position 0 is logical device 1, physical 11: it holds the first half.
    assert [(t.box, t.senders) for t in tasks] == [(((0, 2),), (11,)), (((2, 4),), (10,))]


def test_sub_axes_and_sdy_shardings():
    mesh = DeviceMesh.of((4,), ("x",))
    sharding = TensorSharding.parse('#sdy.sharding<@mesh, [{"x":(1)2}]>')  # major half of x
    src = MeshLayout(mesh, sharding, (0, 1, 2, 3))
    dst = MeshLayout(DeviceMesh.of((1,), ("y",)), ShardingSpec.of(None), (4,))
    tasks = unit_tasks((8,), src, dst, dtype_bytes=1)
    assert [(t.box, t.senders) for t in tasks] == [(((0, 4),), (0, 1)), (((4, 8),), (2, 3))]


def test_overlapping_meshes_are_rejected():
    src = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (0, 1))
    dst = MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (1, 2))
    with pytest.raises(ValueError, match=r"share devices \[1\]"):
        unit_tasks((4,), src, dst, dtype_bytes=4)


def test_layout_checks_its_physical_devices():
    with pytest.raises(ValueError, match="has 2 devices but 3 physical ids"):
        MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (0, 1, 2))
    with pytest.raises(ValueError, match="distinct"):
        MeshLayout(DeviceMesh.of((2,), ("x",)), ShardingSpec.of("x"), (3, 3))
