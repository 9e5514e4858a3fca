"""Per-device slices of a global tensor: XLA's uneven rule, replication, device orders, JAX."""

from __future__ import annotations

from hlopar.runtime.host_devices import use_host_devices

use_host_devices(8)

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hlopar.analysis.device_slices import (
    HeldSlice,
    all_device_slices,
    device_slice,
    devices_holding,
    dim_slice,
    gspmd_device_slices,
    shard_index,
)
from hlopar.analysis.gspmd import parse_gspmd, to_gspmd_sharding
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import ShardingSpec, TensorSharding

MESH = DeviceMesh.of((2, 4), ("x", "y"))
TRANSPOSED = DeviceMesh.of((4, 2), ("x", "y"), device_ids=np.arange(8).reshape(2, 4).T)


def test_dim_slice_uneven_rule():
    assert [dim_slice(5, 4, i) for i in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    sizes = [len(range(5)[dim_slice(5, 4, i)]) for i in range(4)]
    assert sizes == [2, 2, 1, 0]
    assert [dim_slice(8, 4, i) for i in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    # ceil(3 / 8) = 1: three one-element pieces, then five empty ones.
    assert [dim_slice(3, 8, i) for i in range(8)] == [slice(i, i + 1) for i in range(3)] + [slice(3, 3)] * 5
    # ceil(10 / 4) = 3: the last piece is short.
    assert [dim_slice(10, 4, i) for i in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert dim_slice(0, 2, 1) == slice(0, 0)
    assert dim_slice(7, 1, 0) == slice(0, 7)
    with pytest.raises(ValueError, match="out of range"):
        dim_slice(4, 2, 2)


def test_device_slice_examples():
    spec = ShardingSpec.of("x", "y")
    assert device_slice((4, 8), spec, MESH, 0) == (slice(0, 2), slice(0, 2))
    assert device_slice((4, 8), spec, MESH, 6) == (slice(2, 4), slice(4, 6))
    assert shard_index(spec, MESH, 6) == (1, 2)
    # Several axes on one dim: the first listed is major.
    assert shard_index(ShardingSpec.of(("x", "y")), MESH, 6) == (6,)
    assert shard_index(ShardingSpec.of(("y", "x")), MESH, 6) == (5,)
    assert device_slice((16,), ShardingSpec.of(("y", "x")), MESH, 6) == (slice(10, 12),)
    # Transposed device order: device 1 sits at x=1, y=0.
    assert TRANSPOSED.coords(1) == {"x": 1, "y": 0}
    assert device_slice((8, 2), ShardingSpec.of("x", "y"), TRANSPOSED, 1) == (slice(2, 4), slice(0, 1))
    # Uneven: 5 rows over y=4 gives rows 0-2, 2-4, 4-5 and nothing.
    rows = [device_slice((5, 3), ShardingSpec.of("y", None), MESH, d)[0] for d in range(4)]
    assert rows == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]


def test_maximal_and_replicated():
    maximal = DeviceMesh((), (3,))
    assert all_device_slices((4, 2), ShardingSpec.replicated(2), maximal) == {3: (slice(0, 4), slice(0, 2))}
    everywhere = all_device_slices((4, 2), ShardingSpec.replicated(2), MESH)
    assert everywhere == {d: (slice(0, 4), slice(0, 2)) for d in range(8)}
    assert devices_holding((4, 2), ShardingSpec.replicated(2), MESH) == (
        HeldSlice((slice(0, 4), slice(0, 2)), tuple(range(8))),
    )
    assert all_device_slices((), ShardingSpec(()), MESH)[5] == ()


def test_errors():
    with pytest.raises(ValueError, match="rank"):
        device_slice((4,), ShardingSpec.of("x", "y"), MESH, 0)
    with pytest.raises(ValueError, match="no axis"):
        device_slice((4,), ShardingSpec.of("w"), MESH, 0)
    with pytest.raises(ValueError, match="not in mesh"):
        device_slice((4,), ShardingSpec.of("x"), MESH, 9)
    with pytest.raises(ValueError, match="needs a mesh"):
        all_device_slices((4,), ShardingSpec.of("x"))
    with pytest.raises(ValueError, match="used twice"):
        all_device_slices((4,), TensorSharding.parse('#sdy.sharding<@m, [{"x", "x"}]>'), MESH)


def _check_layout(shape, spec, mesh):
    """Every element is held by the same number of devices; the distinct boxes tile the tensor."""
    slices = all_device_slices(shape, spec, mesh)
    assert set(slices) == set(mesh.device_list)
    counts = np.zeros(shape, dtype=np.int64)
    for index in slices.values():
        counts[index] += 1
    replicas = mesh.size // np.prod([spec.num_shards(mesh, d) for d in range(spec.rank)])
    assert np.all(counts == replicas)
    held = devices_holding(shape, spec, mesh)
    assert all(len(h.devices) == replicas for h in held)
    assert sum(np.prod([s.stop - s.start for s in h.index]) for h in held) == int(np.prod(shape))
    for box in held:
        assert all(slices[d] == box.index for d in box.devices)
    empty = set(slices) - {d for h in held for d in h.devices}
    assert all(any(s.start == s.stop for s in slices[d]) for d in empty)
    return slices


MESHES = [
    MESH,
    TRANSPOSED,
    DeviceMesh.of((2, 2, 2), ("x", "y", "z"), device_ids=np.arange(8).reshape(2, 2, 2).transpose(2, 0, 1)),
    DeviceMesh.of((8,), ("x",), device_ids=[3, 1, 7, 5, 0, 2, 6, 4]),
    DeviceMesh.of((3, 2), ("x", "y")),
]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_element_covered_even_and_uneven(mesh):
    names = mesh.axis_names
    specs = [ShardingSpec.replicated(2)]
    for a, b in itertools.permutations(names, 2):
        specs += [ShardingSpec.of(a, b), ShardingSpec.of((a, b), None), ShardingSpec.of(None, a)]
    specs += [ShardingSpec.of(names[0], None), ShardingSpec.of(tuple(names), None)]
    for spec in specs:
        for shape in [(8, 6), (5, 3), (7, 1), (1, 9), (0, 4)]:
            _check_layout(shape, spec, mesh)


def test_devices_holding_groups_replicas():
    held = devices_holding((4, 8), ShardingSpec.of("x", None), MESH)
    assert held == (
        HeldSlice((slice(0, 2), slice(0, 8)), (0, 1, 2, 3)),
        HeldSlice((slice(2, 4), slice(0, 8)), (4, 5, 6, 7)),
    )
    # Transposed device order: x=i holds devices i and i + 4.
    held = devices_holding((4, 8), ShardingSpec.of(None, "x"), TRANSPOSED)
    assert held == tuple(HeldSlice((slice(0, 4), slice(2 * i, 2 * i + 2)), (i, i + 4)) for i in range(4))
    held = devices_holding((4, 8), ShardingSpec.of("y", None), TRANSPOSED)
    assert held == (
        HeldSlice((slice(0, 2), slice(0, 8)), (0, 1, 2, 3)),
        HeldSlice((slice(2, 4), slice(0, 8)), (4, 5, 6, 7)),
    )
    # Uneven: 3 rows over 4 shards; the devices of the empty last shard hold nothing.
    held = devices_holding((3,), ShardingSpec.of("y"), MESH)
    assert held == tuple(HeldSlice((slice(i, i + 1),), (i, i + 4)) for i in range(3))
    assert device_slice((3,), ShardingSpec.of("y"), MESH, 7) == (slice(3, 3),)


def test_sub_axes_and_unreduced():
    mesh = DeviceMesh.of((4,), ("x",))
    major = TensorSharding.parse('#sdy.sharding<@m, [{"x":(1)2}]>')
    assert [device_slice((8,), major, mesh, d) for d in range(4)] == [(slice(0, 4),)] * 2 + [(slice(4, 8),)] * 2
    minor = TensorSharding.parse('#sdy.sharding<@m, [{"x":(2)2}]>')
    assert [device_slice((8,), minor, mesh, d) for d in range(4)] == [(slice(0, 4),), (slice(4, 8),)] * 2
    both = TensorSharding.parse('#sdy.sharding<@m, [{"x":(2)2}, {"x":(1)2}]>')
    assert device_slice((2, 2), both, mesh, 1) == (slice(1, 2), slice(0, 1))
    unreduced = TensorSharding.parse('#sdy.sharding<@m, [{"x":(1)2}], unreduced={"x":(2)2}>')
    assert all_device_slices((8,), unreduced, mesh) == all_device_slices((8,), major, mesh)
    inline = TensorSharding.parse('#sdy.sharding<mesh<["x"=2], device_ids=[1, 0]>, [{"x"}]>')
    assert all_device_slices((4,), inline) == {1: (slice(0, 2),), 0: (slice(2, 4),)}


def test_gspmd_device_slices():
    gs = parse_gspmd("{devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}")
    assert gspmd_device_slices((5, 3), gs) == {
        0: (slice(0, 3), slice(0, 3)),
        2: (slice(0, 3), slice(0, 3)),
        1: (slice(3, 5), slice(0, 3)),
        3: (slice(3, 5), slice(0, 3)),
    }
    assert gspmd_device_slices((2,), parse_gspmd("{maximal device=4}")) == {4: (slice(0, 2),)}
    assert gspmd_device_slices((2,), parse_gspmd("{replicated}"), devices=[0, 1]) == {
        0: (slice(0, 2),),
        1: (slice(0, 2),),
    }
    with pytest.raises(ValueError, match="pass them"):
        gspmd_device_slices((2,), parse_gspmd("{replicated}"))
    with pytest.raises(ValueError, match="rank"):
        gspmd_device_slices((2, 2), gs.__class__.tiled((2,)))
    # The mesh view and the tile-array view agree, uneven shapes included.
    for mesh in MESHES[:4]:
        spec = ShardingSpec.of(mesh.axis_names[-1], mesh.axis_names[0] if mesh.ndim > 1 else None)
        for shape in [(8, 8), (5, 3)]:
            assert all_device_slices(shape, spec, mesh) == gspmd_device_slices(shape, to_gspmd_sharding(mesh, spec))


# --- against JAX ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "conftest.py gives every unit test 8 CPU devices"
    return devices[:8]


def _normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def test_slices_match_jax_placement(cpu_devices):
    d = np.array(cpu_devices)
    meshes = [
        Mesh(d.reshape(2, 4), ("x", "y")),
        Mesh(d.reshape(2, 4).T, ("x", "y")),  # transposed device order
        Mesh(d.reshape(2, 2, 2).transpose(1, 2, 0), ("x", "y", "z")),
        Mesh(d[[3, 1, 7, 5, 0, 2, 6, 4]].reshape(2, 4), ("x", "y")),
    ]
    specs = [
        P(),
        P("x"),
        P(None, "y"),
        P("y", "x"),
        P(("x", "y")),
        P(("y", "x"), None),
        P("z", ("x", "y")),
        P(None, ("z", "x")),
    ]
    shape = (8, 16)
    checked = 0
    for jmesh in meshes:
        mesh = DeviceMesh.of(jmesh.devices.shape, jmesh.axis_names, device_ids=[x.id for x in jmesh.devices.flat])
        for p in specs:
            used = {a for e in p if e is not None for a in ((e,) if isinstance(e, str) else e)}
            if not used <= set(jmesh.axis_names):
                continue
            spec = ShardingSpec(
                tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in p) + ((),) * (2 - len(p))
            )
            array = jax.device_put(np.arange(np.prod(shape)).reshape(shape), NamedSharding(jmesh, p))
            expected = {s.device.id: _normalized(s.index, shape) for s in array.addressable_shards}
            assert all_device_slices(shape, spec, mesh) == expected, (jmesh, p)
            for shard in array.addressable_shards:  # and the data really is that box
                box = device_slice(shape, spec, mesh, shard.device.id)
                np.testing.assert_array_equal(np.asarray(shard.data), np.arange(np.prod(shape)).reshape(shape)[box])
            checked += 1
    assert checked >= 25
