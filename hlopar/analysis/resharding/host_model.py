"""The cluster model of §3 of the cross-mesh resharding paper.

Hosts are fully connected; each host has one NIC, full duplex, whose bandwidth every
device of the host shares (the bottleneck of cross-host traffic); devices of one host talk
over much faster links (NVLink). A transfer from device a to device b costs a latency plus
bytes over the bandwidth of the link kind between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostModel", "PRESETS", "host_model_for", "paper_cluster", "place_meshes"]

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class HostModel:
    """Hosts of `devices_per_host` devices each; physical device d lives on host d // devices_per_host.

    Bandwidths are bytes per second in each direction (full duplex): `inter_host_bandwidth`
    per host NIC, `intra_host_bandwidth` per device-to-device link inside a host.
    """

    devices_per_host: int = 4
    inter_host_bandwidth: float = 10 * GBPS
    intra_host_bandwidth: float = 25e9
    inter_host_latency: float = 50e-6
    intra_host_latency: float = 5e-6

    def __post_init__(self) -> None:
        if self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be positive, got {self.devices_per_host}")
        for name in ("inter_host_bandwidth", "intra_host_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("inter_host_latency", "intra_host_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(latency, bandwidth) of a transfer from device a to device b."""
        if self.same_host(a, b):
            return self.intra_host_latency, self.intra_host_bandwidth
        return self.inter_host_latency, self.inter_host_bandwidth

    def hop_time(self, a: int, b: int, nbytes: float) -> float:
        latency, bandwidth = self.link(a, b)
        return latency + nbytes / bandwidth


def paper_cluster() -> HostModel:
    """The paper's testbed (§5): p3.8xlarge nodes, 4 V100 over NVLink, 10 Gbps between nodes."""
    return HostModel(
        devices_per_host=4,
        inter_host_bandwidth=10 * GBPS,
        intra_host_bandwidth=25e9,
        inter_host_latency=50e-6,
        intra_host_latency=5e-6,
    )


PRESETS = {
    "paper": paper_cluster(),
    # A common modern node: 8 GPUs over NVLink, 100 Gbps per node.
    "8gpu-100g": HostModel(
        devices_per_host=8,
        inter_host_bandwidth=100 * GBPS,
        intra_host_bandwidth=150e9,
        inter_host_latency=10e-6,
        intra_host_latency=3e-6,
    ),
}


def host_model_for(name: str) -> HostModel:
    """The host model of a preset: one of `PRESETS`, or a cluster preset of the cost model
    (`auto_sharding.cluster.cluster_preset`: a built-in one or a preset file, which stage
    construction plans with), so that
    transfers are planned and priced on the cluster the stages were planned for. Those
    presets give bandwidth per device with every device of a host busy: the NIC of a host
    carries that times its devices."""
    if name in PRESETS:
        return PRESETS[name]
    from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, cluster_preset, is_preset_file

    if name not in CLUSTER_PRESETS and not is_preset_file(name):
        known = ", ".join([*PRESETS, *CLUSTER_PRESETS])
        raise ValueError(f"unknown cluster preset {name!r}; known presets: {known}, or a preset file (.json)")
    preset = cluster_preset(name)
    return HostModel(
        devices_per_host=preset.devices_per_host,
        inter_host_bandwidth=preset.inter_host_bandwidth * preset.devices_per_host,
        intra_host_bandwidth=preset.intra_host_bandwidth,
        inter_host_latency=preset.inter_host_latency_s,
        intra_host_latency=preset.intra_host_latency_s,
    )


def place_meshes(model: HostModel, shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Physical device ids for meshes laid out as Alpa does: a mesh (n, m, ...) takes n fresh
    hosts, one per index of its first axis, and the first m·... devices of each.

    Meshes are placed one after the other, never sharing a host. A mesh whose rows do not
    fit on a host is spread over consecutive hosts, row after row.
    """
    placed: list[tuple[int, ...]] = []
    next_host = 0
    per_host = model.devices_per_host
    for shape in shapes:
        shape = tuple(shape) or (1,)
        rows = shape[0]
        row = 1
        for size in shape[1:]:
            row *= size
        devices: list[int] = []
        if row <= per_host:
            for r in range(rows):
                base = (next_host + r) * per_host
                devices += range(base, base + row)
            next_host += rows
        else:
            total = rows * row
            base = next_host * per_host
            devices = list(range(base, base + total))
            next_host += -(-total // per_host)
        placed.append(tuple(devices))
    return placed
