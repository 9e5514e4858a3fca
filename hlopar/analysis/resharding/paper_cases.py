"""The microbenchmarks of the cross-mesh resharding paper (§5.1), as data.

Table 2's nine multi-device cases (tensor 1024×1024×512; case 6 uses 3072×1024×170 so that
both a (2,4) and a (3,4) mesh divide it) and §5.1.1's one-device-to-many cases (1 GB, fully
replicated on both sides). Elements are 2 bytes (fp16), so the tensor is the 1 GiB message
of §5.1.1. Meshes are laid out as in Alpa: a (n, m) mesh takes m devices on each of n hosts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.resharding.host_model import HostModel, place_meshes
from hlopar.analysis.resharding.unit_tasks import MeshLayout
from hlopar.analysis.sharding import ShardingSpec

__all__ = ["PaperCase", "paper_cases", "parse_paper_spec"]

AXES = ("x", "y")
SHAPE = (1024, 1024, 512)
DTYPE_BYTES = 2


def parse_paper_spec(text: str) -> ShardingSpec:
    """`S0RR`, `RS01R`, `RRS0` (mesh axes by number: 0 is x, 1 is y) as a spec."""
    parts = re.findall(r"S\d+|R", text)
    if "".join(parts) != text:
        raise ValueError(f"invalid sharding spec {text!r} in the papers' notation")
    return ShardingSpec(tuple(() if p == "R" else tuple(AXES[int(d)] for d in p[1:]) for p in parts))


@dataclass(frozen=True)
class PaperCase:
    name: str
    src_mesh: tuple[int, int]
    dst_mesh: tuple[int, int]
    src_spec: str
    dst_spec: str
    shape: tuple[int, ...] = SHAPE
    dtype_bytes: int = DTYPE_BYTES

    def layouts(self, model: HostModel) -> tuple[MeshLayout, MeshLayout]:
        src_devices, dst_devices = place_meshes(model, [self.src_mesh, self.dst_mesh])
        return (
            MeshLayout(DeviceMesh.of(self.src_mesh, AXES), parse_paper_spec(self.src_spec), src_devices),
            MeshLayout(DeviceMesh.of(self.dst_mesh, AXES), parse_paper_spec(self.dst_spec), dst_devices),
        )


TABLE_2 = (
    PaperCase("case1", (2, 4), (2, 4), "S0RR", "S0RR"),
    PaperCase("case2", (2, 4), (2, 4), "RRR", "S0RR"),
    PaperCase("case3", (2, 4), (2, 4), "RS0R", "S0RR"),
    PaperCase("case4", (2, 4), (2, 4), "RS01R", "S01RR"),
    PaperCase("case5", (2, 4), (2, 4), "S1RR", "S0RR"),
    PaperCase("case6", (2, 4), (3, 4), "S0RR", "S0RR", shape=(3072, 1024, 170)),
    PaperCase("case7", (1, 4), (2, 4), "S1RR", "RRR"),
    PaperCase("case8", (2, 3), (3, 2), "RRR", "RRR"),
    PaperCase("case9", (2, 4), (2, 4), "RS0R", "RRS0"),
)

# One host of 2 devices ("1to1x2") belongs to both families: listed once.
ONE_TO_MANY = tuple(PaperCase(f"1to1x{n}", (1, 1), (1, n), "RRR", "RRR") for n in range(1, 5)) + tuple(
    PaperCase(f"1to{n}x2", (1, 1), (n, 2), "RRR", "RRR") for n in range(2, 5)
)


def paper_cases() -> tuple[PaperCase, ...]:
    """Table 2's cases, then §5.1.1's (to 1–4 devices of one host, to 1–4 hosts of 2), each
    once."""
    return TABLE_2 + ONE_TO_MANY
