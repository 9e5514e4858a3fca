"""A Ray runtime's mesh worker: one Ray actor per (mesh, host), running whole training steps.

Alpa §6: each worker holds a static instruction list and runs a whole training step without
round trips to the driver (`ray_runtime.RayRuntime`). Here the program is what codegen made
(`codegen.pipeline_program.PipelineProgram`, bound to a schedule's streams; a
`WorkerProgram` per mesh), and each `MeshWorker` runs its mesh's stream with the executor
core (`interpreter.StepInterpreter`, as the local runtime does for every mesh in one
process) through its own transport (`worker_transport.WorkerTransport`):

- `setup` loads the mesh's executables for the worker's own devices from what the driver
  compiled while planning and shipped (`codegen.executable_cache`; unless
  `HLOPAR_LOAD_EXECUTABLES=0`), and compiles those it cannot load (all of them with it,
  another host's, a mesh spanning hosts; donated accumulators included);
- `run_step` runs the mesh's stream and then its update fragments. A value moved once (a
  sum read by another mesh's update, an update result read by another mesh) is pulled by
  its reader from its maker (`fetch`), which answers once the value exists. Arguments are
  sent by the driver to every worker that reads them, directly or through a transfer chain
  that starts at an argument (a parameter read on two meshes). The worker keeps the step's
  results that live on its mesh, by (step, result), and returns none of them: the driver
  reads one when the caller does (`result`, `runtime/remote_array.py`); the next call passes
  them back as arguments (new parameters, optimizer state) and the driver sends nothing for
  them (`resident`; a worker of another mesh that reads one asks its keepers for it,
  `pulled`); the ones the caller dropped or donated go with the next call (`release`) and
  are dropped then.

Devices. A worker owns the devices of its mesh on its host: on CPU its process is started
with `XLA_FLAGS=--xla_force_host_platform_device_count=<its devices>` (its own CPU devices;
`host_devices` also sizes XLA's thread pool so that their collectives cannot starve),
on GPU Ray gives it `num_gpus=<its devices>` (`CUDA_VISIBLE_DEVICES`). Physical device ids
of the plan map to the worker's local devices in increasing order. A mesh spanning hosts
has one worker per host, joined into one multi-process jax runtime (`mesh_processes`):
each compiles the mesh's fragments for the global mesh, runs the same stream, and holds its
own devices' shards; unit ops go from the worker owning their sending device to the workers
owning their receivers, results and saves leave each worker as its shards.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hlopar.analysis.schedules import PipelineStreams
from hlopar.analysis.schedules.instructions import MeshStream
from hlopar.codegen.one_program import fused_arguments
from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.runtime.interpreter import ProgramIndex, StepInterpreter, argument_origin, value_layouts
from hlopar.runtime.mesh_processes import (
    Pieces,
    WorkerLayout,
    coordinator_address,
    gather_pieces,
    host_value,
    join_runtime,
    local_pieces,
    mesh_devices,
    routes,
    runtime_process,
    worker_layout,
)
from hlopar.runtime.transports import Mailbox, ObjectStoreTransport, TransportError, pack
from hlopar.runtime.worker_transport import WorkerTransport

__all__ = ["MeshWorker", "WorkerProgram", "worker_programs"]


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
    executables: dict[str, bytes] = field(default_factory=dict)  # key -> serialized (`executable_cache`)
    # With the collective transport: the step's SENDs, (transfer, microbatch), in the order
    # every worker runs their collectives (`collective_transport.collective_order`); else None.
    collectives: tuple[tuple[str, int | None], ...] | None = None


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
        arguments = sorted({a for a in (argument_origin(program, v) for v in reads) if a is not None})
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


class MeshWorker:
    """One worker of a mesh (a threaded Ray actor: `run_step` runs the stream while
    `deliver` and `fetch` serve the peers; a plan's only worker, which has no peers, is a
    plain actor, whose calls run on its process's main thread). Module docstring."""

    def __init__(self, mesh: str, device_kind: str = "cpu", timeout: float = 120.0, name: str | None = None):
        self.mesh = mesh
        self.name = name or mesh
        self.device_kind = device_kind
        self.timeout = timeout
        self.transport = ObjectStoreTransport()  # values moved once, and every SEND without `channel`
        self.channel = None  # the collective transport's side of this worker (`setup`)
        self.mailbox = Mailbox()
        self.changed = threading.Condition()
        self.runs: dict[int, StepInterpreter] = {}
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
        """Joins the mesh's multi-process runtime (a mesh spanning hosts; with the collective
        transport, the plan's) and compiles the mesh's fragments for its devices."""
        clock = time.perf_counter()
        self.wp = wp
        self.program = wp.program
        self.slot = wp.layout.slots[self.name]
        self.spans = wp.layout.spans(wp.mesh)
        one = wp.collectives is not None  # one runtime for the whole plan
        if one or self.spans:
            processes = len(wp.layout.slots) if one else len(wp.layout.of_mesh(wp.mesh))
            process = runtime_process(wp.layout, self.name, one)
            join_runtime(coordinator, process, processes, self.device_kind, self.timeout)

        from hlopar.codegen.executable_cache import ExecutableCache

        self.devices = mesh_devices(wp.layout, wp.mesh, one)  # plan id -> jax device, the whole mesh
        self.plan_id = {device: d for d, device in self.devices.items()}
        self.mesh_devices = [self.devices[d] for d in wp.devices]
        # The driver's executables where it shipped them (compiled once, while planning);
        # a spanning mesh's are one multi-process program, compiled here.
        cache = ExecutableCache(shipped=wp.executables)
        made = cache.executables(
            [(text, self.mesh_devices, name) for name, text in wp.texts.items()], load=not self.spans
        )
        self.executables = dict(zip(wp.texts, made))
        self.whole = cache.executable(wp.whole, self.mesh_devices, "whole", load=not self.spans) if wp.whole else None
        self.landing, self.made = {}, {}  # value -> sharding its first reader reads / its maker writes
        if self.whole is not None:
            taken = {i: p for p, i in enumerate(fused_arguments(self.program))}  # argument -> @main's
            self.landing = {
                v: self.whole.input_shardings[taken[value.argument]]
                for v, value in enumerate(self.program.values)
                if value.argument in taken
            }
            self.made = dict(zip(self.program.results, self.whole.output_shardings))
        value_layouts(self.program, self.executables, self.landing, self.made)  # this mesh's fragments only
        self.index = ProgramIndex.of(self.program, (wp.mesh,))
        self.routes = {
            t.name: routes(t.plan, wp.layout, t.src_mesh, t.dst_mesh)
            for t in self.program.transfers
            if wp.mesh in (t.src_mesh, t.dst_mesh)
        }
        if one:
            from hlopar.runtime.collective_transport import CollectiveChannel, worker_collectives

            everywhere = {
                (mesh, d): device
                for mesh in self.program.meshes
                for d, device in mesh_devices(wp.layout, mesh, True).items()
            }
            self.channel = CollectiveChannel(
                worker_collectives(self.program, wp.collectives, wp.layout, self.name),
                everywhere,
                wp.layout,
                self.name,
                self.mailbox,
                self.timeout,
                made=self._moved_once,
            )
        return {
            "worker": self.name,
            "mesh": wp.mesh,
            "pid": os.getpid(),
            "host": self.slot.host,
            "devices": [str(self.devices[d]) for d in self.slot.devices],
            "platform": self.devices[self.slot.devices[0]].platform,
            "executables": len(cache.held),
            "compilations": [(e.name, e.how, e.seconds) for e in cache.events],
            "refused": {e.name: e.refused for e in cache.events if e.refused},  # bytes that did not load
            "one_program": self.whole is not None,
            "transport": "collective" if one else self.transport.name,
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
        transport = WorkerTransport(self, step)
        run = StepInterpreter(self.index, args, transport, step, spans=[])
        with self.changed:
            self.runs = {s: r for s, r in self.runs.items() if s >= step - 1}
            self.runs[step] = run
            self.changed.notify_all()
        self.mailbox.drop_before(step)
        if self.channel is not None:
            self.channel.begin(step)
        if self.whole is not None:
            outputs = run.whole(self.whole)
            for r in self.wp.results:
                self.kept[(step, r)] = outputs[r]
        else:
            run.streams([self.wp.stream])
            run.updates()
            for r in self.wp.results:
                self.kept[(step, r)] = run.result(self.program.results[r])
        transport.timing["step_s"] = time.perf_counter() - clock
        transport.timing["placed"] = run.placements.moved
        if self.channel is not None:  # so far (its thread may still be sending this step's)
            transport.timing["collectives"] = self.channel.done
            transport.timing["collective_s"] = self.channel.seconds
        return {"timing": transport.timing, "spans": run.spans, "results": self._returned(step, returned, copied)}

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

    def _run_of(self, step: int) -> StepInterpreter:
        """The interpreter of `step`, once the step has started here (waited for)."""
        deadline = time.monotonic() + self.timeout
        with self.changed:
            while step not in self.runs:
                if time.monotonic() > deadline:
                    raise TransportError(f"{self.name}: step {step} did not start in {self.timeout:g} s")
                self.changed.wait(deadline - time.monotonic())
            return self.runs[step]

    def own_boxes(self, t, source) -> dict:
        """The collective transport's boxes of transfer `t` that this worker sends: unit op
        -> its box cut from `source` (None -> the whole value of an unplanned transfer)."""
        if t.plan is None:
            return {None: pack(None, source).array}
        ops = [k for k, op in enumerate(t.plan.ops) if self.wp.layout.owner(t.src_mesh, op.sender) == self.name]
        return dict(zip(ops, pack(t.plan, source, ops).boxes))

    def _moved_once(self, step: int, name: str) -> dict:
        """The collective transport's sender side of a value moved once: `own_boxes`, cut
        once the value is made (as `fetch` waits for it)."""
        t = self.index.transfers[name]
        run = self._run_of(step)
        return self.own_boxes(t, self.source(run.read(t.source, self.program.microbatches - 1, True, wait=True)))

    def fetch(self, step: int, name: str, m: int, once: bool, to: str | None = None):
        """A peer worker (`to`) pulls a transfer made on this mesh (a value moved once): the
        unit ops this worker sends it, once the value exists."""
        run = self._run_of(step)
        transfer = self.index.transfers[name]
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

        from hlopar.runtime import checkpoint

        try:
            item = Path(directory) / self.name
            data = checkpoint.load_part(item if item.is_dir() else Path(directory) / f"{self.name}.npz", keys)
            carry = {}
            for r in self.wp.results:
                if f"r{r}" in data:
                    carry[r] = data[f"r{r}"]
                elif f"r{r}.shape" in data:
                    sharding = self.made.get(self.program.results[r]) or self.landing[self.program.results[r]]
                    carry[r] = checkpoint.sharded_result(data, r, sharding, self.plan_id)
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
