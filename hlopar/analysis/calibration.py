"""From timings measured on the cluster at hand to the cost model's numbers (a `ClusterPreset`).

`runtime.calibrate` times what the cost model prices (matrix products with every device busy,
kernel launches, the five collectives over groups of several sizes, in one process and across
processes); this module turns those timings into a preset, with no jax and no devices, so
the fit is checked on its own:

- device FLOP/s: a large product's FLOPs over its time (each device its own product, all at
  once: what a stage sees when all its devices work);
- the matmul ramp (`ClusterPreset.matmul_half_flops`, Hockney's n-half): a small product of
  f FLOPs takes (f + n_half) / peak, so n_half = t * peak - f;
- `kernel_launch_s`: the time one more kernel adds to a chain of dependent tiny kernels;
- `executable_launch_s`: a near-empty executable's time on every device (what each fragment
  run costs beyond its kernels: what a pipeline pays per microbatch and stage);
- `value_launch_s`: what one more argument and result add to an executable's launch (the
  difference between one with many and one with one, over the values added);
- `dispatch_s`, `device_dispatch_s`, `value_dispatch_s`: what the host thread pays per
  launch, fixed, per device spanned and per value: near-empty executables run as the
  runtime runs a fragment, back to back (each run returns before its devices finish, so the
  runs' pace is the host's), on half and on all of the devices (the line through the two)
  and with many values on all of them (the difference over the values added); measured in
  one process, they price the in-process runtime's one thread (not set where collectives
  were timed across processes: Ray workers launch their own); `devices_share_host_cores`
  where the devices are the host's CPU cores;
- `transfer_latency_s`, `transfer_bandwidth`: the cross-mesh transport (a value moved from
  one half of the devices to the other, laid out anew), the line through a small and a large
  value's times;
- `device_memory_bandwidth`: the bytes of results an elementwise kernel writes per second,
  from the difference between a large and a small one (so neither launch counts), every
  device busy: what a memory-bound op costs beyond its FLOPs (`LogicalMesh.compute_seconds`);
- link latency (alpha) and bandwidth (beta) of a class of links: the least-squares fit of
  t = alpha + bytes_sent / beta over every collective timed on those links, with
  `collectives.bytes_sent`'s traffic factors, the model the ILP prices collectives with; so a
  calibrated preset predicts the timings it was fit on as closely as that model can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hlopar.analysis.auto_sharding.cluster import ClusterPreset
from hlopar.analysis.auto_sharding.collectives import bytes_sent

__all__ = ["CollectiveTiming", "LinkFit", "Measurements", "fit_links", "preset_from_measurements"]


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective timed: its kind, group size, per-device buffer (the `Collective`
    convention), seconds per collective, and whether its group spans processes."""

    kind: str
    group: int
    nbytes: int
    seconds: float
    across_processes: bool = False

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "group": self.group,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "across_processes": self.across_processes,
        }


@dataclass(frozen=True)
class LinkFit:
    """t = latency + bytes_sent / bandwidth, fit over `samples` timings; `error`: the median
    relative error of the fit on them."""

    latency_s: float
    bandwidth: float
    samples: int
    error: float


@dataclass(frozen=True)
class Measurements:
    """What `runtime.calibrate` timed on `num_hosts` x `devices_per_host` devices of a kind."""

    device_kind: str
    num_hosts: int
    devices_per_host: int
    device_memory_bytes: float
    large_matmul_flops: float  # per device
    large_matmul_s: float
    small_matmul_flops: float
    small_matmul_s: float  # one product of a dependent chain, the launch left out
    kernel_s: float  # one more kernel of a dependent chain
    launch_s: float  # one executable on every device, doing next to nothing
    collectives: tuple[CollectiveTiming, ...]
    # An elementwise kernel's results per device, small and large, and their seconds (0: not timed)
    elementwise_bytes: tuple[float, float] = (0.0, 0.0)
    elementwise_s: tuple[float, float] = (0.0, 0.0)
    # An executable of 1 and of `many_values` arguments (as many results): its launch's seconds
    many_values: int = 0
    many_values_launch_s: float = 0.0
    # A value moved between two meshes, small and large: its bytes and seconds (0: not timed)
    transfer_bytes: tuple[float, float] = (0.0, 0.0)
    transfer_s: tuple[float, float] = (0.0, 0.0)
    # Near-empty executables run back to back as the runtime runs a fragment, on fewer and on
    # more devices, waited for at the end: the devices each spans and the seconds per run (0:
    # not timed)
    dispatch_devices: tuple[int, int] = (0, 0)
    dispatch_s: tuple[float, float] = (0.0, 0.0)
    many_values_dispatch_s: float = 0.0  # `many_values` values on the more devices

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "collectives"}
        out["collectives"] = [c.as_dict() for c in self.collectives]
        return out


