"""The MPMD runtime on Ray: a driver and one mesh worker (a Ray actor) per (mesh, host).

Alpa §6: each worker holds a static instruction list and runs a whole training step without
round trips to the driver. Here the program is what codegen made
(`codegen.pipeline_program.PipelineProgram`, bound to a schedule's streams), and each
`MeshWorker` does for its mesh what `local_executor.PipelinedStep` does for every mesh in
one process:

- `setup` compiles the mesh's fragment modules for the worker's own devices
  (`codegen.executables.compile_executable`, donated accumulators included);
- `run_step` runs the mesh's stream in order: RUN executes the fragments it names on the
  microbatch (sums accumulate inside the executables), SEND packs the unit ops of the
  transfers it names and hands them to the peer worker at once (`transports`), RECV waits
  for them in the worker's mailbox and places them as the reading fragment lays them out,
  FREE drops a microbatch's stash; after the stream, the mesh's update fragments run in
  program order, on the sums. A value moved once (a sum read by another mesh's update, an
  update result read by another mesh) is pulled by its reader from its maker (`fetch`),
  which answers once the value exists. Arguments are sent by the driver to every worker that
  reads them, directly or through a transfer chain that starts at an argument (a parameter
  read on two meshes). The worker keeps the step's results that live on its mesh, by
  (step, result), and returns none of them: the driver reads one when the caller does
  (`result`, `runtime/remote_array.py`); the next call passes them back as arguments (new
  parameters, optimizer state) and the driver sends nothing for them (`resident`; a worker
  of another mesh that reads one asks its keepers for it, `pulled`); the ones the caller
  dropped or donated go with the next call (`release`) and are dropped then.

Devices. A worker owns the devices of its mesh on its host: on CPU its process is started
with `XLA_FLAGS=--xla_force_host_platform_device_count=<its devices>` (its own CPU devices;
`host_devices` also sizes XLA's thread pool so that their collectives cannot starve),
on GPU Ray gives it `num_gpus=<its devices>` (`CUDA_VISIBLE_DEVICES`). Physical device ids
of the plan map to the worker's local devices in increasing order. A mesh spanning hosts
has one worker per host, joined into one multi-process jax runtime (`mesh_processes`):
each compiles the mesh's fragments for the global mesh, runs the same stream, and holds its
own devices' shards; unit ops go from the worker owning their sending device to the workers
owning their receivers, results and saves leave each worker as its shards.

Placement. One placement-group bundle per host of the cluster, holding that host's workers
(STRICT_SPREAD over the nodes of a real cluster, PACK on the local machine, where hosts are
simulated by separate processes exactly as on a real cluster). A worker asks Ray for what it
holds: its GPUs, and a hundredth of a core (`WORKER_CPUS`): CPU devices are threads on the
host's cores, which every worker shares, so several parallelized functions fit on one
machine. A request no node set of the cluster could ever hold (`unplaceable`: too many GPUs,
fewer nodes than hosts) fails at once, naming what was asked and what exists; only what
could still become free (held by other workers) is waited for, `timeout` seconds.

Faults. Every wait is bounded: the driver waits for a step with `ray.wait` and a deadline
and notices a dead worker (`RayActorError`) as soon as Ray does, a worker waits for a
delivery or a pull at most `timeout` seconds. On any failure the driver kills every worker
and raises `WorkerError`; `start` again builds fresh workers (the caller's next call does).
The driver's waits look every second at whether the local cluster died under the process
(`local_ray.lost`: its raylet or GCS), and then raise `WorkerError` saying so.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hlopar.analysis.schedules import FREE, RECV, RUN, SEND, PipelineStreams
from hlopar.analysis.schedules.instructions import MeshStream
from hlopar.analysis.schedules.timeline import COMPUTE, KINDS, SEND_LANE, Span, Timeline
from hlopar.codegen.pipeline_program import UPDATE, PipelineProgram, ProgramFragment, ProgramTransfer
from hlopar.runtime.mesh_processes import (
    Pieces,
    WorkerLayout,
    coordinator_address,
    gather_pieces,
    host_value,
    join_mesh,
    local_pieces,
    mesh_devices,
    routes,
    worker_layout,
)
from hlopar.runtime.fragment_calls import Placements, free_stash, run_fragment
from hlopar.runtime.host_devices import host_device_environment
from hlopar.runtime.step_arguments import check_batch, step_arguments
from hlopar.runtime.transports import Mailbox, TransportError, pack, transport_for, unpack, unpack_shards

__all__ = [
    "WORKER_CPUS",
    "MeshWorker",
    "Placement",
    "RayRuntime",
    "WorkerError",
    "WorkerProgram",
    "placement_of",
    "unplaceable",
    "worker_programs",
]


class WorkerError(RuntimeError):
    """A step that failed on a worker (it died, raised, or took too long); the workers are
    stopped and the next `start` makes new ones."""


# --------------------------------------------------------------------------- plain data


@dataclass
class WorkerProgram:
    """What one mesh's workers need: the program (fragment modules left out), its own
    fragments' module text, its stream, the arguments it reads, the results it returns, and
    every worker's devices."""

    mesh: str
    devices: tuple[int, ...]  # physical ids, the mesh's logical order
    program: PipelineProgram  # every fragment's `module` is None
    texts: dict[str, str]  # this mesh's fragments: name -> module text
    stream: MeshStream
    arguments: tuple[int, ...]  # argument numbers read here (directly or through a transfer chain)
    results: tuple[int, ...]  # positions in `program.results` of the values living on this mesh
    layout: WorkerLayout  # every worker of the program (mesh_processes)
    whole: str | None = None  # the program as one executable's module text (`codegen.one_program`), or None


def _argument_origin(program: PipelineProgram, v: int) -> int | None:
    """The argument a value is a copy of (through transfers), or None."""
    values = program.values
    while values[v].transfer is not None:
        v = program.transfers[values[v].transfer].source
    return values[v].argument


def worker_programs(
    program: PipelineProgram, streams: PipelineStreams, layout: WorkerLayout | None = None
) -> dict[str, WorkerProgram]:
    """Per mesh, its `WorkerProgram` (`layout` default: one worker per mesh)."""
    from hlopar.codegen.one_program import one_program
    from hlopar.ir.module import print_module

    layout = layout or worker_layout(program.devices)
    whole = one_program(program)
    bare = replace(program, fragments=[replace(f, module=None) for f in program.fragments])
    by_mesh = {s.mesh: s for s in streams.streams}
    out = {}
    for mesh in program.meshes:
        reads = [v for f in program.fragments if f.mesh == mesh for v in f.operands]
        results = tuple(r for r, v in enumerate(program.results) if program.values[v].mesh == mesh)
        reads += [program.results[r] for r in results]
        arguments = sorted({a for a in (_argument_origin(program, v) for v in reads) if a is not None})
        stream = by_mesh.get(mesh, MeshStream(mesh, -1, ()))
        out[mesh] = WorkerProgram(
            mesh,
            tuple(program.devices[mesh]),
            bare,
            {} if whole else {f.name: f.text for f in program.fragments if f.mesh == mesh},
            stream,
            tuple(arguments),
            results,
            layout,
            print_module(whole) if whole else None,
        )
    stray = [r for r, v in enumerate(program.results) if program.values[v].mesh not in out]
    if stray:
        raise ValueError(f"results {stray} live on no mesh of the program")
    return out


