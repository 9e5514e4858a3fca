"""A plan run in the calling process, on devices its jax already holds.

`jax.jit` runs a program in the process that calls it, on that process's devices. So does
this runtime, where the plan allows it (`in_process_devices`): a local cluster (its hosts,
if several, simulated on this machine), no stacked layers cut into pieces, and a jax in this
process that sees the plan's devices (the devices of the cluster's kind, in order: the
plan's physical ids are indices into them, as a worker's are into its own). A plan of one
mesh that compiles as one executable (`codegen.one_program`: one stage, one microbatch) runs
as `jax.jit`'s program: each argument placed as the executable reads it
(`fragment_calls.Placements`: an array already so laid out is used as it is), one launch,
the results returned as `jax.Array`s on the devices without waiting for them (jax's
asynchronous dispatch). A pipelined plan runs every mesh's instruction stream here with the
executor core (`interpreter.StepInterpreter`, `local_transport.LocalTransport`: values move
between meshes as copies, planned transfers device to device), as the local runtime does,
its fragments dispatched without waiting. No worker process, no Ray call, nothing through
the object store; on one GPU host, also no second process claiming the GPUs this one's jax
has claimed.

The Ray runtime costs more than that even for one worker: the call and its reply, the
worker's bookkeeping, and the executable itself ran 1.03-1.05x slower in the worker than in
a driver in most runs on this project's 2-core machine (`tools/bench_runtime.py`,
docs/performance.md). `parallelize(runtime="ray")` keeps the workers anyway.

The executables are the ones planning compiled for its memory check
(`codegen.executable_cache`, held by the plan's cache; for a plan read from the plan cache,
loaded from disk, unless `HLOPAR_LOAD_EXECUTABLES=0`): the plan is compiled once. Host
callbacks (`jax.debug.print`, `io_callback`, ...) run here, and only here: the executables
are compiled with the lowering's Python functions, as `jax.jit` compiles them
(`codegen.pipeline_program` refuses them in a plan for Ray workers).

`save` writes what the Ray workers of the same plan write (a `<worker>.npz` per mesh of
whole results, named as `worker_layout` names the mesh's worker), so a save restores in
either runtime.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hlopar.analysis.schedules import DEFAULT_SCHEDULE
from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.runtime.interpreter import ProgramIndex, StepInterpreter, value_layouts
from hlopar.runtime.local_transport import LocalTransport
from hlopar.runtime.step_arguments import check_batch, step_arguments, wrap_keys
from hlopar.runtime.step_stats import StepStats

if TYPE_CHECKING:
    from hlopar.codegen.executable_cache import ExecutableCache

__all__ = ["InProcessRuntime", "in_process_devices"]


def in_process_devices(
    program: PipelineProgram, device_kind: str, *, local: bool, pieces: bool
) -> tuple[dict[int, jax.Device] | None, str]:
    """The devices of this process that would run `program` in it (module docstring), by
    the plan's physical id, or None and why not. `local`: the cluster is this machine (its
    hosts, if several, simulated: their devices are this process's too)."""
    if not local:
        return None, "the cluster is not this machine"
    if pieces:
        return None, "the plan cuts stacked layers into pieces"
    try:
        local = jax.devices(device_kind)
    except RuntimeError:
        local = []
    ids = sorted({d for mesh in program.meshes for d in program.devices[mesh]})
    if ids[-1] >= len(local):
        return None, (
            f"this process's jax sees {len(local)} {device_kind} device(s), the plan's meshes need {ids[-1] + 1}"
        )
    return {d: local[d] for d in ids}, ""