def fit_links(timings: Sequence[CollectiveTiming]) -> LinkFit:
    """alpha and beta of t = alpha + bytes_sent / beta over `timings`: per collective and
    group size, the line through its smallest and its largest buffer; alpha the median of the
    lines' intercepts (kept >= 0), 1/beta the median of their slopes. Medians, not least
    squares: on shared CPUs a few timings are off by several times, and the model is one
    line for five collectives that CPUs do not run alike (the error says how far it is)."""
    if not timings:
        raise ValueError("no collective timings to fit link costs to")
    seconds = np.array([t.seconds for t in timings], dtype=float)
    if (seconds <= 0).any() or not np.isfinite(seconds).all():
        raise ValueError(f"collective timings must be finite and > 0 s, got {sorted(seconds.tolist())}")
    sent = np.array([bytes_sent(t.kind, t.group, t.nbytes) for t in timings], dtype=float)
    lines: dict[tuple, list[int]] = {}
    for k, t in enumerate(timings):
        lines.setdefault((t.kind, t.group, t.across_processes), []).append(k)
    intercepts, slopes = [], []
    for members in lines.values():
        small, large = min(members, key=lambda k: sent[k]), max(members, key=lambda k: sent[k])
        if sent[large] > sent[small] and seconds[large] > seconds[small]:
            slope = (seconds[large] - seconds[small]) / (sent[large] - sent[small])
            slopes.append(slope)
            intercepts.append(seconds[small] - slope * sent[small])
        else:  # one size, or the larger buffer no slower: its time is all start-up
            intercepts.append(seconds[small])
    alpha = max(0.0, float(np.median(intercepts)))
    if slopes:
        inverse = float(np.median(slopes))
    else:  # no size resolved the bandwidth: the slowest rate seen bounds it
        inverse = max(float(np.max(seconds / np.maximum(sent, 1.0))), 1e-15)
    error = float(np.median(np.abs(alpha + sent * inverse - seconds) / seconds))
    return LinkFit(alpha, 1.0 / inverse, len(timings), error)


def preset_from_measurements(m: Measurements, name: str, description: str = "") -> tuple[ClusterPreset, dict]:
    """The preset the measurements give, and the fits (for the report and the file).

    Links: collectives within one process fit the intra-host numbers; those spanning
    processes, the inter-host ones (no such timings: one host, or hosts that share this
    process, as `Cluster.local`'s in-process runtime runs them; the inter-host numbers are
    then the intra-host ones)."""
    peak = m.large_matmul_flops / m.large_matmul_s
    if not (peak > 0 and math.isfinite(peak)):
        raise ValueError(f"matmul timing gives no FLOP/s: {m.large_matmul_flops} FLOPs in {m.large_matmul_s} s")
    half = max(0.0, m.small_matmul_s * peak - m.small_matmul_flops)
    written = m.elementwise_bytes[1] - m.elementwise_bytes[0]
    taken = m.elementwise_s[1] - m.elementwise_s[0]
    # Not resolved (not timed, or the larger kernel no slower): not priced, as in the presets.
    memory_bandwidth = written / taken if written > 0 and taken > 0 else 0.0
    moved, moving = m.transfer_bytes[1] - m.transfer_bytes[0], m.transfer_s[1] - m.transfer_s[0]
    transfer_bandwidth = moved / moving if moved > 0 and moving > 0 else 0.0
    transfer_latency = (
        max(0.0, m.transfer_s[0] - m.transfer_bytes[0] / transfer_bandwidth) if transfer_bandwidth else 0.0
    )
    added = 2 * (m.many_values - 1)  # arguments and results beyond the one executable's
    value_launch = max(0.0, (m.many_values_launch_s - m.launch_s) / added) if added > 0 else 0.0
    intra = fit_links([t for t in m.collectives if not t.across_processes])
    crossing = [t for t in m.collectives if t.across_processes]
    inter = fit_links(crossing) if crossing else intra
    dispatch = device_dispatch = value_dispatch = 0.0
    (few, many), (few_s, many_s) = m.dispatch_devices, m.dispatch_s
    if many_s > 0 and not crossing:
        device_dispatch = max(0.0, (many_s - few_s) / (many - few)) if many > few and few_s > 0 else 0.0
        dispatch = max(0.0, many_s - device_dispatch * many)
        if m.many_values_dispatch_s > 0 and added > 0:
            value_dispatch = max(0.0, (m.many_values_dispatch_s - many_s) / added)
    preset = ClusterPreset(
        name=name,
        intra_host_latency_s=intra.latency_s,
        intra_host_bandwidth=intra.bandwidth,
        inter_host_latency_s=inter.latency_s,
        inter_host_bandwidth=inter.bandwidth,
        device_flops=peak,
        device_memory_bytes=m.device_memory_bytes,
        devices_per_host=m.devices_per_host,
        description=description,
        kernel_launch_s=max(0.0, m.kernel_s),
        matmul_half_flops=half,
        executable_launch_s=m.launch_s,
        device_memory_bandwidth=memory_bandwidth,
        value_launch_s=value_launch,
        transfer_latency_s=transfer_latency,
        transfer_bandwidth=transfer_bandwidth,
        dispatch_s=dispatch,
        device_dispatch_s=device_dispatch,
        value_dispatch_s=value_dispatch,
        devices_share_host_cores=m.device_kind == "cpu" and dispatch + device_dispatch > 0,
    )
    fits = {
        "intra_host": vars(intra),
        "inter_host": vars(inter) if crossing else None,
        "device_flops": peak,
        "matmul_half_flops": half,
        "device_memory_bandwidth": memory_bandwidth,
    }
    return preset, fits