WORKER_CPUS = 0.01  # what a worker asks of a host's cores (module docstring)


@dataclass(frozen=True)
class Placement:
    """Where workers go: one per (mesh, host), and whether hosts are simulated on this machine."""

    workers: WorkerLayout
    local: bool
    device_kind: str  # cpu or gpu

    @property
    def strategy(self) -> str:
        return "PACK" if self.local else "STRICT_SPREAD"

    @property
    def hosts(self) -> list[int]:
        return sorted({s.host for s in self.workers.slots.values()})

    def worker_resources(self, name: str) -> dict[str, float]:
        """What worker `name` asks Ray for: its GPUs, and `WORKER_CPUS` of a core."""
        need = {"CPU": WORKER_CPUS}
        if self.device_kind == "gpu":
            need["GPU"] = float(len(self.workers.slots[name].devices))
        return need

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per host (`hosts` order): its workers' resources."""
        out = []
        for host in self.hosts:
            bundle: dict[str, float] = {}
            for name, slot in self.workers.slots.items():
                if slot.host == host:
                    for resource, amount in self.worker_resources(name).items():
                        bundle[resource] = round(bundle.get(resource, 0.0) + amount, 4)
            out.append(bundle)
        return out

    def describe(self) -> str:
        """The request in the user's terms: per host, its bundle and workers."""
        rows = []
        for host, bundle in zip(self.hosts, self.bundles()):
            names = [
                f"{n} ({len(s.devices)} {self.device_kind} devices)"
                for n, s in self.workers.slots.items()
                if s.host == host
            ]
            rows.append(f"host {host}: {_resources(bundle)} for {', '.join(names)}")
        return "; ".join(rows) + (
            " (PACK: on any nodes)" if self.local else f" (STRICT_SPREAD: {len(rows)} distinct nodes, one per host)"
        )


def placement_of(program: PipelineProgram, devices_per_host: int, *, local: bool, device_kind: str) -> Placement:
    """One worker per (mesh, host of its devices) (module docstring)."""
    return Placement(worker_layout(program.devices, devices_per_host), local, device_kind)


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(amount <= node.get(resource, 0.0) + 1e-9 for resource, amount in bundle.items())


