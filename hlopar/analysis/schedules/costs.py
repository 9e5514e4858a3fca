"""What instructions cost in the simulator: compute time per stage, transfer time per SEND.

A communication model gives a transfer's duration and the shared links it occupies. Each mesh
sends in its stream's order; a link (a receiving mesh's inbound side, or a host's NIC in one
direction) carries one transfer at a time, first come first served. Transfers are full duplex,
as the cross-mesh paper's §3 assumes: a mesh sends and receives at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hlopar.analysis.schedules.tasks import BACKWARD, FORWARD, WEIGHT

__all__ = [
    "StageCost",
    "CommModel",
    "AlphaBeta",
    "HostComm",
    "FunctionComm",
    "HostThread",
    "ZERO_COST",
    "signal",
    "as_comm_model",
]

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class StageCost:
    """Seconds per microbatch of one stage's executables.

    `backward` is the whole backward; when a schedule splits it, W takes `weight_fraction`
    of it and B the rest. A planned program gives the fraction from the FLOPs of its W and B
    fragments (`codegen.bundle.stage_costs`); the default 0.5 is a transformer layer's (both
    halves cost about a forward each).
    """

    forward: float
    backward: float
    weight_fraction: float = 0.5
    accumulate: float = 0.0
    update: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward, self.backward, self.accumulate, self.update) < 0:
            raise ValueError(f"negative duration in {self}")
        if not 0 <= self.weight_fraction <= 1:
            raise ValueError(f"weight_fraction must be in [0, 1], got {self.weight_fraction}")

    def run_time(self, kind: str, split_backward: bool) -> float:
        if kind == FORWARD:
            return self.forward
        if kind == BACKWARD:
            return self.backward * (1 - self.weight_fraction) if split_backward else self.backward
        if kind == WEIGHT:
            return self.backward * self.weight_fraction
        raise ValueError(f"unknown task kind {kind!r}")


@dataclass(frozen=True)
class HostThread:
    """One host thread that plays every mesh (the in-process runtime): it launches each
    fragment run in turn, `launch[stage]` seconds for that stage's forward, backward and update
    runs (`(forward, backward, update)`; a W run pays the backward's), and makes every
    transfer itself (a copy through host memory: the SEND's duration). So a step takes at
    least the sum of its launches and transfers, whatever the meshes overlap. With
    `share` (mesh -> its fraction of the devices of the process), the devices compute on the
    cores the host thread runs on (CPU devices): a stage's time is priced with every device
    busy, so a mesh's run takes the machine that time times its share, and host work and
    device work add up: the step takes at least both summed. `counted[stage]`: the launch
    seconds a microbatch's forward and backward times already hold (a stage's latency prices
    its launches: the host thread's work, not the devices'), left out of the devices' work."""

    launch: Mapping[int, tuple[float, float, float]]
    share: Mapping[str, float] | None = None
    counted: Mapping[int, tuple[float, float]] = field(default_factory=dict)


class CommModel(Protocol):
    def time(self, src: str, dst: str, nbytes: int) -> float:
        """Seconds to move nbytes from mesh src to mesh dst."""

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        """Shared links the transfer occupies for its whole duration."""


@dataclass(frozen=True)
class AlphaBeta:
    """latency + bytes / bandwidth; the receiving mesh takes one transfer at a time."""

    latency: float = 50e-6
    bandwidth: float = 10 * GBPS

    def time(self, src: str, dst: str, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        return (f"{dst}/in",)


ZERO_COST = AlphaBeta(latency=0.0, bandwidth=math.inf)


@dataclass(frozen=True)
class HostComm:
    """Meshes on hosts: across hosts, `inter` and the two hosts' NICs (one direction each);
    inside a host, `intra` and the receiving mesh."""

    host_of: Mapping[str, int]
    inter: AlphaBeta = AlphaBeta(50e-6, 10 * GBPS)
    intra: AlphaBeta = AlphaBeta(5e-6, 25e9)

    def time(self, src: str, dst: str, nbytes: int) -> float:
        link = self.intra if self.host_of[src] == self.host_of[dst] else self.inter
        return link.time(src, dst, nbytes)

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        hs, hd = self.host_of[src], self.host_of[dst]
        return (f"{dst}/in",) if hs == hd else (f"host{hs}/out", f"host{hd}/in")


@dataclass(frozen=True)
class FunctionComm:
    """A plain `f(src_mesh, dst_mesh, nbytes) -> seconds`, the receiving mesh as its link."""

    fn: Callable[[str, str, int], float]

    def time(self, src: str, dst: str, nbytes: int) -> float:
        return self.fn(src, dst, nbytes)

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        return (f"{dst}/in",)


@dataclass(frozen=True)
class _Signal:
    base: CommModel

    def time(self, src: str, dst: str, nbytes: int) -> float:
        return self.base.time(src, dst, 1)

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        return self.base.links(src, dst)


def signal(comm: CommModel) -> CommModel:
    """The 'signal send/recv' bound of the cross-mesh paper (§4): every transfer moves one byte."""
    return _Signal(as_comm_model(comm))


def as_comm_model(comm: CommModel | Callable[[str, str, int], float] | None) -> CommModel:
    if comm is None:
        return AlphaBeta()
    if hasattr(comm, "time") and hasattr(comm, "links"):
        return comm
    if callable(comm):
        return FunctionComm(comm)
    raise TypeError(f"not a communication model: {comm!r}")
