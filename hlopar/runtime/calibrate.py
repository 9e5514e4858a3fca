"""Calibration: time, on this machine's devices, what the planner's cost model prices.

`calibrate(cluster)` runs small jax programs on the cluster's devices (every device busy at
once, as in a stage) and fits a `ClusterPreset` to the timings
(`analysis.calibration.preset_from_measurements`):

- a 1024^3 matrix product per device (peak FLOP/s), a chain of 64^3 products (the ramp);
- a chain of dependent 4x4 dot + tanh kernels (the cost of one more kernel);
- a near-empty executable on every device (the launch, subtracted from the chains);
- the same with 33 arguments and results (what each value a fragment reads or writes adds);
- near-empty executables run as the runtime runs a fragment, 64 times back to back, on half
  and on all of the devices, and with 33 values on all (what the in-process runtime's host
  thread pays per launch, per device and per value);
- an elementwise kernel on 256 KiB and on 4 MiB per device (the memory bandwidth);
- a value of 16 KiB and of 4 MiB moved from half of the devices to the other half, laid out
  anew (the in-process transport's `jax.device_put`: the cross-mesh transport);
- the five collectives the ILP prices (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute) over groups of 2 devices, a host's and all of them, on a 1 KiB and a
  1 MiB buffer, each as a chain of 9 against a chain of 1 in one executable (so neither the
  launch nor the compile is counted);
- with `across_processes`, the same collectives across `num_hosts` processes of
  `devices_per_host` devices each (jax.distributed; gloo on CPUs): what a mesh spanning hosts
  pays on Ray workers. Without it (the default for `Cluster.local`, whose in-process runtime
  runs every mesh in this process), the inter-host links are the in-process ones.

Other work on the machine skews every timing (at a load of 5 on 2 cores the kernel launch
came out 0 and the FLOP/s a third of the quiet value): the load average before and after is
recorded in the preset file, and a machine busier than half a load per core is warned about
(`BusyMachineWarning`), the calibration kept (the caller decides).

It measures this machine only: a Ray cluster's nodes are not visited (`hlopar-calibrate`
runs on a node of it). On GPUs the same programs run on the GPUs (NCCL across processes is
not launched here); that path has never run on a GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hlopar.analysis.auto_sharding.cluster import ClusterPreset, write_preset
from hlopar.analysis.calibration import CollectiveTiming, Measurements, preset_from_measurements
from hlopar.analysis.cluster import Cluster

__all__ = ["BusyMachineWarning", "Calibration", "calibrate", "calibrated_preset"]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SMALL_BUFFER, LARGE_BUFFER = 1 << 10, 1 << 20  # bytes per device
CHAIN = 9  # collectives (or kernels) of the long chain; the short one has 1
ELEMENTWISE_BYTES = 1 << 22  # per device, the larger elementwise kernel's result
MANY_VALUES = 33  # arguments (and results) of the launch timed against one of one
TRANSFER_BYTES = 1 << 22  # the larger value moved between meshes (the smaller: 1/256 of it)
DISPATCHES = 64  # launches back to back per timing of the host's pace
BUSY_LOAD_PER_CORE = 0.5  # a 1-minute load average above this per core: the machine is busy


class BusyMachineWarning(UserWarning):
    """Other work ran on the machine while it was calibrated: the timings are skewed."""


@dataclass(frozen=True)
class Calibration:
    """A calibration's preset, what it was fit on, the fits, where it was written, how long it took."""

    preset: ClusterPreset
    measurements: Measurements
    fits: dict
    path: Path | None
    seconds: float
    load: tuple[float, float] | None = None  # the machine's 1-minute load average, before and after

    @property
    def busy(self) -> bool:
        """Whether other work ran beside the calibration (module docstring)."""
        return self.load is not None and max(self.load) > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1)

    def report(self) -> str:
        m, p = self.measurements, self.preset
        lines = [
            f"calibrated {m.num_hosts} host(s) x {m.devices_per_host} {m.device_kind} device(s) in {self.seconds:.1f} s",
            f"  device FLOP/s          {p.device_flops / 1e9:10.2f} G  ({m.large_matmul_flops / 1e9:.2f} GFLOP in "
            f"{m.large_matmul_s * 1e3:.2f} ms, every device at once)",
            f"  matmul n-half          {p.matmul_half_flops / 1e6:10.3f} MFLOP  (a {m.small_matmul_flops / 1e6:.3f} MFLOP "
            f"product: {m.small_matmul_s * 1e6:.1f} us)",
            f"  kernel launch          {p.kernel_launch_s * 1e6:10.2f} us",
            f"  executable launch      {p.executable_launch_s * 1e6:10.1f} us  (a near-empty executable on every device)",
            f"  per value launched     {p.value_launch_s * 1e6:10.2f} us  (an argument and a result more: "
            f"{m.many_values} of each in {m.many_values_launch_s * 1e6:.1f} us)",
            f"  host thread per launch {p.dispatch_s * 1e6:10.1f} us + {p.device_dispatch_s * 1e6:.1f} us a device "
            f"+ {p.value_dispatch_s * 1e6:.1f} us a value  ({m.dispatch_devices[0]} and {m.dispatch_devices[1]} "
            f"devices: {m.dispatch_s[0] * 1e6:.1f} and {m.dispatch_s[1] * 1e6:.1f} us, {m.many_values} values: "
            f"{m.many_values_dispatch_s * 1e6:.1f} us, runs back to back; "
            + ("devices on its cores)" if p.devices_share_host_cores else "not priced where 0)"),
            f"  cross-mesh transport   {p.transfer_latency_s * 1e6:10.1f} us a value, "
            f"{p.transfer_bandwidth / 1e9:.2f} GB/s  (a value moved from half of the devices to the other half)",
            f"  memory bandwidth       {p.device_memory_bandwidth / 1e9:10.2f} GB/s  (results an elementwise kernel "
            f"writes, every device at once)",
            f"  memory per device      {p.device_memory_bytes / 2**30:10.2f} GiB",
        ]
        if self.load is not None:
            lines.append(
                f"  machine load           {self.load[0]:10.2f} -> {self.load[1]:.2f} on {os.cpu_count()} cores"
                + ("  BUSY: the timings are skewed; calibrate on a quiet machine" if self.busy else "")
            )
        for name, key in (("in one process", "intra_host"), ("across processes", "inter_host")):
            fit = self.fits.get(key)
            if fit is None:
                lines.append(f"  links {name:<17} not measured: inter-host links are the in-process ones")
                continue
            lines.append(
                f"  links {name:<17} latency {fit['latency_s'] * 1e6:8.1f} us, bandwidth "
                f"{fit['bandwidth'] / 1e9:7.2f} GB/s  (fit to {fit['samples']} collectives, median error "
                f"{fit['error']:.0%})"
            )
        for t in m.collectives:
            where = "across processes" if t.across_processes else "in one process"
            lines.append(f"    {t.kind:<18} {t.group:>3} devices {t.nbytes:>8} B  {t.seconds * 1e6:9.1f} us  ({where})")
        if self.path is not None:
            lines.append(f"  written to {self.path}")
        return "\n".join(lines)


