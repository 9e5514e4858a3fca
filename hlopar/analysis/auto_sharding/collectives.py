"""Alpha-beta costs of the four collectives SPMD partitioning produces (Alpa §4.2).

Alpa estimates communication as bytes moved over the mesh axis' bandwidth. With `n` devices
in a group, a per-collective start-up latency alpha and a per-device one-way bandwidth beta,
the bandwidth-optimal algorithms move, per device (Thakur, Rabenseifner & Gropp, "Optimization
of Collective Communication Operations in MPICH", IJHPCA 2005; the factors are those of
NVIDIA nccl-tests `doc/PERFORMANCE.md`, which turns algorithm bandwidth into bus bandwidth):

- all-reduce of an m-byte buffer (ring: reduce-scatter then all-gather): 2(n-1)/n · m
- all-gather to an m-byte result, reduce-scatter of an m-byte input: (n-1)/n · m
- all-to-all of an m-byte buffer (each device keeps 1/n, sends the rest): (n-1)/n · m
- collective-permute of an m-byte buffer (each device sends it to one other device): m

so `cost = alpha + bytes_moved / beta`. A collective over several axes runs on groups of
`prod(sizes)` devices and is as slow as its slowest axis (largest alpha, smallest beta).
Alpha is counted once per collective rather than per ring step: NCCL pipelines small
messages, and the planner only needs latency to discourage many tiny collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hlopar.analysis.auto_sharding.cluster import LogicalMesh
from hlopar.units import format_bytes

__all__ = [
    "Collective",
    "CollectiveKind",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "bytes_sent",
    "collective_cost",
    "collective_permute_cost",
    "reduce_scatter_cost",
]

CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]

# Bytes each device sends per byte of `nbytes`, as a function of the group size.
_TRAFFIC = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def bytes_sent(kind: CollectiveKind, group: int, nbytes: float) -> float:
    """Bytes each device of a `group`-device collective sends for an `nbytes` buffer (the
    traffic factor above times `nbytes`): what one over the bandwidth multiplies."""
    try:
        return _TRAFFIC[kind](group) * nbytes
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(_TRAFFIC)}") from None


@dataclass(frozen=True)
class Collective:
    """One collective over the groups of mesh `axes`, named after a per-device buffer size.

    `nbytes` is: the buffer reduced (all-reduce); the per-device result, after gathering
    (all-gather); the per-device input, before scattering (reduce-scatter); the per-device
    buffer exchanged (all-to-all) or sent (collective-permute, whose `axes` are those along
    which devices trade data). That is the paper's `all-gather(M, 0)` notation.
    """

    kind: CollectiveKind
    axes: tuple[str, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in _TRAFFIC:
            raise ValueError(f"unknown collective {self.kind!r}; expected one of {', '.join(_TRAFFIC)}")
        axes = (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{self.kind} names a mesh axis twice: {axes}")
        if self.nbytes < 0:
            raise ValueError(f"{self.kind} of a negative size {self.nbytes}")
        object.__setattr__(self, "axes", axes)

    def cost(self, mesh: LogicalMesh) -> float:
        """Seconds this collective takes on `mesh` (see the module docstring)."""
        return collective_cost(self.kind, mesh, self.axes, self.nbytes)

    def __str__(self) -> str:
        axes = self.axes[0] if len(self.axes) == 1 else "{" + ",".join(self.axes) + "}"
        return f"{self.kind}({format_bytes(self.nbytes)}, {axes})"


def collective_cost(kind: CollectiveKind, mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """alpha + traffic(n) · nbytes / beta over the groups of `axes`; 0 when the group is one device."""
    try:
        traffic = _TRAFFIC[kind]
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(_TRAFFIC)}") from None
    links = [mesh.axis(name) for name in axes]
    n = 1
    for link in links:
        n *= link.size
    if n == 1:
        return 0.0
    alpha = max(link.latency_s for link in links)
    beta = min(link.bandwidth_bytes_per_s for link in links)
    return alpha + traffic(n) * nbytes / beta


def all_reduce_cost(mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """Ring all-reduce of an `nbytes` buffer: alpha + 2(n-1)/n · nbytes / beta."""
    return collective_cost("all-reduce", mesh, axes, nbytes)


def all_gather_cost(mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """All-gather to an `nbytes` per-device result: alpha + (n-1)/n · nbytes / beta."""
    return collective_cost("all-gather", mesh, axes, nbytes)


def reduce_scatter_cost(mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """Reduce-scatter of an `nbytes` per-device input: alpha + (n-1)/n · nbytes / beta."""
    return collective_cost("reduce-scatter", mesh, axes, nbytes)


def all_to_all_cost(mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """All-to-all of an `nbytes` per-device buffer: alpha + (n-1)/n · nbytes / beta."""
    return collective_cost("all-to-all", mesh, axes, nbytes)


def collective_permute_cost(mesh: LogicalMesh, axes: Sequence[str], nbytes: float) -> float:
    """Collective-permute of an `nbytes` per-device buffer: alpha + nbytes / beta."""
    return collective_cost("collective-permute", mesh, axes, nbytes)
