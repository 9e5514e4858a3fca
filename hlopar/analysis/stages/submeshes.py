"""Submesh shapes, their logical meshes and device assignment (Alpa §5.2, App. A).

The stage DP only asks that submesh sizes sum to the cluster's N·M devices; these shapes make
that enough: any multiset of them with that sum tiles the N×M cluster (Appendix A), and
`assign_devices` builds the tiling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Submesh", "assign_devices", "logical_mesh_shapes", "submesh_shapes"]


@dataclass(frozen=True)
class Submesh:
    """`hosts` × `devices` (devices per host used): (1, m) lies in one host, (n, M) takes whole hosts."""

    hosts: int
    devices: int

    @property
    def size(self) -> int:
        return self.hosts * self.devices


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    for name, value in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[Submesh, ...]:
    """§5.2's shapes, smallest first: (1, 1), (1, 2), (1, 4), ..., (1, M), then (2, M)..(N, M).

    The paper assumes M = 2^m. For other M the 1-D shapes are the powers of two that divide M,
    plus (1, M): with (1, 4) on hosts of 6, three of them fill 12 devices yet cannot tile two
    hosts, while powers of two dividing M keep Appendix A's pairing argument (they pair up to
    the largest such 2^v, whose blocks tile a host)."""
    _check_cluster(num_hosts, devices_per_host)
    one_d = []
    width = 1
    while width < devices_per_host and devices_per_host % width == 0:
        one_d.append(Submesh(1, width))
        width *= 2
    one_d.append(Submesh(1, devices_per_host))
    return tuple(one_d) + tuple(Submesh(n, devices_per_host) for n in range(2, num_hosts + 1))


def logical_mesh_shapes(submesh: Submesh) -> tuple[tuple[int, int], ...]:
    """Every 2-D logical mesh (n_l, m_l) with n_l·m_l = size (§5.2 enumerates them all), by
    increasing n_l: (1, size) first, (size, 1) last."""
    size = submesh.size
    if size < 1:
        raise ValueError(f"submesh {submesh} has no devices")
    return tuple((n, size // n) for n in range(1, size + 1) if size % n == 0)


def assign_devices(
    stage_submeshes: Sequence[Submesh], num_hosts: int, devices_per_host: int
) -> tuple[tuple[int, ...], ...]:
    """Physical device ids per stage (device d sits on host d // devices_per_host), ascending
    and contiguous, tiling the cluster exactly (Appendix A).

    Larger submeshes are placed first, at the lowest ids: whole-host ones take consecutive
    hosts, then 1-D ones in decreasing size, each at the next free offset. As every 1-D size
    divides all larger ones (powers of two dividing M), that offset is aligned to the size and
    the block never straddles a host (the pairing argument of Appendix A). Stages of equal
    size keep their pipeline order, so neighbouring stages get neighbouring devices."""
    _check_cluster(num_hosts, devices_per_host)
    for index, submesh in enumerate(stage_submeshes):
        whole_hosts = submesh.devices == devices_per_host and submesh.hosts >= 1
        if not (whole_hosts or (submesh.hosts == 1 and 1 <= submesh.devices < devices_per_host)):
            raise ValueError(
                f"stage {index}: submesh {submesh.hosts}x{submesh.devices} is neither (1, m <= "
                f"{devices_per_host}) nor (n, {devices_per_host})"
            )
    total = sum(submesh.size for submesh in stage_submeshes)
    if total != num_hosts * devices_per_host:
        raise ValueError(
            f"submeshes hold {total} devices, the cluster {num_hosts}x{devices_per_host} has "
            f"{num_hosts * devices_per_host}: they must tile it exactly"
        )
    order = sorted(
        range(len(stage_submeshes)),
        key=lambda n: (stage_submeshes[n].devices != devices_per_host, -stage_submeshes[n].size, n),
    )
    devices: dict[int, tuple[int, ...]] = {}
    offset = 0
    for n in order:
        submesh = stage_submeshes[n]
        first, last = offset, offset + submesh.size - 1
        if submesh.hosts == 1 and submesh.devices < devices_per_host:
            if first // devices_per_host != last // devices_per_host:
                raise ValueError(
                    f"stage {n}: a 1x{submesh.devices} submesh cannot be placed at device {first} "
                    f"without straddling hosts of {devices_per_host}; 1-D sizes must be powers of two "
                    f"dividing {devices_per_host} (see submesh_shapes)"
                )
        devices[n] = tuple(range(first, last + 1))
        offset = last + 1
    return tuple(devices[n] for n in range(len(stage_submeshes)))
