"""Cost model of auto-sharding: cluster presets, alpha-beta collectives, resharding (Alpa Table 2)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, LogicalMesh, MeshAxis, logical_mesh
from hlopar.analysis.auto_sharding.collectives import (
    Collective,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    reduce_scatter_cost,
)
from hlopar.analysis.auto_sharding.resharding import per_device_bytes, resharding_collectives, resharding_cost
from hlopar.analysis.device_slices import all_device_slices
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import ShardingSpec
from hlopar.units import format_bytes

S = ShardingSpec.of
R = None

# --- cluster ---------------------------------------------------------------------------------


def test_presets_exist_and_are_sane():
    for name in ("cpu", "v100-p3.16xlarge", "a100-80g-nvlink", "h100-80g-nvlink"):
        preset = CLUSTER_PRESETS[name]
        assert preset.name == name
        assert preset.intra_host_bandwidth > preset.inter_host_bandwidth > 0
        assert 0 < preset.intra_host_latency_s <= preset.inter_host_latency_s
        assert preset.device_flops > 0 and preset.device_memory_bytes > 0 and preset.devices_per_host == 8
    v100 = CLUSTER_PRESETS["v100-p3.16xlarge"]
    assert v100.device_memory_bytes == 16 * 2**30 and v100.device_flops == 125e12


@pytest.mark.parametrize(
    "shape, crossing",
    [
        ((2, 8), (True, False)),  # 2 hosts x 8 GPUs: axis 0 between hosts, axis 1 NVLink
        ((4, 4), (True, False)),  # columns {0, 4, 8, 12} span both hosts
        ((8, 2), (True, False)),
        ((16,), (True,)),
        ((2, 4), (False, False)),  # one host
        ((1, 16), (False, True)),
        ((2, 2, 4), (True, False, False)),
        ((4, 2, 2), (True, False, False)),
    ],
)
def test_axis_links_follow_hosts(shape, crossing):
    preset = CLUSTER_PRESETS["a100-80g-nvlink"]
    mesh = logical_mesh(shape, preset="a100-80g-nvlink")
    for axis, crosses in zip(mesh.axes, crossing):
        expected_bw = preset.inter_host_bandwidth if crosses else preset.intra_host_bandwidth
        expected_lat = preset.inter_host_latency_s if crosses else preset.intra_host_latency_s
        assert (axis.bandwidth_bytes_per_s, axis.latency_s) == (expected_bw, expected_lat), axis
    assert mesh.device_flops == preset.device_flops
    assert mesh.device_memory_bytes == preset.device_memory_bytes


def test_logical_mesh_fields_and_overrides():
    mesh = logical_mesh((2, 4), latencies=[1e-5, 2e-6], bandwidths=[1e9, 1e10], memory_budget=1e9)
    assert mesh.shape == (2, 4) and mesh.axis_names == ("x", "y") and mesh.size == 8
    assert mesh.axis("y") == MeshAxis("y", 4, 2e-6, 1e10)
    assert mesh.axes_size(("x", "y")) == 8 and mesh.axes_size(()) == 1
    assert mesh.device_memory_bytes == 1e9
    assert mesh.to_device_mesh() == DeviceMesh.of((2, 4), ("x", "y"))
    assert logical_mesh((2, 2, 2, 1)).axis_names == ("x", "y", "z", "w")
    assert logical_mesh((1,) * 5).axis_names == tuple(f"axis_{i}" for i in range(5))
    assert logical_mesh((2, 4), ("data", "model")).axis_names == ("data", "model")
    assert str(mesh) == "[x=2, y=4]"
    hash(mesh)  # keys the resharding cache


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: logical_mesh((2, 0)), "positive"),
        (lambda: logical_mesh((2, -1)), "positive"),
        (lambda: logical_mesh((2, 4), ("x",)), "differ in length"),
        (lambda: logical_mesh((2, 4), ("x", "x")), "duplicate"),
        (lambda: logical_mesh((2, 4), latencies=[1e-6]), "latencies"),
        (lambda: logical_mesh((2, 4), bandwidths=[1e9, 1e9, 1e9]), "bandwidths"),
        (lambda: logical_mesh((2, 4), bandwidths=[1e9, 0.0]), "bandwidth"),
        (lambda: logical_mesh((2, 4), latencies=[1e-6, -1.0]), "latency"),
        (lambda: logical_mesh((2,), memory_budget=0), "memory_budget"),
        (lambda: logical_mesh((2,), preset="tpu"), "known presets: cpu, v100-p3.16xlarge"),
        (lambda: logical_mesh((2,)).axis("q"), "no axis 'q'"),
        (lambda: LogicalMesh((MeshAxis("x", 2, 0, 1),), 0.0, 1), "device_flops"),
    ],
)
def test_cluster_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- collectives -----------------------------------------------------------------------------

MIB = 2**20


@pytest.fixture
def mesh24() -> LogicalMesh:
    return logical_mesh((2, 4), latencies=[1e-5, 2e-6], bandwidths=[1e9, 1e10])


def test_alpha_beta_formulas(mesh24):
    # one axis: x has n=2, alpha=1e-5, beta=1e9; y has n=4, alpha=2e-6, beta=1e10
    assert all_reduce_cost(mesh24, ("x",), MIB) == pytest.approx(1e-5 + 2 * (1 / 2) * MIB / 1e9)
    assert all_reduce_cost(mesh24, ("y",), MIB) == pytest.approx(2e-6 + 2 * (3 / 4) * MIB / 1e10)
    assert all_gather_cost(mesh24, ("y",), MIB) == pytest.approx(2e-6 + (3 / 4) * MIB / 1e10)
    assert reduce_scatter_cost(mesh24, ("y",), MIB) == pytest.approx(2e-6 + (3 / 4) * MIB / 1e10)
    assert all_to_all_cost(mesh24, ("y",), MIB) == pytest.approx(2e-6 + (3 / 4) * MIB / 1e10)
    # both axes: n=8, the larger latency and the smaller bandwidth
    assert all_reduce_cost(mesh24, ("x", "y"), MIB) == pytest.approx(1e-5 + 2 * (7 / 8) * MIB / 1e9)
    assert all_gather_cost(mesh24, ("y", "x"), MIB) == pytest.approx(1e-5 + (7 / 8) * MIB / 1e9)
    # nothing to communicate over
    assert all_reduce_cost(mesh24, (), MIB) == 0.0
    assert all_reduce_cost(logical_mesh((1, 8)), ("x",), MIB) == 0.0


def test_collective_value(mesh24):
    c = Collective("all-reduce", ("x",), 4 * MIB)
    assert str(c) == "all-reduce(4.0 MiB, x)"
    assert c.cost(mesh24) == all_reduce_cost(mesh24, ("x",), 4 * MIB)
    assert str(Collective("all-to-all", ("x", "y"), 512)) == "all-to-all(512 B, {x,y})"
    assert Collective("all-gather", "y", 8).axes == ("y",)
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"
    with pytest.raises(ValueError, match="unknown collective"):
        Collective("broadcast", ("x",), 1)
    with pytest.raises(ValueError, match="twice"):
        Collective("all-reduce", ("x", "x"), 1)
    with pytest.raises(ValueError, match="no axis"):
        Collective("all-reduce", ("q",), 1).cost(mesh24)


# --- resharding: Table 2 -------------------------------------------------------------------------

N0, N1 = 2, 4
SHAPE = (64, 32)
M = 64 * 32 * 4  # float32 bytes


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        (S(R, R), S("x", "y"), ()),  # 1: slicing only
        (S("x", R), S(R, R), (Collective("all-gather", ("x",), M),)),  # 2
        (S("x", "y"), S("x", R), (Collective("all-gather", ("y",), M // N0),)),  # 3
        (S("x", R), S(R, "x"), (Collective("all-to-all", ("x",), M // N0),)),  # 4
        (S("x", "y"), S(("x", "y"), R), (Collective("all-to-all", ("y",), M // (N0 * N1)),)),  # 5
    ],
)
def test_table_2(src, dst, expected):
    mesh = logical_mesh((N0, N1))
    assert resharding_collectives(SHAPE, 4, src, dst, mesh) == expected
    assert resharding_cost(SHAPE, 4, src, dst, mesh) == pytest.approx(sum(c.cost(mesh) for c in expected))


def test_pending_sums_are_reduced_where_a_reader_needs_them():
    """A layout with pending sums (`ShardingSpec.unreduced`) going to one without: the sums
    done over their axes, of the tiles as they are (all-reduced, or reduce-scattered over an
    axis the target splits), then the tiles change as between reduced layouts. Sums kept pending cost nothing; sums started on a
    value whole along their axes neither (XLA keeps it on one device of each group)."""
    mesh = logical_mesh((N0, N1))
    pend = ShardingSpec(S(R, "y").dims, ("x",))
    assert resharding_collectives(SHAPE, 4, pend, S(R, "y"), mesh) == (Collective("all-reduce", ("x",), M // N1),)
    assert resharding_collectives(SHAPE, 4, pend, S(R, R), mesh) == (
        Collective("all-reduce", ("x",), M // N1),
        Collective("all-gather", ("y",), M),
    )
    assert resharding_cost(SHAPE, 4, pend, S(R, R), mesh) == pytest.approx(
        Collective("all-reduce", ("x",), M // N1).cost(mesh) + Collective("all-gather", ("y",), M).cost(mesh)
    )
    # To a layout split over the pending axis: a reduce-scatter, of the tiles as they are.
    assert resharding_collectives(SHAPE, 4, ShardingSpec(S(R, R).dims, ("x",)), S("x", R), mesh) == (
        Collective("reduce-scatter", ("x",), M),
    )
    # Pending over x and y to pending over x, split along y: y's sums scattered there.
    both = ShardingSpec(S(R, R).dims, ("x", "y"))
    assert resharding_collectives(SHAPE, 4, both, pend, mesh) == (Collective("reduce-scatter", ("y",), M),)
    for src, dst in ((pend, pend), (S(R, "y"), pend), (S(R, R), pend), (S(R, R), both)):
        assert resharding_collectives(SHAPE, 4, src, dst, mesh) == ()
        assert resharding_cost(SHAPE, 4, src, dst, mesh) == 0.0


def test_resharding_cost_is_the_sum_of_its_collectives_costs_to_the_last_bit():
    """`resharding_cost` prices steps from what it reads of the mesh once per layout pair;
    it must give, float for float, the sum of its collectives' `Collective.cost` in order
    (the ILP's ties, and so the plans, depend on the last bit): uneven shapes, axes of size
    1, links of several speeds, pending sums, every layout pair of ranks 1 to 3."""
    meshes = [
        LogicalMesh((MeshAxis("x", a, 1e-5 * (1 + a % 3), 1e11 / (1 + b)), MeshAxis("y", b, 3e-6, 2.4e11)), 3e14, 8e10)
        for a, b in ((1, 2), (2, 4), (4, 2), (3, 16), (2, 1), (5, 8))
    ]
    options = ((), ("x",), ("y",), ("x", "y"), ("y", "x"))
    shapes = {1: ((8,), (7,), (48,)), 2: ((8, 8192), (6, 10), (2048, 64)), 3: ((8, 2048, 96), (3, 5, 7))}
    checked = 0
    for rank, shapes_of_rank in shapes.items():
        layouts = [ShardingSpec(dims) for dims in itertools.product(options, repeat=rank) if _disjoint(dims)]
        layouts += [ShardingSpec(layouts[0].dims, ("x",)), ShardingSpec(layouts[0].dims, ("x", "y"))]
        for mesh, src, dst, shape in itertools.product(meshes, layouts, layouts, shapes_of_rank):
            total = 0.0
            for collective in resharding_collectives(shape, 2, src, dst, mesh):
                total += collective.cost(mesh)
            assert resharding_cost(shape, 2, src, dst, mesh) == total, (mesh, src, dst, shape)
            checked += 1
    assert checked > 5000


def _disjoint(dims) -> bool:
    used = [axis for axes in dims for axis in axes]
    return len(used) == len(set(used))


def test_equal_specs_cost_nothing():
    mesh = logical_mesh((N0, N1))
    for spec in (S(R, R), S("x", "y"), S(("y", "x"), R)):
        assert resharding_collectives(SHAPE, 4, spec, spec, mesh) == ()
        assert resharding_cost(SHAPE, 4, spec, spec, mesh) == 0.0


# --- resharding: N-D meshes and multi-step conversions -------------------------------------------

MESH3 = logical_mesh((2, 2, 2))  # x, y, z
SHAPE3 = (16, 16, 16)
M3 = 16**3 * 4  # f32

# What XLA's SPMD partitioner compiles for each conversion (checked against XLA by
# `test_fidelity.py::test_resharding_model_matches_xla`; here the model alone).
MESH24 = logical_mesh((2, 4))
SHAPE24 = (8, 16, 32)
M24 = 8 * 16 * 32 * 4


def _permute(nbytes, axes=("x", "y")):
    return Collective("collective-permute", axes, nbytes)


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        # axes leaving a dimension's minor end: one all-gather over both, named after the result
        (S(("x", "y", "z"), R, R), S("x", R, R), (Collective("all-gather", ("y", "z"), M3 // 2),)),
        # S^{01} split: a minor axis joins another dimension's split
        (S(("x", "y"), "z", R), S(("x", "y", "z"), R, R), (Collective("all-to-all", ("z",), M3 // 8),)),
        # the same tile counts on other devices: one collective-permute
        (S(("y", "x"), R, R), S(("x", "y"), R, R), (_permute(M3 // 4),)),
        (S("x", "y", R), S("y", "x", R), (_permute(M3 // 4),)),
        # a dimension's split moves across the tensor
        (S("z", R, R), S(R, R, "z"), (Collective("all-to-all", ("z",), M3 // 2),)),
        # the major axis goes, the minor one stays: the tiles are reordered, then gathered
        (S(("x", "y"), R, R), S("y", R, R), (_permute(M3 // 4), Collective("all-gather", ("x",), M3 // 2))),
        # new axes where one moves: sliced out first
        (S("x", R, R), S(R, ("y", "z"), "x"), (Collective("all-to-all", ("x",), M3 // 8),)),
        # new axes on a dimension that keeps its prefix: free
        (S("x", R, R), S(("x", "y"), "z", R), ()),
    ],
)
def test_nd_conversions(src, dst, expected):
    assert resharding_collectives(SHAPE3, 4, src, dst, MESH3) == expected


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        # each dimension gathered on its own, the last one first
        (
            S("x", "y", R),
            S(R, R, R),
            (Collective("all-gather", ("y",), M24 // 2), Collective("all-gather", ("x",), M24)),
        ),
        # finer tiles elsewhere: sliced where they lie, then sent where they belong
        (S("x", R, R), S("y", R, R), (_permute(M24 // 4),)),
        (S(R, "x", R), S(R, "y", "x"), (_permute(M24 // 8),)),
        # an axis moving into a dimension that already has one: appended minor-most, then
        # the devices are reordered when the target wants it major
        (S("x", "y", R), S(R, ("y", "x"), R), (Collective("all-to-all", ("x",), M24 // 8),)),
        (S("x", "y", R), S(R, ("x", "y"), R), (Collective("all-to-all", ("x",), M24 // 8), _permute(M24 // 8))),
        # two dimensions moving: one all-to-all each
        (
            S(R, "x", "y"),
            S("y", R, "x"),
            (Collective("all-to-all", ("x",), M24 // 8), Collective("all-to-all", ("y",), M24 // 8)),
        ),
        # two dimensions swapping their splits: the smaller one's all-to-all, then a reorder
        (S("x", "y", R), S("y", "x", R), (Collective("all-to-all", ("x",), M24 // 8), _permute(M24 // 8))),
        # two dimensions' axes merging into one: XLA gathers everything, then slices
        (
            S(R, "x", "y"),
            S(("x", "y"), R, R),
            (Collective("all-gather", ("y",), M24 // 2), Collective("all-gather", ("x",), M24)),
        ),
        # an axis goes while another is sliced out elsewhere: gathered first
        (S(R, "x", R), S(R, R, "y"), (Collective("all-gather", ("x",), M24),)),
    ],
)
def test_conversions_as_xla_compiles_them(src, dst, expected):
    assert resharding_collectives(SHAPE24, 4, src, dst, MESH24) == expected


def test_size_one_axes_split_nothing():
    mesh = logical_mesh((1, 8))
    assert resharding_collectives((16, 16), 4, S("x", "y"), S(R, "y"), mesh) == ()
    assert resharding_collectives((16, 16), 4, S("x", "y"), S("y", "x"), mesh) == (
        Collective("all-to-all", ("y",), 16 * 16 * 4 // 8),
    )


def test_uneven_shapes_round_up():
    mesh = logical_mesh((2, 4))
    assert per_device_bytes((7, 5), 4, S("x", R), mesh) == 4 * 5 * 4
    assert per_device_bytes((10, 3), 4, S(("x", "y"), R), mesh) == 2 * 3 * 4
    assert per_device_bytes((3, 3), 2, S("y", "x"), mesh) == 1 * 2 * 2
    assert per_device_bytes((), 4, S(), mesh) == 4
    assert resharding_collectives((7, 5), 4, S("x", "y"), S("x", R), mesh) == (
        Collective("all-gather", ("y",), 4 * 5 * 4),
    )
    assert resharding_collectives((7, 5), 4, S("x", R), S(R, "x"), mesh) == (
        Collective("all-to-all", ("x",), 7 * 3 * 4),
    )


def test_resharding_errors():
    mesh = logical_mesh((2, 4))
    with pytest.raises(ValueError, match="rank 1 but the tensor shape"):
        resharding_cost((4, 4), 4, S("x"), S(R, R), mesh)
    with pytest.raises(ValueError, match="no axis 'q'"):
        resharding_cost((4, 4), 4, S("q", R), S(R, R), mesh)
    with pytest.raises(ValueError, match="rank"):
        per_device_bytes((4,), 4, S(R, R), mesh)


def _all_specs(rank: int, axes: tuple[str, ...]):
    """Every spec of a rank-`rank` tensor over `axes`: each axis in some dim or none, any order."""
    specs = set()
    for assignment in itertools.product(range(rank + 1), repeat=len(axes)):
        for order in itertools.permutations(axes):
            dims = tuple(tuple(a for a in order if assignment[axes.index(a)] == d) for d in range(rank))
            specs.add(ShardingSpec(dims))
    return sorted(specs, key=str)


@pytest.mark.parametrize("mesh_shape, shape", [((2, 2, 2), (8, 8)), ((2, 3), (6, 12, 6))])
def test_plans_are_realizable(mesh_shape, shape):
    """For every pair of specs: free exactly when each device already holds its target tile, and
    otherwise each device's target tile lies within what its group over the collectives' axes holds."""
    mesh = logical_mesh(mesh_shape)
    device_mesh = mesh.to_device_mesh()
    specs = _all_specs(len(shape), mesh.axis_names)
    tiles = {spec: all_device_slices(shape, spec, device_mesh) for spec in specs}
    coords = {d: device_mesh.coords(d) for d in range(mesh.size)}

    def covers(boxes, box):
        mask = np.zeros(shape, bool)
        for b in boxes:
            mask[b] = True
        return mask[box].all()

    for src, dst in itertools.product(specs, specs):
        steps = resharding_collectives(shape, 4, src, dst, mesh)
        axes = {a for c in steps for a in c.axes}
        for d in range(mesh.size):
            fixed = [a for a in mesh.axis_names if a not in axes]
            group = [e for e in range(mesh.size) if all(coords[e][a] == coords[d][a] for a in fixed)]
            assert covers([tiles[src][e] for e in group], tiles[dst][d]), (src, dst, steps)
        free = all(covers([tiles[src][d]], tiles[dst][d]) for d in range(mesh.size))
        assert free == (not steps), (src, dst, steps)
        # bytes: never more than the whole tensor, never less than the smaller tile
        smallest = min(per_device_bytes(shape, 4, dst, mesh), per_device_bytes(shape, 4, src, mesh))
        for c in steps:
            assert smallest <= c.nbytes <= math.prod(shape) * 4


def test_cached_calls_are_fast():
    mesh = logical_mesh((2, 4))
    src, dst = S("x", "y", R), S(R, ("x", "y"), R)
    resharding_cost((64, 128, 256), 2, src, dst, mesh)
    start = time.perf_counter()
    for _ in range(100_000):
        resharding_cost((64, 128, 256), 2, src, dst, mesh)
    assert time.perf_counter() - start < 1.0