def unplaceable(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why no placement of `bundles` on `nodes` (each node's total resources) can ever exist,
    whatever else runs there, or None. PACK: the totals fit and each bundle fits some node
    (necessary, enough for one bundle per host); STRICT_SPREAD: each bundle on its own
    node (a matching of bundles to nodes, by augmenting paths)."""
    if not nodes:
        return "the Ray cluster has no alive node"
    for resource in sorted({r for b in bundles for r in b}):
        need = sum(b.get(resource, 0.0) for b in bundles)
        have = sum(n.get(resource, 0.0) for n in nodes)
        if need > have + 1e-9:
            return f"they need {need:g} {resource} in all, the Ray cluster has {have:g}"
    for k, bundle in enumerate(bundles):
        if not any(_fits(bundle, node) for node in nodes):
            return f"no node can hold host {k}'s workers ({_resources(bundle)})"
    if strategy != "STRICT_SPREAD":
        return None
    if len(bundles) > len(nodes):
        return f"{len(bundles)} hosts need {len(bundles)} distinct nodes, the Ray cluster has {len(nodes)}"
    holder: dict[int, int] = {}  # node -> bundle

    def assign(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n not in seen and _fits(bundles[b], node):
                seen.add(n)
                if n not in holder or assign(holder[n], seen):
                    holder[n] = b
                    return True
        return False

    for b in range(len(bundles)):
        if not assign(b, set()):
            return f"no {len(bundles)} distinct nodes can hold one host's workers each"
    return None


def _resources(amounts: Mapping[str, float], only: Sequence[str] | None = None) -> str:
    """`{CPU: 2, GPU: 0}`: the amounts of `only` (default: each resource of `amounts`)."""
    keys = sorted(amounts) if only is None else only
    return "{" + ", ".join(f"{k}: {amounts.get(k, 0.0):g}" for k in keys) + "}"


# --------------------------------------------------------------------------- the worker


class MeshWorker:
    """One worker of a mesh (a threaded Ray actor: `run_step` runs the stream while
    `deliver` and `fetch` serve the peers; a plan's only worker, which has no peers, is a
    plain actor, whose calls run on its process's main thread). Module docstring."""

    def __init__(self, mesh: str, device_kind: str = "cpu", timeout: float = 120.0, name: str | None = None):
        self.mesh = mesh
        self.name = name or mesh
        self.device_kind = device_kind
        self.timeout = timeout
        self.transport = transport_for(device_kind)
        self.mailbox = Mailbox()
        self.changed = threading.Condition()
        self.runs: dict[int, _WorkerRun] = {}
        self.kept: dict[tuple[int, int], object] = {}  # (step, result position) -> its value, on the devices
        self.last = 0  # the step whose results `save` writes
        self.peers: dict = {}
        self.delay = 0.0

    # -- set up

    def pid(self) -> int:
        return os.getpid()

    def coordinator(self) -> str:
        """An address for the mesh's multi-process runtime, this worker its coordinator."""
        return coordinator_address()

    def set_peers(self, peers: Mapping) -> None:
        self.peers = dict(peers)

    def debug_delay(self, seconds: float) -> None:
        """Tests: each step first sleeps this long (to kill a worker during a step)."""
        self.delay = seconds

    def setup(self, wp: WorkerProgram, coordinator: str | None = None) -> dict:
        """Joins the mesh's multi-process runtime (a mesh spanning hosts) and compiles the
        mesh's fragments for its devices."""
        clock = time.perf_counter()
        self.wp = wp
        self.program = wp.program
        self.slot = wp.layout.slots[self.name]
        self.spans = wp.layout.spans(wp.mesh)
        if self.spans:
            join_mesh(coordinator, self.slot, len(wp.layout.of_mesh(wp.mesh)), self.device_kind, self.timeout)

        from hlopar.codegen.executables import compile_executable
        from hlopar.ir.module import parse_module

        self.devices = mesh_devices(wp.layout, wp.mesh)  # plan id -> jax device, the whole mesh
        self.plan_id = {device: d for d, device in self.devices.items()}
        self.mesh_devices = [self.devices[d] for d in wp.devices]
        compiled: dict[str, object] = {}
        self.executables = {}
        for name, text in wp.texts.items():
            if text not in compiled:
                compiled[text] = compile_executable(parse_module(text), self.mesh_devices)
            self.executables[name] = compiled[text]
        self.whole = compile_executable(parse_module(wp.whole), self.mesh_devices) if wp.whole else None
        self.landing, self.made = {}, {}  # value -> sharding its first reader reads / its maker writes
        if self.whole is not None:
            self.landing = {
                v: self.whole.input_shardings[value.argument]
                for v, value in enumerate(self.program.values)
                if value.argument is not None
            }
            self.made = dict(zip(self.program.results, self.whole.output_shardings))
        for fragment in self.program.fragments:
            if fragment.mesh != wp.mesh or fragment.name not in self.executables:
                continue
            ex = self.executables[fragment.name]
            offset = len(fragment.accumulate)
            for position, v in enumerate(fragment.operands):
                self.landing.setdefault(v, ex.input_shardings[offset + position])
            for position, v in enumerate(fragment.results):
                self.made.setdefault(v, ex.output_shardings[position])
        self.fragments = {f.name: f for f in self.program.fragments}
        self.transfers = {t.name: t for t in self.program.transfers}
        self.routes = {
            t.name: routes(t.plan, wp.layout, t.src_mesh, t.dst_mesh)
            for t in self.program.transfers
            if wp.mesh in (t.src_mesh, t.dst_mesh)
        }
        return {
            "worker": self.name,
            "mesh": wp.mesh,
            "pid": os.getpid(),
            "host": self.slot.host,
            "devices": [str(self.devices[d]) for d in self.slot.devices],
            "platform": self.devices[self.slot.devices[0]].platform,
            "executables": len(compiled) + (self.whole is not None),
            "one_program": self.whole is not None,
            "compile_s": time.perf_counter() - clock,
        }

    def senders(self, transfer: str) -> list[str]:
        """The workers that send this worker unit ops of a transfer."""
        return [src for src, dst in self.routes[transfer] if dst == self.name]

    def source(self, value):
        """What `pack` cuts a sent value from: this worker's shards of it on a spanning mesh."""
        return local_pieces(value) if self.spans else value

    # -- a step

    def run_step(
        self,
        step: int,
        arguments: Mapping[int, object],
        resident: Mapping[int, tuple[int, int]],
        pulled: Mapping[int, tuple[int, int, tuple[str, ...]]] | None = None,
        release: Sequence[tuple[int, int]] = (),
        returned: Collection[int] = (),
        copied: Collection[int] = (),
    ) -> dict:
        """Runs the mesh's stream and updates for one step and keeps its results here; returns
        only those of `returned` (typed keys, which the driver holds as jax's own key arrays)
        and a copy of those of `copied` (scalars, which the driver would read at once:
        `remote_array`), a few bytes each; the driver reads any other with `result`.
        `arguments`: argument number -> array (or an ObjectRef of one); `resident`: argument number -> (step, result
        position) of a value this worker keeps; `pulled`: the same, kept by the workers named
        (another mesh's), asked for here; `release`: kept values no longer referenced (or
        donated), dropped once this step's arguments are taken."""
        import ray

        if self.delay:
            time.sleep(self.delay)
        clock = time.perf_counter()
        args = {}
        for i, value in arguments.items():
            args[i] = ray.get(value, timeout=self.timeout) if isinstance(value, ray.ObjectRef) else value
        for i, key in resident.items():
            if key not in self.kept:
                raise RuntimeError(
                    f"argument {i}: the worker {self.name} does not hold result {key[1]} of step {key[0]}"
                )
            args[i] = self.kept[key]
        for i, (s, r, holders) in (pulled or {}).items():
            parts = ray.get([self.peers[h].result.remote(s, r) for h in holders], timeout=self.timeout)
            if any(p is None for p in parts):
                raise RuntimeError(f"argument {i}: result {r} of step {s} is no longer held by {', '.join(holders)}")
            args[i] = parts[0] if not isinstance(parts[0], Pieces) else gather_pieces(parts)
        for key in release:
            self.kept.pop(key, None)
        run = _WorkerRun(self, step, args)
        with self.changed:
            self.runs = {s: r for s, r in self.runs.items() if s >= step - 1}
            self.runs[step] = run
            self.changed.notify_all()
        self.mailbox.drop_before(step)
        if self.whole is not None:
            outputs = run.whole()
            for r in self.wp.results:
                self.kept[(step, r)] = outputs[r]
        else:
            run.stream()
            run.updates()
            last = self.program.microbatches - 1
            for r in self.wp.results:
                self.kept[(step, r)] = run.read(self.program.results[r], last, once=True)
        run.timing["step_s"] = time.perf_counter() - clock
        run.timing["placed"] = run.placements.moved
        return {"timing": run.timing, "spans": run.spans, "results": self._returned(step, returned, copied)}

    def _returned(self, step: int, returned: Collection[int], copied: Collection[int] = ()) -> dict:
        """The results of `step` in `returned` and `copied` that live here, as `result` gives
        them; the previous step's copies of `returned` are dropped (the driver holds them,
        `save` needs only the last), `copied` ones stay kept until released."""
        mine = [r for r in returned if r in self.wp.results]
        if self.last != step:
            for r in mine:
                self.kept.pop((self.last, r), None)
        self.last = step
        return {r: self.result(step, r) for r in [*mine, *(r for r in copied if r in self.wp.results)]}

    def result(self, step: int, r: int):
        """A kept result as the driver (or a peer) reads it: the whole value, or on a
        spanning mesh this worker's `Pieces`; None if it is no longer kept."""
        value = self.kept.get((step, r))
        return None if value is None else host_value(value)

    def drop(self, keys: Sequence[tuple[int, int]]) -> None:
        """Drops kept results no longer referenced (what a step's `release` does, between steps)."""
        for step, r in keys:
            self.kept.pop((step, r), None)

    def deliver(self, step: int, items: Mapping) -> None:
        """A peer's SEND: payloads by (transfer, microbatch, sending worker)."""
        for key, payload in items.items():
            self.mailbox.put((step, *key), payload)

    def fetch(self, step: int, name: str, m: int, once: bool, to: str | None = None):
        """A peer worker (`to`) pulls a transfer made on this mesh (a value moved once): the
        unit ops this worker sends it, once the value exists."""
        deadline = time.monotonic() + self.timeout
        with self.changed:
            while step not in self.runs:
                if time.monotonic() > deadline:
                    raise TransportError(f"{self.name}: step {step} did not start in {self.timeout:g} s")
                self.changed.wait(deadline - time.monotonic())
            run = self.runs[step]
        transfer = self.transfers[name]
        ops = self.routes[name][(self.name, to or transfer.dst_mesh)]
        return pack(transfer.plan, self.source(run.read(transfer.source, m, once, wait=True)), ops)

    # -- saving the state

    def save(self, directory: str, record: Mapping, values: Mapping | None = None) -> dict:
        """Writes the results this worker keeps (its shards of the training state) as its
        part in `directory` (`checkpoint.write_part`: `<worker>.npz`, or an Orbax item):
        whole, or per device where the mesh spans hosts. Returns the part's description, or
        `{"error": ...}`: a failed save is the driver's to report, never a failed worker
        (its state stays). `values`: the results to write (default: the last step's)."""
        from hlopar.runtime import checkpoint

        try:
            arrays = {}
            for r in self.wp.results:
                value = self.kept.get((self.last, r)) if values is None else values[r]
                if value is None:
                    raise checkpoint.CheckpointError(
                        f"result {r} of the step saved is no longer kept (donated, or dropped)"
                    )
                if getattr(value, "is_fully_addressable", True):
                    arrays[f"r{r}"] = np.asarray(value)
                    continue
                arrays[f"r{r}.shape"] = np.array(value.shape, np.int64)
                for shard in value.addressable_shards:
                    arrays[f"r{r}@{self.plan_id[shard.device]}"] = np.asarray(shard.data)
            return {"part": checkpoint.write_part(directory, self.name, arrays, record)}
        except Exception as error:  # noqa: BLE001 - reported by the driver, the worker goes on
            return {"error": f"{type(error).__name__}: {error}"}

    def save_start(self, directory: str, record: Mapping) -> None:
        """`save`, in a thread of its own (`parallelize(checkpoint_every=...)`): the steps go
        on while it writes; `save_poll` gives its answer."""
        values = {r: self.kept.get((self.last, r)) for r in self.wp.results}  # this step's, whatever comes next
        saves = self.__dict__.setdefault("saves", {})
        saves[record["save"]] = None

        def write():
            # The step's thread takes the GIL back after each executable it runs: with a save
            # writing Python-heavy (Orbax's asyncio) in this thread, it would wait up to the
            # switch interval each time (5 ms); 0.5 ms while a save is written.
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, 0.0005))
            try:
                saves[record["save"]] = self.save(directory, record, values)
            finally:
                sys.setswitchinterval(interval)

        threading.Thread(target=write, name=f"hlopar-save-{self.name}", daemon=True).start()

    def save_poll(self, save: str) -> dict | None:
        """The answer of the `save_start` of `save` (as `save`'s), or None while it writes."""
        saves = self.__dict__.setdefault("saves", {})
        answer = saves.get(save)
        if answer is not None:
            del saves[save]
        return answer

    def load(
        self,
        directory: str,
        step: int,
        returned: Collection[int] = (),
        copied: Collection[int] = (),
        keys: Sequence[str] = (),
    ) -> dict:
        """Reads back what `save` wrote (the driver has checked it, `checkpoint.read_manifest`;
        `keys`: an Orbax save's, per result) and keeps it as the results of `step`; returns
        those of `returned` and `copied` (as `run_step`) under "results", or `{"error": ...}`
        with nothing changed."""
        import jax

        from hlopar.runtime import checkpoint

        try:
            item = Path(directory) / self.name
            data = checkpoint.load_part(item if item.is_dir() else Path(directory) / f"{self.name}.npz", keys)
            carry = {}
            for r in self.wp.results:
                if f"r{r}" in data:
                    carry[r] = data[f"r{r}"]
                elif f"r{r}.shape" in data:
                    shape = tuple(int(n) for n in data[f"r{r}.shape"])
                    sharding = self.made.get(self.program.results[r]) or self.landing[self.program.results[r]]
                    shards = []
                    for device, index in sharding.addressable_devices_indices_map(shape).items():
                        shard = data[f"r{r}@{self.plan_id[device]}"]
                        want = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
                        if shard.shape != want:
                            raise checkpoint.CheckpointError(
                                f"result {r}'s shard on device {self.plan_id[device]} "
                                f"is {shard.shape}, the plan's is {want}"
                            )
                        shards.append(jax.device_put(shard, device))
                    carry[r] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
            missing = set(self.wp.results) - set(carry)
            if missing:
                raise checkpoint.CheckpointError(f"{self.name}: the save holds no results {sorted(missing)}")
        except Exception as error:  # noqa: BLE001 - reported by the driver, the worker goes on
            return {"error": f"{type(error).__name__}: {error}"}
        self.restored = (step, self.last)  # what `unload` undoes
        self.kept.update({(step, r): value for r, value in carry.items()})
        return {"results": self._returned(step, returned, copied)}

    def unload(self, step: int) -> None:
        """Undoes `load` of `step` (another worker's part failed): its values dropped, the
        last step the one before."""
        if getattr(self, "restored", (None,))[0] == step:
            for r in self.wp.results:
                self.kept.pop((step, r), None)
            self.last = self.restored[1]


class _WorkerRun:
    """One step on one worker: its values per microbatch, sums, progress."""

    def __init__(self, worker: MeshWorker, step: int, arguments: Mapping[int, object]):
        self.w = worker
        self.program = worker.program
        self.step = step
        self.arguments = arguments
        self.slices: dict[int, list] = {}
        self.store: dict[tuple[int, int | None], object] = {}
        self.sums: dict[int, object] = {}
        self.stream_done = False
        self.placements = Placements()  # arguments placed as the fragments read them, once
        self.timing = {
            "run_s": 0.0,
            "send_s": 0.0,
            "recv_wait_s": 0.0,
            "pull_s": 0.0,
            "sent_bytes": 0,
            "runs": 0,
            "placed": 0,
        }  # placed: inputs copied from the host or moved to another layout
        self.spans: list[tuple] = []  # (lane, kind, microbatch, peer, start, end), wall-clock seconds

    # values

    def argument(self, i: int, m: int, per_microbatch: bool):
        if not per_microbatch:
            return self.arguments[i]
        if i not in self.slices:
            full = np.asarray(self.arguments[i])
            size = self.program.argument_shapes[i][0]
            self.slices[i] = [full[k * size : (k + 1) * size] for k in range(self.program.microbatches)]
        return self.slices[i][m]

    def read(self, v: int, m: int, once: bool = False, wait: bool = False):
        """Value v of microbatch m (`once`: as the update reads it), as `local_executor`
        reads it; with `wait` (a peer's pull) values this mesh makes are waited for."""
        program = self.program
        value = program.values[v]
        if once and value.accumulated:
            self._wait(lambda: self.stream_done, wait, f"the sum %{v}")
            return self.sums[v]
        transfer = program.transfers[value.transfer] if value.transfer is not None else None
        source = program.values[transfer.source] if transfer is not None else None
        summed = once and source is not None and source.accumulated
        key = (v, m if value.per_microbatch and not summed else None)
        if key in self.store:
            return self.store[key]
        if value.argument is not None:
            array = self.argument(value.argument, m, value.per_microbatch)
        elif transfer is not None and _argument_origin(program, transfer.source) is not None:
            # A copy of an argument: the driver sent the argument here too.
            array = self.place(transfer.result, self.read(transfer.source, m, once))
        elif transfer is not None and (summed or not transfer.streamed):
            clock = time.perf_counter()
            payloads = [
                self.w.transport.pull(self.w.peers[src], self.step, transfer.name, m, once, self.w.timeout, self.w.name)
                for src in self.w.senders(transfer.name)
            ]
            array = self.receive(transfer, payloads)
            self.timing["pull_s"] += time.perf_counter() - clock
        else:  # made on this mesh by a fragment or a RECV
            self._wait(lambda: key in self.store, wait, f"microbatch {m}'s value %{v}")
            return self.store[key]
        self.store[key] = array
        return array

    def _wait(self, ready, wait: bool, what: str) -> None:
        if ready():
            return
        if not wait:
            raise RuntimeError(f"{self.w.name}: {what} is read before it is made")
        deadline = time.monotonic() + self.w.timeout
        with self.w.changed:
            while not ready():
                if time.monotonic() > deadline:
                    raise TransportError(f"{self.w.name}: {what} was not made in {self.w.timeout:g} s")
                self.w.changed.wait(min(1.0, deadline - time.monotonic()))

    def _made(self) -> None:
        with self.w.changed:
            self.w.changed.notify_all()

    def place(self, v: int, array):
        """A moved value, laid out as its first reader on this mesh reads it."""
        import jax

        landing = self.w.landing.get(v)
        return array if landing is None else jax.device_put(array, landing)

    def receive(self, t: ProgramTransfer, payloads):
        """A transfer's value from the payloads of its senders to this worker: the whole
        value, or on a spanning mesh this worker's shards of the global one."""
        if not self.w.spans:
            return self.place(t.result, unpack(t.plan, payloads))
        import jax

        from hlopar.runtime.local_transfer import assemble

        shards = unpack_shards(t.plan, payloads, self.w.slot.devices)
        placed = {d: jax.device_put(shard, self.w.devices[d]) for d, shard in shards.items()}
        return self.place(t.result, assemble(placed, t.plan.shape, t.plan.dst, self.w.devices))

    def run_fragment(self, fragment: ProgramFragment, m: int) -> None:
        import jax

        inputs = [self.read(v, m, once=fragment.role == UPDATE) for v in fragment.operands]
        clock = time.perf_counter()
        jax.block_until_ready(
            run_fragment(
                self.program,
                self.w.executables[fragment.name],
                fragment,
                inputs,
                m,
                self.sums,
                self.store,
                self.placements,
            )
        )
        self.timing["run_s"] += time.perf_counter() - clock
        self.timing["runs"] += 1
        self._made()

    def whole(self) -> list:
        """The step as one executable (`codegen.one_program`): every argument in, every result out."""
        import jax

        ex = self.w.whole
        began, clock = time.time(), time.perf_counter()
        inputs = [self.arguments[i] for i in range(len(self.program.argument_shapes))]
        outputs = jax.block_until_ready(ex.run(self.placements.inputs(ex, inputs, 0, tuple(ex.donated))))
        self.timing["run_s"] += time.perf_counter() - clock
        self.timing["runs"] += 1
        self.spans.append((COMPUTE, "other", None, "", began, time.time()))
        self.stream_done = True
        self._made()
        return outputs

    # the stream

    def stream(self) -> None:
        done: set[str] = set()
        for inst in self.w.wp.stream.instructions:
            local = [d for d in inst.deps if d.rpartition(":")[0] == self.w.mesh]
            if not all(d in done for d in local):
                raise RuntimeError(f"{inst.id} waits for a later instruction of its own stream")
            self.execute(inst)
            done.add(inst.id)
        self.stream_done = True
        self._made()

    def execute(self, inst) -> None:
        began = time.time()
        if inst.op == RUN:
            for name in inst.executables:
                self.run_fragment(self.w.fragments[name], inst.microbatch)
        elif inst.op == SEND:
            clock = time.perf_counter()
            items: dict[str, dict] = {}  # receiving worker -> its payloads
            for name in inst.transfers:
                t: ProgramTransfer = self.w.transfers[name]
                source = self.w.source(self.read(t.source, inst.microbatch))
                for (src, dst), ops in self.w.routes[name].items():
                    if src == self.w.name:
                        payload = pack(t.plan, source, ops)
                        items.setdefault(dst, {})[(name, inst.microbatch, src)] = payload
                        self.timing["sent_bytes"] += payload.nbytes
            for dst, payloads in items.items():
                self.w.transport.send(self.w.peers[dst], self.step, payloads)
            self.timing["send_s"] += time.perf_counter() - clock
        elif inst.op == RECV:
            clock = time.perf_counter()
            for name in inst.transfers:
                t = self.w.transfers[name]
                payloads = [
                    self.w.mailbox.take(
                        (self.step, name, inst.microbatch, src),
                        self.w.timeout,
                        f"{inst.id} RECV {name} mb={inst.microbatch} <- {src}",
                    )
                    for src in self.w.senders(name)
                ]
                self.store[(t.result, inst.microbatch)] = self.receive(t, payloads)
            self.timing["recv_wait_s"] += time.perf_counter() - clock
            self._made()
        elif inst.op == FREE:
            free_stash(self.program, self.store, self.w.mesh, inst.buffer)
        # ACCUMULATE: inside the executables; UPDATE: `updates` after the stream.
        if inst.op in (RUN, SEND):
            self.spans.append(
                (COMPUTE if inst.op == RUN else SEND_LANE, inst.kind, inst.microbatch, inst.peer, began, time.time())
            )

    def updates(self) -> None:
        last = self.program.microbatches - 1
        for fragment in self.program.fragments:
            if fragment.role == UPDATE and fragment.mesh == self.w.mesh:
                began = time.time()
                self.run_fragment(fragment, last)
                self.spans.append((COMPUTE, "other", None, "", began, time.time()))


# --------------------------------------------------------------------------- the driver


@dataclass
class StepStats:
    """What one step took: the driver's wall time and each worker's timing."""

    wall_s: float
    workers: dict[str, dict] = field(default_factory=dict)  # per worker: its timing
    sent: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments the driver sent
    kept: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments it kept
    mesh_of: dict[str, str] = field(default_factory=dict)  # worker -> its mesh
    spans: dict[str, list[tuple]] = field(default_factory=dict)  # per worker: what it ran and sent, when
    started: float = 0.0  # the driver's wall clock when the step began
    pulled: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments kept by another mesh

    def timeline(self) -> Timeline:
        """The step as the workers measured it, one row per worker, times from the driver's
        start of the step (wall clocks: on a real cluster as good as the hosts' clock sync)."""
        spans = [
            Span(
                name,
                lane,
                kind if kind in KINDS else "other",
                start - self.started,
                end - self.started,
                microbatch,
                peer,
            )
            for name, rows in self.spans.items()
            for lane, kind, microbatch, peer, start, end in rows
        ]
        return Timeline(f"measured step: {self.wall_s * 1e3:.3g} ms on the driver", tuple(self.spans), tuple(spans))

    @property
    def executable_s(self) -> float:
        """Sum over meshes of the time spent running executables (the workers of a spanning
        mesh run them together: its slowest worker's)."""
        per_mesh: dict[str, float] = {}
        for name, w in self.workers.items():
            mesh = self.mesh_of.get(name, name)
            per_mesh[mesh] = max(per_mesh.get(mesh, 0.0), w.get("run_s", 0.0))
        return sum(per_mesh.values())


class RayRuntime:
    """The driver: starts one `MeshWorker` per (mesh, host), feeds steps; the results stay
    on the workers, read one at a time (`fetch_start`, `fetch_finish`) and dropped there once
    released (`release`, sent with the next step)."""

    def __init__(
        self,
        program: PipelineProgram,
        schedule: str,
        placement: Placement,
        *,
        timeout: float = 300.0,
        worker_timeout: float = 120.0,
        log=None,
        phase=None,
        returned: Collection[int] = (),
        copied: Collection[int] = (),
    ):
        self.program = program
        self.returned = tuple(returned)  # results that come back with each step (typed keys)
        self.copied = tuple(copied)  # results kept on the workers whose copy comes back too (scalars)
        self.schedule = schedule
        self.placement = placement
        self.layout = placement.workers
        self.timeout = timeout
        self.worker_timeout = worker_timeout
        self.streams = program.streams(schedule)
        self.programs = worker_programs(program, self.streams, self.layout)
        self.actors: dict = {}
        self.group = None
        self.connection = 0  # `local_ray.connection()` when the workers started
        self.step_id = 0
        self.generation = 0  # increases with each start: results kept by older workers are gone
        self.log = log or (lambda message: None)
        self.phase = phase or (lambda name: None)  # "starting workers", "compiling" (a progress display)
        self.setup_info: dict[str, dict] = {}
        self.last_stats: StepStats | None = None
        self.released: deque[tuple[int, int, int]] = deque()  # (generation, step, result): to drop
        self.fetched_bytes = 0  # result bytes that reached the driver (read, or returned with a step), in all

    @property
    def alive(self) -> bool:
        """Workers started, not stopped, and their cluster still the one this process is
        connected to (`local_ray`: a local cluster that died is replaced at the next call)."""
        from hlopar.runtime import local_ray

        return bool(self.actors) and self.connection == local_ray.connection() and local_ray.lost() is None

    def result_mesh(self, r: int) -> str:
        return self.program.values[self.program.results[r]].mesh

    def _who(self, name: str) -> str:
        slot = self.layout.slots[name]
        return f"mesh {slot.mesh}" + (f" (host {slot.host})" if self.layout.spans(slot.mesh) else "")

    # -- life cycle

    def start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hlopar.runtime import local_ray

        self.shutdown()
        self.generation += 1
        self.connection = local_ray.connection()
        self.phase("starting workers")
        kind = self.placement.device_kind
        slots = self.layout.slots
        self._place()
        bundle_of_host = {h: k for k, h in enumerate(self.placement.hosts)}
        clock = time.perf_counter()
        # A lone worker serves no peer during a step: a plain actor runs its calls one at a
        # time on the process's main thread, where the step runs as fast as in a driver (the
        # GPT of tools/bench_runtime.py, its one executable, 5 x 6 interleaved steps each at
        # load 8-16: main thread 0.99-1.01x the driver, an actor's pool thread 1.07-1.20x;
        # docs/runtime.md). Several workers stay threaded to serve `deliver` and `fetch`.
        threaded = len(slots) > 1
        for name, slot in slots.items():
            need = self.placement.worker_resources(name)
            options = {
                "num_cpus": need["CPU"],
                "max_concurrency": 16 if threaded else 1,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=bundle_of_host[slot.host]
                ),
            }
            # CPU devices' buffers are the host's malloc: in a threaded actor's thread (not the
            # main thread, as in a driver or a lone worker) glibc gives the step a per-thread arena, whose large
            # blocks are mapped afresh each step (the GPT of tools/bench_runtime.py, one
            # executable of 8 CPU devices: 45 k minor page faults a step against 21 k in the
            # driver, 0.457 s against 0.347); one arena: 10.6 k, 0.386 s (load 12-14).
            # Ray sets OMP_NUM_THREADS to a worker's whole CPUs (1 for a fraction), and XLA:CPU's
            # matrix products then run on one thread (GPT h256 L4, "shard" on 1x8, 2 cores:
            # 0.42 s/step in a worker, 0.27 s in the driver): the host's cores, unless set.
            threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)}
            if kind == "gpu":
                options["num_gpus"] = need["GPU"]
                options["runtime_env"] = {"env_vars": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **threads}}
            else:
                arena = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX") or "1"} if threaded else {}
                options["runtime_env"] = {
                    "env_vars": {
                        **host_device_environment(len(slot.devices), environ={}),
                        "JAX_PLATFORMS": "cpu",
                        **threads,
                        **arena,
                    }
                }
            self.actors[name] = (
                ray.remote(MeshWorker).options(**options).remote(slot.mesh, kind, self.worker_timeout, name)
            )
        self._gather({n: a.set_peers.remote(self.actors) for n, a in self.actors.items()}, "start")
        firsts = {self.layout.of_mesh(m)[0].name: m for m in self.program.meshes if self.layout.spans(m)}
        coordinators = {
            firsts[n]: address
            for n, address in self._gather({n: self.actors[n].coordinator.remote() for n in firsts}, "start").items()
        }
        self.phase("compiling")
        self.setup_info = self._gather(
            {
                n: a.setup.remote(self.programs[slots[n].mesh], coordinators.get(slots[n].mesh))
                for n, a in self.actors.items()
            },
            "compile",
        )
        self.log(
            f"started {len(self.actors)} workers in {time.perf_counter() - clock:.1f} s: "
            + ", ".join(
                f"{n} ({len(slots[n].devices)} {kind} devices, {i['executables']} executables, "
                f"compiled in {i['compile_s']:.1f} s)"
                for n, i in self.setup_info.items()
            )
        )

    def _place(self) -> None:
        """The workers' placement group, ready: refused at once if the cluster's nodes could
        never hold it, else waited for up to `timeout` (other workers may free resources)."""
        import ray
        from ray.util.placement_group import placement_group

        bundles, strategy = self.placement.bundles(), self.placement.strategy
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        why = unplaceable(bundles, strategy, nodes)
        asked = sorted({r for b in bundles for r in b})
        if why is not None:
            raise WorkerError(
                f"Ray can never place the workers: {why}. Asked: {self.placement.describe()}; the "
                f"cluster has {len(nodes)} node(s): " + ", ".join(_resources(n, asked) for n in nodes)
            )
        self.group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerError(
                f"Ray could not place the workers in {self.timeout:g} s: asked {self.placement.describe()}; the "
                f"cluster has {_resources(ray.cluster_resources(), asked)}, of which "
                f"{_resources(ray.available_resources(), asked)} is free (other workers hold the rest: close() the "
                "parallelized functions no longer needed)"
            ) from None

    def shutdown(self) -> None:
        """Kills the workers (if any) and frees their placement group."""
        import ray

        if not ray.is_initialized():  # disconnected: the workers went with the connection
            self.actors, self.group = {}, None
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = {}
        if self.group is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
            except Exception:
                pass
            self.group = None

    def worker_pids(self) -> dict[str, int]:
        return {n: i["pid"] for n, i in self.setup_info.items()}

    # -- running

    def run(
        self, arguments: Sequence, resident: Mapping[int, tuple[int, int]] | None = None
    ) -> tuple[int, dict[int, np.ndarray]]:
        """One step on the whole batch; returns its number, by which its results are read
        (the workers keep them), and the values of the `returned` and `copied` ones. `arguments`: @main's
        arguments (host arrays; anything for a resident one); `resident`: argument number ->
        (step, result position) of a result the workers still keep (not sent: its mesh's
        workers use their copy, the workers of another mesh that read it ask them for it)."""
        import ray

        if not self.alive:
            raise WorkerError("the workers are not running (start them first)")
        program = self.program
        resident = dict(resident or {})
        arguments = step_arguments(
            [None if i in resident else a for i, a in enumerate(arguments)],
            len(program.argument_shapes),
            program.index_arg,
            program.microbatches,
        )
        check_batch(program, arguments, skip=resident)
        self.step_id += 1
        step = self.step_id
        slots = self.layout.slots
        readers: dict[int, int] = {}
        for slot in slots.values():
            for i in self.programs[slot.mesh].arguments:
                readers[i] = readers.get(i, 0) + 1
        release = self._released()
        shared: dict[int, object] = {}
        calls, sent_by_worker, kept_by_worker, pulled_by_worker = {}, {}, {}, {}
        clock, started = time.perf_counter(), time.time()
        for name, slot in slots.items():
            sent, kept, pulled = {}, {}, {}
            for i in self.programs[slot.mesh].arguments:
                if i in resident:
                    s, r = resident[i]
                    mesh = self.result_mesh(r)
                    if mesh == slot.mesh:
                        kept[i] = (s, r)
                    else:
                        pulled[i] = (s, r, tuple(w.name for w in self.layout.of_mesh(mesh)))
                elif readers[i] > 1:
                    if i not in shared:
                        shared[i] = ray.put(np.asarray(arguments[i]))
                    sent[i] = shared[i]
                else:
                    sent[i] = np.asarray(arguments[i])
            calls[name] = self.actors[name].run_step.remote(
                step, sent, kept, pulled, release.get(slot.mesh, ()), self.returned, self.copied
            )
            sent_by_worker[name], kept_by_worker[name], pulled_by_worker[name] = tuple(sent), tuple(kept), tuple(pulled)
        outputs = self._gather(calls, f"step {step}")
        self.last_stats = StepStats(
            time.perf_counter() - clock,
            {n: o["timing"] for n, o in outputs.items()},
            sent_by_worker,
            kept_by_worker,
            {n: s.mesh for n, s in slots.items()},
            {n: o["spans"] for n, o in outputs.items()},
            started,
            pulled=pulled_by_worker,
        )
        return step, self._assembled(outputs)

    # -- the results, kept on the workers

    def holds(self, generation: int) -> bool:
        """Whether the workers that kept results of `generation` still run."""
        return self.alive and generation == self.generation

    def release(self, generation: int, step: int, r: int) -> None:
        """Result `r` of `step` is no longer referenced (or donated): its workers drop it at
        the start of the next step. Called from finalizers, in any thread."""
        if generation == self.generation:
            self.released.append((generation, step, r))

    def set_aside(self) -> None:
        """Another signature's runtime runs the calls for now: the results the caller no
        longer references are dropped on the workers at once, not at this runtime's next step
        (which may never come)."""
        released = self._released()
        if released and self.alive:
            self._gather(
                {
                    w.name: self.actors[w.name].drop.remote(keys)
                    for mesh, keys in released.items()
                    for w in self.layout.of_mesh(mesh)
                },
                "dropping released results",
            )

    def _released(self) -> dict[str, list[tuple[int, int]]]:
        """Per mesh, the kept results to drop (taken from `released`)."""
        out: dict[str, list[tuple[int, int]]] = {}
        while self.released:
            generation, step, r = self.released.popleft()
            if generation == self.generation:
                out.setdefault(self.result_mesh(r), []).append((step, r))
        return out

    def fetch_start(self, generation: int, step: int, results: Sequence[int]) -> tuple:
        """Asks the workers that keep them for results of `step` (not waited for)."""
        if not self.holds(generation):
            hint = getattr(self, "resume_hint", None)
            raise RuntimeError(
                "its workers were stopped (after a failure, or closed), and what they held with "
                "them; a value read before is kept, the state can be restored from a save"
                + (f" ({hint})" if hint else "")
            )
        return tuple(
            {w.name: self.actors[w.name].result.remote(step, r) for w in self.layout.of_mesh(self.result_mesh(r))}
            for r in results
        )

    def fetch_finish(self, pending: tuple, what: str) -> list[np.ndarray]:
        """The results `fetch_start` asked for, as host arrays."""
        out = []
        for calls in pending:
            parts = list(self._gather(calls, f"reading {what}").values())
            if any(p is None for p in parts):
                raise RuntimeError(f"{what} is no longer kept by the workers")
            out.append(_whole(parts))
            self.fetched_bytes += out[-1].nbytes
        return out

    def _assembled(self, outputs: Mapping[str, Mapping]) -> dict[int, np.ndarray]:
        """The `returned` and `copied` results from what each worker returned (counted in
        `fetched_bytes`)."""
        parts: dict[int, list] = {}
        for output in outputs.values():
            for r, value in output["results"].items():
                parts.setdefault(r, []).append(value)
        whole = {r: _whole(values) for r, values in parts.items()}
        self.fetched_bytes += sum(np.asarray(value).nbytes for value in whole.values())
        return whole

    def _gather(self, calls: Mapping[str, object], what: str) -> dict[str, object]:
        """Waits for one call per worker, up to `timeout`; on a dead worker, an error or the
        deadline, stops every worker and raises `WorkerError`."""
        import ray

        deadline = time.monotonic() + self.timeout
        name_of = {ref: name for name, ref in calls.items()}
        pending = list(calls.values())
        done = {}
        while pending:
            try:  # a second at a time: a local cluster that died is noticed within it (`local_ray.lost`)
                ready, pending = ray.wait(
                    pending, num_returns=1, timeout=min(1.0, max(0.0, deadline - time.monotonic()))
                )
            except Exception:
                self._cluster_lost(what)
                raise
            if not ready:
                self._cluster_lost(what)
                if time.monotonic() < deadline:
                    continue
                late = sorted(self._who(name_of[r]) for r in pending)
                self.shutdown()
                raise WorkerError(
                    f"{what}: the workers of {', '.join(late)} did not answer within "
                    f"{self.timeout:g} s; the workers were stopped (the next call restarts them)"
                )
            for ref in ready:
                name = name_of[ref]
                try:
                    done[name] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    self._cluster_lost(what)
                    self.shutdown()
                    raise WorkerError(
                        f"{what}: the worker of {self._who(name)} died "
                        f"({type(error).__name__}); the workers were stopped, the next call "
                        "restarts them"
                    ) from error
                except ray.exceptions.RayTaskError as error:
                    self.shutdown()
                    cause = error.cause if getattr(error, "cause", None) is not None else error
                    raise WorkerError(
                        f"{what}: the worker of {self._who(name)} failed: {type(cause).__name__}: "
                        f"{cause}; the workers were stopped, the next call restarts them"
                    ) from error
        return done

    def _cluster_lost(self, what: str) -> None:
        """Raises `WorkerError` if the local cluster died under this process (`local_ray.lost`)."""
        from hlopar.runtime import local_ray

        why = local_ray.lost()
        if why is not None:
            self.actors, self.group = {}, None
            raise WorkerError(
                f"{what}: {why}; the workers and what they held are lost, the next call starts a "
                "new cluster and new workers"
            )

    # -- saving

    def save(self, directory: str | Path, record: Mapping) -> dict:
        """Each worker writes its part into `directory` (a save's staging directory,
        `checkpoint.save`); returns what the manifest says of them. A worker that could not
        write its part raises `CheckpointError`, the workers still running."""
        answers = self._gather({n: a.save.remote(str(directory), dict(record)) for n, a in self.actors.items()}, "save")
        return self._saved(answers)

    def save_start(self, directory: str | Path, record: Mapping):
        """`save` in the background (`parallelize(checkpoint_every=...)`): each worker starts
        writing the last step's results in a thread of its own and the call returns; the
        function returned waits for them (polling, so that a lone worker, whose calls run one
        at a time, is never held up) and returns what `save` returns."""
        import ray

        generation = self.generation
        self._gather({n: a.save_start.remote(str(directory), dict(record)) for n, a in self.actors.items()}, "save")
        actors = dict(self.actors)

        def finish(poll_s: float = 0.25) -> dict:
            from hlopar.runtime.checkpoint import CheckpointError

            answers: dict[str, dict] = {}
            deadline = time.monotonic() + self.timeout
            while len(answers) < len(actors):
                if self.generation != generation or not self.alive:
                    raise CheckpointError("the workers stopped before their parts were written", workers_lost=True)
                if time.monotonic() > deadline:
                    raise CheckpointError(f"the workers did not write their parts within {self.timeout:g} s")
                for n, a in actors.items():
                    if n not in answers:
                        try:
                            answer = ray.get(a.save_poll.remote(record["save"]), timeout=self.timeout)
                        except ray.exceptions.RayError as error:
                            raise CheckpointError(
                                f"the worker of {self._who(n)} did not answer ({type(error).__name__})",
                                workers_lost=True,
                            ) from None
                        if answer is not None:
                            answers[n] = answer
                if len(answers) < len(actors):
                    time.sleep(poll_s)
            return self._saved(answers)

        return finish

    def _saved(self, answers: Mapping[str, dict]) -> dict:
        from hlopar.runtime.checkpoint import CheckpointError

        failed = [
            f"the worker of {self._who(n)} could not write its part: {a['error']}"
            for n, a in answers.items()
            if "error" in a
        ]
        if failed:
            raise CheckpointError("; ".join(failed))
        return {
            "results": {r: self.result_mesh(r) for r in range(len(self.program.results))},
            "workers": self.worker_meshes(),
            "parts": {n: a["part"] for n, a in answers.items()},
        }

    def worker_meshes(self) -> dict[str, str]:
        """Each worker's mesh, by worker name (the parts of a save)."""
        return {n: s.mesh for n, s in self.layout.slots.items()}

    def load(self, directory: str | Path, keys: Sequence[str] = ()) -> tuple[int, dict[int, np.ndarray]]:
        """Each worker reads back its part (checked by the caller, `checkpoint.read_manifest`)
        as the results of a new step; returns as `run`. If a worker cannot, the others undo
        theirs and `CheckpointError` says why: the state is as it was."""
        from hlopar.runtime.checkpoint import CheckpointError

        step = self.step_id + 1
        loaded = self._gather(
            {
                n: a.load.remote(str(directory), step, self.returned, self.copied, tuple(keys))
                for n, a in self.actors.items()
            },
            "restore",
        )
        failed = [
            f"the worker of {self._who(n)} could not read its part: {a['error']}"
            for n, a in loaded.items()
            if "error" in a
        ]
        if failed:
            self._gather(
                {n: self.actors[n].unload.remote(step) for n, a in loaded.items() if "error" not in a}, "restore"
            )
            raise CheckpointError(
                f"cannot restore from {directory}: "
                + "; ".join(failed)
                + "; nothing was restored (the live state is as it was)"
            )
        self.step_id = step
        return step, self._assembled({n: {"results": a["results"]} for n, a in loaded.items()})


def _whole(parts: Sequence) -> np.ndarray:
    """A result from its workers' answers: the whole value, or a spanning mesh's pieces put
    together."""
    return gather_pieces(parts) if isinstance(parts[0], Pieces) else parts[0]