class InProcessRuntime:
    """The plan run here (module docstring); a `protocol.Runtime`. `devices`: physical id ->
    this process's device (`in_process_devices`); `schedule`: the pipeline schedule a plan
    of several meshes or microbatches runs under."""

    holds_workers = False
    restart_message = "loading the executables again"

    def __init__(
        self,
        program: PipelineProgram,
        devices: Mapping[int, jax.Device],
        schedule: str = DEFAULT_SCHEDULE,
        *,
        devices_per_host: int | None = None,
        log=None,
        phase=None,
        executables: ExecutableCache | None = None,
    ):
        from hlopar.codegen.executable_cache import ExecutableCache
        from hlopar.codegen.one_program import fuses
        from hlopar.runtime.mesh_processes import worker_layout

        self.program = program
        # What planning compiled (with the lowering's host callbacks): the executables it holds are the ones run.
        self.executables = executables if executables is not None else ExecutableCache()
        self.devices = dict(devices)
        self.mesh_devices = {mesh: [self.devices[d] for d in program.devices[mesh]] for mesh in program.meshes}
        self.whole = fuses(program)  # one executable for the whole step, as jax.jit's
        self.streams = None if self.whole else program.streams(schedule)
        # A save's parts are the plan's Ray workers' (`devices_per_host`: the cluster's
        # hosts), so that a save restores in either runtime.
        self.layout = worker_layout(program.devices, devices_per_host)
        self.plan_id = {device: d for d, device in self.devices.items()}
        self.log = log or (lambda message: None)
        self.phase = phase or (lambda name: None)
        self.executable = None  # the whole step's, or None (`fragments`)
        self.fragments: dict[str, DeviceExecutable] = {}
        self.made: dict[int, object] = {}  # value -> the layout its maker writes
        self.landing: dict[int, object] = {}  # value -> the layout its first reader reads
        self.index = ProgramIndex.of(program)
        self.transport = LocalTransport()
        self.step_id = 0
        self.last: list[jax.Array] = []  # the last step's results (what `save` writes)
        self.last_stats = None
        self.start_seconds: dict[str, float] = {}  # the last start's parts (`ParallelizedFunction.first_call`)
        self.placed = 0  # the last step's arguments placed (from the host, or moved to another layout)

    @property
    def alive(self) -> bool:
        return self.executable is not None or bool(self.fragments)

    def connect(self) -> None:
        """Nothing to reach: the devices are this process's."""

    def start(self) -> None:
        from hlopar.codegen.one_program import one_program

        self.phase("compiling")
        clock = time.perf_counter()
        program = self.program
        if self.whole:
            name = "+".join(f.name for f in program.fragments)  # as the memory check names it
            devices = self.mesh_devices[program.meshes[0]]
            self.executable = self.executables.executable(one_program(program), devices, name)
            self.made = dict(zip(program.results, self.executable.output_shardings))
            what, count = "the plan's one executable", len(devices)
        else:
            made = self.executables.executables(
                [(f.module, self.mesh_devices[f.mesh], f.name) for f in program.fragments]
            )
            self.fragments = {f.name: ex for f, ex in zip(program.fragments, made)}
            self.landing, self.made = value_layouts(program, self.fragments)
            # One copy per transfer, not its unit ops one by one (`LocalTransport`'s docstring).
            self.transport = LocalTransport(self.fragments, self.landing, self.devices, unit_ops=False)
            what, count = f"{len(self.fragments)} fragments of {len(program.meshes)} meshes", len(self.devices)
        hows = [event.how for event in self.executables.events[-max(1, len(self.fragments)) :]]
        how = ", ".join(f"{hows.count(h)} {h}" for h in dict.fromkeys(hows))
        seconds = time.perf_counter() - clock
        self.start_seconds = {f"executables ({how})": seconds}
        platform = next(iter(self.devices.values())).platform
        self.log(f"{what} for {count} {platform} device(s) of this process ({how}) in {seconds:.1f} s (no workers)")

    def shutdown(self) -> None:
        self.executable = None
        self.fragments = {}
        self.last = []

    def set_aside(self) -> None:
        """Another signature's runtime runs the calls for now: the last step's results, kept
        only for `save` (which saves the last call's), are let go, as `jax.jit` keeps no
        results."""
        self.last = []

    def run(self, arguments: Sequence, resident: Mapping[int, tuple[int, int]] | None = None) -> list[jax.Array]:
        """One step: @main's results, not waited for (`resident`: none, as it keeps no results)."""
        if not self.alive:
            raise RuntimeError("the runtime is not started")
        program = self.program
        arguments = step_arguments(arguments, len(program.argument_shapes), program.index_arg, program.microbatches)
        check_batch(program, arguments)
        clock, started = time.perf_counter(), time.time()
        run = StepInterpreter(self.index, arguments, self.transport)
        if self.executable is not None:
            outputs = run.whole(self.executable)
        else:  # every mesh's stream, played here (`local_executor`'s way)
            run.streams(self.streams.streams)
            run.updates()
            outputs = [run.result(v) for v in program.results]
        self.step_id += 1
        self.last = outputs
        # No worker, and the step is not waited for: its time is its dispatch's (placing the
        # arguments, the launches).
        self.last_stats = StepStats(time.perf_counter() - clock, started=started)
        self.placed = run.placements.moved
        return outputs

    def outputs(self, output: Sequence[jax.Array], leaves: Sequence, parts: Sequence[tuple[int, ...]]) -> list:
        """`fn`'s result leaves: @main's results (one per leaf), typed keys wrapped back."""
        return wrap_keys(output, leaves)

    def save(self, directory: str | Path, record: Mapping, values: Sequence[jax.Array] | None = None) -> dict:
        """Writes the last step's results (or `values`) into `directory` (a save's staging
        directory, `checkpoint.save`), a part per worker the plan has on Ray, each as that
        worker writes its own (`ray_worker.MeshWorker.save`: its mesh's results whole, or,
        for a mesh spanning hosts, its devices' shards); returns what the manifest says."""
        from hlopar.runtime.checkpoint import CheckpointError, write_part

        values = self.last if values is None else values
        if not values or any(x.is_deleted() for x in values):
            raise CheckpointError("the step's results were donated or deleted: nothing whole to save")
        meshes = self.result_meshes()
        parts = {}
        for name, slot in self.layout.slots.items():
            arrays = {}
            for r, x in enumerate(values):
                if meshes[r] != slot.mesh:
                    continue
                if not self.layout.spans(slot.mesh) or x.sharding.device_set != set(self.mesh_devices[slot.mesh]):
                    arrays[f"r{r}"] = np.asarray(x)  # whole (an argument passed through stays where it was)
                    continue
                arrays[f"r{r}.shape"] = np.array(x.shape, np.int64)
                for shard in x.addressable_shards:
                    if self.plan_id[shard.device] in slot.devices:
                        arrays[f"r{r}@{self.plan_id[shard.device]}"] = np.asarray(shard.data)
            parts[name] = write_part(directory, name, arrays, record)
        return {"results": meshes, "workers": self.worker_meshes(), "parts": parts}

    def result_meshes(self) -> dict[int, str]:
        """The mesh of each of @main's results (whose part of a save holds it)."""
        program = self.program
        return {r: program.values[v].mesh for r, v in enumerate(program.results)}

    def save_start(self, directory: str | Path, record: Mapping):
        """`save` in a thread (`parallelize(checkpoint_every=...)`): the host copies start
        now (`copy_to_host_async`, not waited for) and the call returns; the function
        returned waits for the thread and returns what `save` returns (or raises its error).
        Results donated to a later call before the thread read them fail the save."""
        values = list(self.last)
        for x in values:
            x.copy_to_host_async()
        answer: dict = {}

        def write():
            try:
                answer["written"] = self.save(directory, record, values)
            except Exception as error:  # noqa: BLE001 - raised by `finish`
                answer["error"] = error

        thread = threading.Thread(target=write, name="hlopar-save", daemon=True)
        thread.start()

        def finish() -> dict:
            thread.join()
            if "error" in answer:
                raise answer["error"]
            return answer["written"]

        return finish

    def worker_meshes(self) -> dict[str, str]:
        """The parts of a save, as the plan's Ray workers name theirs: each one's mesh."""
        return {name: slot.mesh for name, slot in self.layout.slots.items()}

    def load(self, directory: str | Path, keys: Sequence[str] = ()) -> list[jax.Array]:
        """What `save` wrote (here or by the plan's Ray workers; checked by the caller,
        `checkpoint.read_manifest`), laid out as the executables make it, as the results of
        a new step; nothing changes if a part cannot be read."""
        from hlopar.runtime.checkpoint import load_part, sharded_result

        data: dict[str, np.ndarray] = {}  # every part's arrays (their names do not collide)
        for name in self.layout.slots:
            item = Path(directory) / name
            data.update(load_part(item if item.is_dir() else Path(directory) / f"{name}.npz", keys))
        loaded = []
        meshes = self.result_meshes()
        for r, v in enumerate(self.program.results):
            # As the plan makes it; a result no executable makes (an argument passed through)
            # as its first reader reads it, else on its mesh's first device.
            sharding = self.made.get(v) or self.landing.get(v) or SingleDeviceSharding(self.mesh_devices[meshes[r]][0])
            if f"r{r}" in data:
                loaded.append(jax.device_put(data[f"r{r}"], sharding))
            else:  # a mesh spanning hosts: its workers' shards
                loaded.append(sharded_result(data, r, sharding, self.plan_id))
        self.last = loaded
        self.step_id += 1
        return self.last
