"""The cluster as the intra-op planner sees it: a logical mesh with per-axis link costs.

Alpa (§4.1) views a set of devices as an N-D *logical mesh* whose axes may have different
bandwidths: on 2 hosts × 8 GPUs the 2×8 view has a slow inter-host axis and a fast NVLink
axis, while the 4×4 view has one axis that crosses hosts. The cost model (`collectives`) reads
only what is here: per axis its size, latency (alpha) and bandwidth (beta), plus per device
its peak FLOP/s and memory. Everything is a frozen value, passed in; no global config.

Bandwidths are *per device, one direction*: the bytes per second one device can send while
it also receives as much, when every device of the mesh communicates at once (the SPMD
case). That is the rate NCCL's "bus bandwidth" is compared with, and what the ring formulas
of `collectives` divide by.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hlopar.analysis.hashing import cached_hash, state_without_hash
from hlopar.analysis.limits import check_mesh_shape
from hlopar.analysis.mesh import DeviceMesh

__all__ = [
    "CLUSTER_PRESETS",
    "ClusterPreset",
    "LogicalMesh",
    "MeshAxis",
    "cluster_preset",
    "logical_mesh",
    "preset_fingerprint",
    "write_preset",
]

_GIB = 2**30
_GBIT = 1e9 / 8  # bytes per second in one Gbit/s
_DEFAULT_NAMES = ("x", "y", "z", "w")


@dataclass(frozen=True)
class MeshAxis:
    """One axis of a logical mesh: its size and the alpha-beta cost of its links."""

    name: str
    size: int
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"mesh axis names are non-empty strings, got {self.name!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, (int, np.integer)) or self.size < 1:
            raise ValueError(f"mesh axis {self.name!r} must have a positive integer size, got {self.size!r}")
        if not self.latency_s >= 0 or math.isinf(self.latency_s):
            raise ValueError(f"mesh axis {self.name!r} needs a finite latency >= 0 s, got {self.latency_s!r}")
        if not self.bandwidth_bytes_per_s > 0 or math.isinf(self.bandwidth_bytes_per_s):
            raise ValueError(
                f"mesh axis {self.name!r} needs a finite bandwidth > 0 B/s, got {self.bandwidth_bytes_per_s!r}"
            )
        object.__setattr__(self, "size", int(self.size))
        object.__setattr__(self, "latency_s", float(self.latency_s))
        object.__setattr__(self, "bandwidth_bytes_per_s", float(self.bandwidth_bytes_per_s))

    __hash__ = cached_hash
    __getstate__ = state_without_hash


@dataclass(frozen=True)
class LogicalMesh:
    """Mesh axes (major first) plus what every device of the mesh has: peak FLOP/s, memory,
    and the rate it writes results of memory-bound ops (`device_memory_bandwidth`, bytes per
    second with every device busy; 0: not priced, an op costs its FLOPs only).

    Devices are homogeneous within a mesh (Alpa §4, SPMD). Hashable, so it can key caches.
    """

    axes: tuple[MeshAxis, ...]
    device_flops: float
    device_memory_bytes: float
    device_memory_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        axes = tuple(self.axes)
        for axis in axes:
            if not isinstance(axis, MeshAxis):
                raise ValueError(f"LogicalMesh axes are MeshAxis values, got {axis!r}")
        names = [axis.name for axis in axes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate mesh axis names: {duplicates}")
        if not self.device_flops > 0 or math.isinf(self.device_flops):
            raise ValueError(f"device_flops must be finite and > 0, got {self.device_flops!r}")
        if not self.device_memory_bytes > 0:
            raise ValueError(f"device_memory_bytes must be > 0, got {self.device_memory_bytes!r}")
        if not self.device_memory_bandwidth >= 0 or math.isinf(self.device_memory_bandwidth):
            raise ValueError(f"device_memory_bandwidth must be finite and >= 0, got {self.device_memory_bandwidth!r}")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "_by_name", {axis.name: axis for axis in axes})

    # Meshes key the cost model's caches: hashed once, axes looked up by name in a dict.
    __hash__ = cached_hash
    __getstate__ = state_without_hash

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(axis.size for axis in self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(axis.name for axis in self.axes)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.shape)

    def axis(self, name: str) -> MeshAxis:
        found = self._by_name.get(name)
        if found is None:
            raise ValueError(f"mesh {self.axis_names} has no axis {name!r}")
        return found

    def compute_seconds(self, flops: float, written_bytes: float) -> float:
        """One device's time for an op: its FLOPs at the peak, plus, where the memory
        bandwidth is known, the bytes of results it writes at that rate (a roofline, added:
        an elementwise op on a CPU or a GPU is bound by memory, not arithmetic)."""
        seconds = flops / self.device_flops
        if self.device_memory_bandwidth:
            seconds += written_bytes / self.device_memory_bandwidth
        return seconds

    def axes_size(self, names: Iterable[str]) -> int:
        """How many pieces splitting over all of `names` makes (1 for none)."""
        return math.prod(self.axis(name).size for name in names)

    def to_device_mesh(self) -> DeviceMesh:
        """The same axes as a `DeviceMesh` on devices 0..n-1 in row-major order."""
        return DeviceMesh(tuple((axis.name, axis.size) for axis in self.axes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a.name}={a.size}" for a in self.axes) + "]"


@dataclass(frozen=True)
class ClusterPreset:
    """Link and device numbers of a kind of node, from vendor specs (see `CLUSTER_PRESETS`).

    Bandwidths follow the module's convention (per device, one direction, all devices busy);
    latencies are the order of magnitude of one small collective's start-up time.

    What makes small microbatches slow beyond communication start-ups, for the stage
    latencies of `hlopar-stage-construction` (`op_seconds`): `kernel_launch_s`, the time
    paid per kernel a device runs whatever its size, and `matmul_half_flops`, the FLOPs per
    device at which a matrix product reaches half the peak (Hockney's n-half: a product of f
    FLOPs runs at peak * f / (f + n-half), so it takes its FLOPs at peak plus n-half / peak).
    Both are assumptions, orders of magnitude (see `CLUSTER_PRESETS`), not measurements.
    `executable_launch_s`: what launching one executable (a stage's fragment) costs beyond its
    kernels, paid per fragment run (a stage's forward and backward per microbatch, its update
    per step): 0 in the built-in presets; `hlopar-calibrate` measures it (on 8 CPU devices of
    a 2-core machine, 0.2-0.6 ms).
    `value_launch_s`: what a fragment run pays per value it reads or writes beyond its launch
    (the runtime hands each argument's and result's buffers to the executable one by one: on
    4 CPU devices ~8 us a value through `jax.jit`'s dispatch, 20 through PJRT's
    `execute_sharded`); 0 in the built-in presets, `hlopar-calibrate` measures it.
    `transfer_latency_s`, `transfer_bandwidth`: the runtime's cross-mesh transport as
    `hlopar-calibrate` times it (a value copied from one mesh's devices to another's, laid out
    anew: in process on CPU devices through host memory), its cost per value moved and bytes
    per second; stage construction charges a stage the first per value it receives per
    microbatch and moves its bytes at the second. 0 (the built-in presets): the links'
    alpha-beta, one start-up per stage's inputs.
    `device_memory_bandwidth`: the bytes of results per second a device writes in a
    memory-bound (elementwise) kernel with every device busy, which `LogicalMesh.compute_seconds`
    adds to an op's FLOPs; 0 (the built-in presets): not priced. `hlopar-calibrate` measures
    it (8 CPU devices sharing 2 cores: ~1 GB/s each, where the tiny GPT's step writes 13 MB of
    results on one device and its FLOPs at the peak take a tenth of its time).
    `dispatch_s`, `device_dispatch_s`, `value_dispatch_s`: what the in-process runtime's one
    host thread, which plays every mesh of a plan, spends launching a fragment run
    (`dispatch_s`, plus `device_dispatch_s` per device the fragment spans, plus
    `value_dispatch_s` per value it reads or writes), one run after the other whichever mesh
    it is for; it also makes every cross-mesh copy. The
    simulator prices a step at least that thread's work (`schedules.HostThread`). With
    `devices_share_host_cores` (CPU devices), the devices compute on the cores that thread
    runs on, and its work and theirs add up. 0 / False in the built-in presets (not priced);
    `hlopar-calibrate` measures them for one process's devices (on 8 CPU devices of a 2-core
    machine: ~90 us, ~12 us a device and ~8 us a value).
    """

    name: str
    intra_host_latency_s: float
    intra_host_bandwidth: float
    inter_host_latency_s: float
    inter_host_bandwidth: float
    device_flops: float
    device_memory_bytes: float
    devices_per_host: int
    description: str = ""
    kernel_launch_s: float = 0.0
    matmul_half_flops: float = 0.0
    executable_launch_s: float = 0.0
    device_memory_bandwidth: float = 0.0
    value_launch_s: float = 0.0
    transfer_latency_s: float = 0.0
    transfer_bandwidth: float = 0.0
    dispatch_s: float = 0.0
    device_dispatch_s: float = 0.0
    value_dispatch_s: float = 0.0
    devices_share_host_cores: bool = False

    def __post_init__(self) -> None:
        if self.devices_per_host < 1:
            raise ValueError(f"preset {self.name!r}: devices_per_host must be >= 1, got {self.devices_per_host}")
        for field_name in (
            "kernel_launch_s",
            "matmul_half_flops",
            "executable_launch_s",
            "device_memory_bandwidth",
            "value_launch_s",
            "transfer_latency_s",
            "transfer_bandwidth",
            "dispatch_s",
            "device_dispatch_s",
            "value_dispatch_s",
        ):
            value = getattr(self, field_name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"preset {self.name!r}: {field_name} must be finite and >= 0, got {value!r}")

    def matmul_efficiency(self, flops: float) -> float:
        """The fraction of the peak a matrix product of `flops` FLOPs per device reaches."""
        return flops / (flops + self.matmul_half_flops) if flops > 0 else 0.0

    def op_seconds(self, kernels: float, matmuls: float, values: float = 0.0) -> float:
        """Seconds `kernels` kernel launches, `matmuls` of them matrix products, cost beyond
        their FLOPs at peak (which the intra-op costs already hold): a launch each, and
        n-half / peak per product (`matmul_efficiency`); and `values` handed to or taken
        from a fragment run, `value_launch_s` each."""
        seconds = kernels * self.kernel_launch_s + matmuls * self.matmul_half_flops / self.device_flops
        return seconds + values * self.value_launch_s if values else seconds


# Every GPU preset: a kernel launch costs ~5 us, the order of the CUDA launch latency NVIDIA
# quotes ("a few microseconds", CUDA C++ Best Practices Guide and the CUDA Graphs blog post of
# 2019); XLA fuses elementwise ops, so one launch is charged per op that roots a fusion
# (`layer_costs.kernel_counts`). Matrix products reach half the peak at n-half FLOPs per
# device, set so that n-half / peak is ~8 us (the ramp of NVIDIA's "Matrix Multiplication
# Background" guide, where GEMMs of a few GFLOPs run well below the tensor cores' peak, read
# as an order of magnitude: a 1024^3 product, 2.1 GFLOP, at about 2/3 of a V100's peak). Assumptions.
_GPU_LAUNCH_S = 5e-6
_GPU_HALF_PEAK_S = 8e-6


def _gpu_node(
    name: str, nvlink: float, nic_per_gpu: float, nic_latency_s: float, flops: float, memory_gib: int, description: str
) -> ClusterPreset:
    """8 GPUs on NVLink (one-way B/s per GPU), each with `nic_per_gpu` B/s to other nodes."""
    return ClusterPreset(
        name,
        10e-6,
        nvlink,
        nic_latency_s,
        nic_per_gpu,
        flops,
        memory_gib * _GIB,
        8,
        description,
        kernel_launch_s=_GPU_LAUNCH_S,
        matmul_half_flops=_GPU_HALF_PEAK_S * flops,
    )


CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    preset.name: preset
    for preset in (
        # Rough: XLA's CPU collectives copy through host memory. A single-threaded numpy memcpy on
        # the 2-core development machine runs at ~3-10 GB/s; the 8 forced host devices
        # (`--xla_force_host_platform_device_count=8`) share those cores. Inter-host is 10 GbE.
        # FLOP/s: ~180 GFLOP/s measured for a 1024² f32 matmul on the whole machine, over its 8
        # devices; memory: its 24 GiB over 8. Calibrate on the machine at hand when it matters.
        # Per-kernel overhead and the matmul ramp are left at zero: on this preset small
        # microbatches cost only their collective start-ups. Measured (issue 18): a chain of N
        # dependent 4x4 dot + tanh pairs (2 kernels each: a dot roots its own kernel) under
        # jax.jit, (t(401) - t(1)) / 800, medians of 30 interleaved runs at load 4.6: 0.54 us a
        # kernel on one device, 2.6 us on each of 8 SPMD devices sharing the 2 cores, and
        # about 0.3 ms a launch of an 8-device executable (t(1)). Not set here: the number of
        # microbatches `parallelize` uses is not chosen by these costs (passes.planning.default_microbatches),
        # and the plans the tests pin on this preset would move.
        ClusterPreset(
            name="cpu",
            intra_host_latency_s=10e-6,
            intra_host_bandwidth=5e9,
            inter_host_latency_s=50e-6,
            inter_host_bandwidth=10 * _GBIT / 8,
            device_flops=20e9,
            device_memory_bytes=3 * _GIB,
            devices_per_host=8,
            description="host CPU devices of one machine (rough, measured-ish numbers)",
        ),
        # Alpa's testbed (§8): AWS p3.16xlarge, 8 V100-SXM2 16 GB per node on NVLink, 25 Gbps
        # between nodes. NVIDIA V100 datasheet: NVLink 2.0 300 GB/s total per GPU (150 GB/s each
        # way), 125 TFLOPS fp16 tensor cores. The node's one 25 Gbps NIC is shared by its 8 GPUs
        # when they all communicate: 25/8 Gbit/s per device; TCP, so a larger latency.
        _gpu_node(
            "v100-p3.16xlarge",
            150e9,
            25 * _GBIT / 8,
            50e-6,
            125e12,
            16,
            "AWS p3.16xlarge: 8x V100 16GB, NVLink 2.0, 25 Gbps between nodes (Alpa §8)",
        ),
        # NVIDIA DGX A100 / A100 datasheet: 8x A100-SXM4 80GB behind NVSwitch, NVLink 3.0 600 GB/s
        # total per GPU (300 GB/s each way); 312 TFLOPS dense bf16/fp16; one 200 Gb/s HDR
        # InfiniBand adapter per GPU (25 GB/s per device between nodes).
        _gpu_node(
            "a100-80g-nvlink",
            300e9,
            200 * _GBIT,
            20e-6,
            312e12,
            80,
            "8x A100 80GB SXM, NVLink 3.0 + NVSwitch, 8x 200 Gb/s HDR InfiniBand per node",
        ),
        # NVIDIA DGX H100 / H100 datasheet: 8x H100-SXM5 80GB behind NVSwitch, NVLink 4.0 900 GB/s
        # total per GPU (450 GB/s each way); 989 TFLOPS dense bf16; one 400 Gb/s NDR InfiniBand
        # adapter per GPU (50 GB/s per device between nodes).
        _gpu_node(
            "h100-80g-nvlink",
            450e9,
            400 * _GBIT,
            20e-6,
            989e12,
            80,
            "8x H100 80GB SXM, NVLink 4.0 + NVSwitch, 8x 400 Gb/s NDR InfiniBand per node",
        ),
    )
}


def logical_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str] | None = None,
    *,
    preset: str = "cpu",
    latencies: Sequence[float] | None = None,
    bandwidths: Sequence[float] | None = None,
    memory_budget: float | None = None,
    devices_per_host: int | None = None,
) -> LogicalMesh:
    """A logical mesh over devices 0..n-1 laid out row-major, with link costs from `preset`.

    Devices `h*k .. h*k + h-1` share host k (h = the preset's devices per host). An axis whose
    every group (devices differing only along it) stays within one host gets the intra-host
    numbers; an axis with a group that crosses hosts is as slow as its slowest link, the
    inter-host one. `latencies` / `bandwidths` (one per axis) override the preset,
    `memory_budget` the device memory, and `devices_per_host` the preset's host size (a
    submesh of a cluster whose hosts hold fewer devices than the preset's nodes). Names default
    to x, y, z, w (axis_0, ... past 4-D).
    """
    shape = tuple(shape)
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh shape {shape} must be positive integers")
    if shape:
        check_mesh_shape(shape)  # before anything the size of the mesh is allocated
    if axis_names is None:
        axis_names = _DEFAULT_NAMES[: len(shape)] if len(shape) <= 4 else [f"axis_{i}" for i in range(len(shape))]
    axis_names = tuple(axis_names)
    if len(axis_names) != len(shape):
        raise ValueError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    cluster = cluster_preset(preset)
    for what, values in (("latencies", latencies), ("bandwidths", bandwidths)):
        if values is not None and len(values) != len(shape):
            raise ValueError(f"{what} {tuple(values)} give {len(values)} values for a {len(shape)}-D mesh {shape}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget!r}")

    if devices_per_host is not None and devices_per_host < 1:
        raise ValueError(f"devices_per_host must be >= 1, got {devices_per_host!r}")
    crossing = _axes_crossing_hosts(shape, devices_per_host or cluster.devices_per_host)
    axes = []
    for i, (name, size) in enumerate(zip(axis_names, shape)):
        latency = cluster.inter_host_latency_s if crossing[i] else cluster.intra_host_latency_s
        bandwidth = cluster.inter_host_bandwidth if crossing[i] else cluster.intra_host_bandwidth
        axes.append(
            MeshAxis(
                name,
                int(size),
                latency if latencies is None else latencies[i],
                bandwidth if bandwidths is None else bandwidths[i],
            )
        )
    memory = cluster.device_memory_bytes if memory_budget is None else memory_budget
    return LogicalMesh(tuple(axes), cluster.device_flops, memory, cluster.device_memory_bandwidth)


# A preset file: `write_preset`'s JSON, the fields of `ClusterPreset` (what `hlopar-calibrate`
# writes, with what it measured under "measured", which planning does not read).
PRESET_FILE_FORMAT = "hlopar-cluster-preset/1"


def is_preset_file(preset: str) -> bool:
    """Whether a preset option names a file (a path with a separator or a .json name) rather
    than one of `CLUSTER_PRESETS`."""
    return preset not in CLUSTER_PRESETS and (os.sep in preset or "/" in preset or preset.endswith(".json"))


def cluster_preset(preset: str) -> ClusterPreset:
    """The preset a planning option names: one of `CLUSTER_PRESETS`, or a preset file."""
    found = CLUSTER_PRESETS.get(preset)
    if found is not None:
        return found
    if not is_preset_file(preset):
        raise ValueError(
            f"unknown cluster preset {preset!r}; known presets: {', '.join(CLUSTER_PRESETS)}, or a preset file (.json)"
        )
    path = Path(preset).expanduser()
    try:
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"cluster preset file {preset}: {error.strerror or error}") from None
    return _read_preset(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read_preset(path: str, mtime_ns: int, size: int) -> ClusterPreset:
    """A preset file's preset, read once per content on disk (its mtime and size key it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cluster preset file {path}: not a readable JSON file ({error})") from None
    return preset_from_dict(data, where=f"cluster preset file {path}")


def preset_from_dict(data: object, where: str = "cluster preset") -> ClusterPreset:
    """A `ClusterPreset` from `write_preset`'s JSON object, every field checked."""
    if not isinstance(data, Mapping) or data.get("format") != PRESET_FILE_FORMAT:
        raise ValueError(f'{where}: expected a JSON object with "format": "{PRESET_FILE_FORMAT}"')
    fields = {f.name: f for f in dataclasses.fields(ClusterPreset)}
    preset = data.get("preset")
    if not isinstance(preset, Mapping):
        raise ValueError(f'{where}: no "preset" object')
    unknown = sorted(set(preset) - set(fields))
    missing = sorted(name for name, f in fields.items() if name not in preset and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise ValueError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    values = {}
    for name, value in preset.items():
        if name in ("name", "description"):
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name} must be a string, got {value!r}")
        elif name == "devices_share_host_cores":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
        elif name == "devices_per_host":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}: devices_per_host must be an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
        values[name] = value
    for name in ("intra_host_bandwidth", "inter_host_bandwidth", "device_flops", "device_memory_bytes"):
        if not values[name] > 0:
            raise ValueError(f"{where}: {name} must be > 0, got {values[name]!r}")
    try:
        return ClusterPreset(**values)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def write_preset(preset: ClusterPreset, path: str | os.PathLike, measured: Mapping | None = None) -> Path:
    """Write `preset` (and, for the reader, what was `measured` to make it) as a preset file,
    atomically: a failed write leaves an older file as it was."""
    path = Path(path)
    data = {"format": PRESET_FILE_FORMAT, "preset": dataclasses.asdict(preset)}
    if measured is not None:
        data["measured"] = dict(measured)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def preset_fingerprint(preset: str | None) -> str | None:
    """What a plan made with this preset depends on: the name of a built-in preset, the
    content of a preset file (so a recalibrated file is a new plan)."""
    if preset is None or not is_preset_file(preset):
        return preset
    resolved = cluster_preset(preset)
    return hashlib.sha256(json.dumps(dataclasses.asdict(resolved), sort_keys=True).encode()).hexdigest()[:24]


def _axes_crossing_hosts(shape: tuple[int, ...], devices_per_host: int) -> tuple[bool, ...]:
    """Per axis, whether some group along it spans more than one host (row-major device ids)."""
    if not shape:
        return ()
    hosts = np.arange(math.prod(shape)).reshape(shape) // devices_per_host
    return tuple(bool((hosts != hosts.take([0], axis=i)).any()) for i in range(len(shape)))