def calibrate(
    cluster: Cluster | None = None,
    *,
    output: str | os.PathLike | None = None,
    across_processes: bool = False,
    repeats: int = 5,
    name: str = "calibrated",
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Time this machine's devices as `cluster` (default `Cluster.local()`) uses them and fit
    a preset; written to `output` (a preset file every planning entry point takes as
    `preset`) when given. `across_processes`: also time collectives across `num_hosts`
    processes (see the module docstring)."""
    import jax

    start = time.perf_counter()
    cluster = cluster or Cluster.local()
    if not cluster.is_local:
        raise ValueError("calibrate measures this machine: run hlopar-calibrate on a node of the Ray cluster")
    cluster = cluster.resolved()
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    wanted = cluster.num_hosts * cluster.devices_per_host
    devices = jax.devices()[:wanted]
    if len(devices) < wanted:
        raise ValueError(
            f"calibrate: the cluster has {wanted} devices, jax sees {len(jax.devices())} "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={wanted})"
        )
    say = progress or (lambda message: None)
    load_before = _load()
    say(f"timing matrix products and kernels on {wanted} device(s)")
    timer = _Timer(repeats)
    compute = _compute_timings(devices, timer)
    say("timing collectives in this process")
    groups = sorted({g for g in (2, cluster.devices_per_host, wanted) if 1 < g <= wanted and wanted % g == 0})
    collectives = [t for g in groups for t in _collective_timings(devices, g, timer, across=False)]
    if across_processes and cluster.num_hosts > 1:
        if cluster.device_kind != "cpu":
            raise ValueError("calibrate: collectives across processes are timed on CPU devices only (gloo)")
        say(f"timing collectives across {cluster.num_hosts} processes")
        collectives += _across_processes(cluster.num_hosts, cluster.devices_per_host, repeats)
    measurements = Measurements(
        device_kind=cluster.device_kind,
        num_hosts=cluster.num_hosts,
        devices_per_host=cluster.devices_per_host,
        device_memory_bytes=_device_memory(devices, cluster.devices_per_host),
        collectives=tuple(collectives),
        **compute,
    )
    description = (
        f"calibrated on {socket.gethostname()}: {cluster.num_hosts} x {cluster.devices_per_host} "
        f"{cluster.device_kind} devices" + (", links across processes" if across_processes else "")
    )
    preset, fits = preset_from_measurements(measurements, name, description)
    load = None if load_before is None else (load_before, _load())
    path = None
    if output is not None:
        extra = {"measurements": measurements.as_dict(), "fits": fits, "load_average": load}
        path = write_preset(preset, output, extra)
    result = Calibration(preset, measurements, fits, path, time.perf_counter() - start, load)
    if result.busy:
        warnings.warn(
            BusyMachineWarning(
                f"calibrate: the machine was busy (load average {max(load):.1f} on {os.cpu_count()} cores): "
                "its timings are skewed by the other work; calibrate again on a quiet machine"
            ),
            stacklevel=2,
        )
    return result


def _load() -> float | None:
    """The 1-minute load average; None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def calibrated_preset(cluster: Cluster, *, across_processes: bool = False) -> Path:
    """The preset file of this machine calibrated as `cluster` uses it: kept under the cache
    (`$HLOPAR_CACHE_DIR/calibration/`), keyed by the machine, the cluster's sizes and kind,
    jax's version and `across_processes`; calibrated on first use (delete the file to
    calibrate again)."""
    import hashlib

    import jax

    from hlopar.analysis.auto_sharding.cluster import cluster_preset
    from hlopar.codegen.plan_cache import cache_root

    key = {
        "host": socket.gethostname(),
        "hosts": cluster.num_hosts,
        "devices_per_host": cluster.devices_per_host,
        "kind": cluster.device_kind,
        "jax": jax.__version__,
        "across_processes": across_processes,
        "measures": 2,  # what a calibration times: 2 with the memory bandwidth, launch per value, transport
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root() / "calibration" / f"{digest}.json"
    if path.exists():
        try:
            cluster_preset(str(path))
            return path
        except ValueError:
            pass  # unreadable (an older format, a broken disk): calibrated again, written over
    path.parent.mkdir(parents=True, exist_ok=True)
    calibrate(cluster, output=path, across_processes=across_processes)
    return path


class _Timer:
    """The least seconds of a compiled call over `repeats` runs, after one run that compiles
    (the least: what the call costs when nothing else on the machine gets in its way)."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats

    def __call__(self, fn, *args) -> float:
        import jax

        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(self.repeats):
            begin = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - begin)
        return min(times)


def _compute_timings(devices: Sequence, timer: _Timer) -> dict:
    """Matmuls, the kernel chain and the launch, every device running its own at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("d",))
    on_devices = NamedSharding(mesh, PartitionSpec("d"))
    count = len(devices)

    def placed(*shape: int, scale: float = 1.0):
        return jax.device_put(np.full((count, *shape), scale, np.float32), on_devices)

    def product(a, b):
        return jnp.einsum("dij,djk->dik", a, b)

    large = 1024
    large_s = timer(jax.jit(product), placed(large, large, scale=1e-3), placed(large, large, scale=1e-3))

    def chain(step, length: int):
        def run(x, w):
            for _ in range(length):
                x = step(x, w)
            return x

        return jax.jit(run)

    small = 64
    x, w = placed(small, small, scale=1e-2), placed(small, small, scale=1e-2)
    small_s = (timer(chain(product, 33), x, w) - timer(chain(product, 1), x, w)) / 32

    def dot_tanh(x, w):
        return jnp.tanh(product(x, w))

    x4, w4 = placed(4, 4, scale=0.5), placed(4, 4, scale=0.5)
    kernel_s = (timer(chain(dot_tanh, 65), x4, w4) - timer(chain(dot_tanh, 1), x4, w4)) / 128
    launch_s = timer(jax.jit(lambda v: v + 1.0), placed(4))
    values = [placed(4) for _ in range(MANY_VALUES)]
    many_values_s = timer(jax.jit(lambda *vs: tuple(v + 1.0 for v in vs)), *values)
    # One elementwise kernel (a read, a write: XLA fuses the two ops) of 256 KiB and of 4 MiB
    # per device: the difference is what the extra bytes cost, without the launch.
    scale = jax.jit(lambda v: v * 0.5 + 1.0)
    sizes = (ELEMENTWISE_BYTES // 16, ELEMENTWISE_BYTES)
    elementwise_s = tuple(timer(scale, placed(size // 4)) for size in sizes)
    transfer_bytes, transfer_s = _transfer_timings(devices, timer)
    return {
        **_dispatch_timings(devices, timer.repeats),
        "transfer_bytes": transfer_bytes,
        "transfer_s": transfer_s,
        "large_matmul_flops": 2.0 * large**3,
        "large_matmul_s": large_s,
        "small_matmul_flops": 2.0 * small**3,
        "small_matmul_s": max(small_s, 0.0),
        "kernel_s": kernel_s,
        "launch_s": launch_s,
        "many_values": MANY_VALUES,
        "many_values_launch_s": many_values_s,
        "elementwise_bytes": tuple(float(size) for size in sizes),
        "elementwise_s": elementwise_s,
    }


def _dispatch_timings(devices: Sequence, repeats: int) -> dict:
    """Near-empty executables run as the runtime runs a fragment (`Placements.inputs`, then
    `DeviceExecutable.run`: the in-process runtime's own path, not `jax.jit`'s), `DISPATCHES`
    times back to back and waited for at the end, the least seconds per run over `repeats`
    rounds: one value on half of the devices (one device: on it) and on all of them, and
    `MANY_VALUES` values on all of them. The runs return before the devices finish, so their
    pace is what the host thread pays per launch."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hlopar.codegen.executables import compile_executable
    from hlopar.ir.module import parse_module
    from hlopar.runtime.fragment_calls import Placements

    def pace(count: int, values: int) -> float:
        layout = NamedSharding(Mesh(np.array(devices[:count]), ("d",)), PartitionSpec("d", None))
        arrays = [jax.device_put(np.ones((count, 4), np.float32), layout) for _ in range(values)]
        bump = jax.jit(lambda *vs: tuple(v + 1.0 for v in vs), out_shardings=(layout,) * values)
        ex = compile_executable(parse_module(bump.lower(*arrays).as_text()), devices[:count])
        jax.block_until_ready(ex.run(arrays))
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            jax.block_until_ready([ex.run(Placements().inputs(ex, arrays, 0)) for _ in range(DISPATCHES)])
            best = min(best, (time.perf_counter() - begin) / DISPATCHES)
        return best

    counts = (max(1, len(devices) // 2), len(devices))
    return {
        "dispatch_devices": counts,
        "dispatch_s": (pace(counts[0], 1), pace(counts[1], 1)),
        "many_values_dispatch_s": pace(counts[1], MANY_VALUES),
    }


def _transfer_timings(devices: Sequence, timer: _Timer) -> tuple[tuple[float, float], tuple[float, float]]:
    """A value split over the first half of the devices moved whole onto the second half (the
    in-process transport's `jax.device_put`), small and large: bytes and seconds. ((0, 0),
    (0, 0)) on one device: there is no other mesh."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    half = len(devices) // 2
    if half < 1:
        return (0.0, 0.0), (0.0, 0.0)
    source = NamedSharding(Mesh(np.array(devices[:half]), ("d",)), PartitionSpec("d"))
    landing = NamedSharding(Mesh(np.array(devices[half:]), ("d",)), PartitionSpec())
    sizes = (TRANSFER_BYTES // 256, TRANSFER_BYTES)
    # A fresh value each time, as the runtime moves what a fragment just made (jax keeps the
    # host copy of an array it once moved through host memory): made and moved, less made.
    fresh = jax.jit(lambda v: v * 1.0)
    seconds = []
    for size in sizes:
        value = jax.device_put(np.ones(size // 4 // half * half, np.float32), source)
        made = timer(fresh, value)
        seconds.append(max(0.0, timer(lambda v: jax.device_put(fresh(v), landing), value) - made))
    return tuple(float(size // 4 // half * half * 4) for size in sizes), tuple(seconds)


def _collective_step(kind: str, group: int, length: int):
    """One collective of `kind` over axis "g" on a per-device buffer of `length` f32 values
    (the `Collective` convention), returning a buffer of the same length for the next one."""
    import jax
    import jax.numpy as jnp

    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, "g") * (1.0 / group)
    if kind == "all-gather":  # the per-device result is `length` long: the input 1/group of it
        return lambda x: jax.lax.all_gather(x, "g", tiled=True)[: length // group] * 0.5
    if kind == "reduce-scatter":
        return lambda x: jnp.tile(jax.lax.psum_scatter(x, "g", tiled=True), group) * (1.0 / group)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, "g", 0, 0, tiled=True)
    if kind == "collective-permute":
        return lambda x: jax.lax.ppermute(x, "g", [(i, (i + 1) % group) for i in range(group)])
    raise ValueError(f"unknown collective {kind!r}")


def _collective_timings(devices: np.ndarray | Sequence, group: int, timer: _Timer, across: bool) -> list:
    """Every collective over groups of `group` devices (the mesh's second axis), both buffer
    sizes, per collective: (chain of CHAIN - chain of 1) / (CHAIN - 1)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    grid = np.asarray(devices).reshape(-1, group)
    mesh = Mesh(grid, ("r", "g"))
    spec = PartitionSpec(("r", "g"))
    out = []
    for kind in COLLECTIVES:
        for buffer in (SMALL_BUFFER, LARGE_BUFFER):
            length = max(group, buffer // 4 // group * group)  # f32 values, split evenly over the group
            nbytes = 4 * length
            first = length // group if kind == "all-gather" else length
            step = _collective_step(kind, group, length)

            def chained(count: int, step=step):
                def body(x):
                    for _ in range(count):
                        x = step(x)
                    return x

                return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

            value = jax.device_put(np.full((grid.size * first,), 0.5, np.float32), NamedSharding(mesh, spec))
            seconds = (timer(chained(CHAIN), value) - timer(chained(1), value)) / (CHAIN - 1)
            out.append(CollectiveTiming(kind, group, nbytes, max(seconds, 1e-9), across))
    return out


def _device_memory(devices: Sequence, devices_per_host: int) -> float:
    """A device's memory: the allocator's limit on GPUs, the host's memory over its devices on CPUs."""
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / devices_per_host


# ------------------------------------------------------------------ across processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _across_processes(processes: int, devices_per_host: int, repeats: int, timeout: float = 300.0) -> list:
    """The collectives over groups that span `processes` processes (this module's `_worker`),
    timed by process 0."""
    import re

    from hlopar.runtime.host_devices import DEVICE_COUNT_FLAG, host_device_environment

    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)  # each process a host: its own devices, not this process's count
    env["XLA_FLAGS"] = re.sub(rf"{DEVICE_COUNT_FLAG}=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.update(host_device_environment(devices_per_host, env), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "hlopar.runtime.calibrate", coordinator, str(processes), str(p), str(repeats)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(processes)
    ]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=timeout))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    failed = [(p, w.returncode, err) for p, (w, (_, err)) in enumerate(zip(workers, outputs)) if w.returncode != 0]
    if failed:
        p, code, err = failed[0]
        raise RuntimeError(f"calibrate: process {p} of {processes} failed ({code}):\n{err[-2000:]}")
    rows = json.loads(outputs[0][0].strip().splitlines()[-1])
    return [CollectiveTiming(**row) for row in rows]


def _worker(coordinator: str, processes: int, process: int, repeats: int) -> None:
    """One process of the cross-process timing: the groups are one device of each process
    (what a mesh axis across hosts is), and all devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process, initialization_timeout=120)
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per = len(by_process) // processes
    # Row r holds device r of every process: each group along the second axis crosses them all.
    grid = np.array(by_process, dtype=object).reshape(processes, per).T
    timer = _Timer(2 * repeats)  # gloo's timings vary more than in-process ones
    rows = _collective_timings(grid, processes, timer, across=True)
    if per > 1:
        rows += _collective_timings(grid.reshape(1, -1), grid.size, timer, across=True)
    if process == 0:
        print(json.dumps([r.as_dict() for r in rows]))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
