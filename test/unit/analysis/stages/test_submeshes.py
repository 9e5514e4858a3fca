"""Submesh shapes (§5.2), logical meshes and device tiling (Appendix A)."""

from __future__ import annotations

import random

import pytest

from hlopar.analysis.stages.submeshes import (
    Submesh,
    assign_devices,
    logical_mesh_shapes,
    submesh_shapes,
)


def test_shapes_of_power_of_two_hosts():
    shapes = submesh_shapes(8, 8)
    assert [(s.hosts, s.devices) for s in shapes] == [(1, 1), (1, 2), (1, 4), (1, 8)] + [(n, 8) for n in range(2, 9)]
    assert [s.size for s in shapes] == [1, 2, 4] + [8 * n for n in range(1, 9)]
    assert submesh_shapes(1, 1) == (Submesh(1, 1),)
    assert submesh_shapes(3, 1) == (Submesh(1, 1), Submesh(2, 1), Submesh(3, 1))
    assert submesh_shapes(1, 4) == (Submesh(1, 1), Submesh(1, 2), Submesh(1, 4))


def test_shapes_of_other_hosts_keep_only_dividing_powers_of_two():
    assert submesh_shapes(2, 6) == (Submesh(1, 1), Submesh(1, 2), Submesh(1, 6), Submesh(2, 6))
    assert submesh_shapes(1, 12) == (Submesh(1, 1), Submesh(1, 2), Submesh(1, 4), Submesh(1, 12))
    assert submesh_shapes(1, 3) == (Submesh(1, 1), Submesh(1, 3))


@pytest.mark.parametrize("hosts, devices", [(0, 8), (2, 0), (-1, 1), (1.5, 2), (True, 2)])
def test_shapes_reject_bad_clusters(hosts, devices):
    with pytest.raises(ValueError, match="positive integer"):
        submesh_shapes(hosts, devices)


def test_logical_mesh_shapes():
    assert logical_mesh_shapes(Submesh(2, 8)) == ((1, 16), (2, 8), (4, 4), (8, 2), (16, 1))
    assert logical_mesh_shapes(Submesh(1, 1)) == ((1, 1),)
    assert logical_mesh_shapes(Submesh(1, 6)) == ((1, 6), (2, 3), (3, 2), (6, 1))
    for shape in submesh_shapes(4, 8):
        assert all(n * m == shape.size for n, m in logical_mesh_shapes(shape))


def _random_multiset(rng: random.Random, hosts: int, per_host: int) -> list[Submesh]:
    shapes = submesh_shapes(hosts, per_host)
    left, out = hosts * per_host, []
    while left:
        shape = rng.choice([s for s in shapes if s.size <= left])
        out.append(shape)
        left -= shape.size
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(300))
def test_any_multiset_with_the_right_sum_tiles_the_cluster(seed):
    """Appendix A's theorem, checked constructively: the assignment covers each device once,
    1-D submeshes stay inside a host, 2-D ones take whole hosts, ids ascending and contiguous."""
    rng = random.Random(seed)
    hosts = rng.randint(1, 6)
    per_host = rng.choice([1, 2, 4, 8, 16, 6, 12, 3])
    stages = _random_multiset(rng, hosts, per_host)
    devices = assign_devices(stages, hosts, per_host)
    assert len(devices) == len(stages)
    assert sorted(d for ids in devices for d in ids) == list(range(hosts * per_host))
    for submesh, ids in zip(stages, devices):
        assert len(ids) == submesh.size
        assert list(ids) == list(range(ids[0], ids[0] + len(ids)))
        if submesh.devices == per_host:
            assert ids[0] % per_host == 0
        else:
            assert ids[0] // per_host == ids[-1] // per_host


def test_larger_first_and_neighbouring_stages_adjacent():
    stages = [Submesh(1, 2), Submesh(1, 4), Submesh(1, 2), Submesh(2, 8), Submesh(1, 8)]
    devices = assign_devices(stages, 4, 8)
    assert devices[3] == tuple(range(0, 16))
    assert devices[4] == tuple(range(16, 24))
    assert devices[1] == tuple(range(24, 28))
    assert devices[0] == (28, 29)
    assert devices[2] == (30, 31)
    # a chain of equal stages runs along the devices in pipeline order
    assert assign_devices([Submesh(1, 2)] * 4, 1, 8) == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_assign_devices_errors():
    with pytest.raises(ValueError, match="tile it exactly"):
        assign_devices([Submesh(1, 4), Submesh(1, 2)], 1, 8)
    with pytest.raises(ValueError, match="neither"):
        assign_devices([Submesh(2, 4)], 1, 8)
    with pytest.raises(ValueError, match="neither"):
        assign_devices([Submesh(1, 16)], 2, 8)
    with pytest.raises(ValueError, match="straddling"):  # not a §5.2 shape: 4 does not divide 6
        assign_devices([Submesh(1, 4)] * 3, 2, 6)
