"""A one-mesh plan run in the calling process, on devices its jax already holds.

`jax.jit` runs a program in the process that calls it, on that process's devices. So does
this runtime, where the plan allows it (`in_process_devices`): a local cluster of one host,
a plan of one mesh that compiles as one executable (`codegen.one_program`: one stage, one
microbatch), no stacked layers cut into pieces, and a jax in this process that sees the
mesh's devices (the devices of the cluster's kind, in order: the plan's physical ids are
indices into them, as a worker's are into its own). A step is then what `jax.jit`'s is:
each argument placed as the executable reads it (`fragment_calls.Placements`: an array
already so laid out is used as it is), one launch, the results returned as `jax.Array`s on
the devices without waiting for them (jax's asynchronous dispatch). No worker process, no
Ray call, nothing through the object store; on one GPU host, also no second process
claiming the GPUs this one's jax has claimed.

The Ray runtime costs more than that even for one worker: the call and its reply, the
worker's bookkeeping, and the executable itself ran 1.03-1.05x slower in the worker than in
a driver in most runs on this project's 2-core machine (`tools/bench_runtime.py`,
docs/performance.md). `parallelize(runtime="ray")` keeps the workers anyway.

The executable is the one planning compiled for its memory check (`codegen.executable_cache`,
held by the plan's cache; for a plan read from the plan cache, loaded from disk, unless
`HLOPAR_LOAD_EXECUTABLES=0`): the plan is compiled once. Host callbacks (`jax.debug.print`, `io_callback`, ...) run here, and only
here: the executable is compiled with the lowering's Python functions, as `jax.jit` compiles it
(`codegen.pipeline_program` refuses them in a plan for Ray workers).

`save` writes what a Ray worker of the same plan writes (`<worker>.npz` of whole results,
named as `worker_layout` names the mesh's worker), so a save restores in either runtime.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.runtime.interpreter import ProgramIndex, StepInterpreter
from hlopar.runtime.local_transport import LocalTransport
from hlopar.runtime.step_arguments import check_batch, step_arguments, wrap_keys
from hlopar.runtime.step_stats import StepStats

if TYPE_CHECKING:
    from hlopar.codegen.executable_cache import ExecutableCache

__all__ = ["InProcessRuntime", "in_process_devices"]


def in_process_devices(
    program: PipelineProgram, device_kind: str, *, one_host: bool, pieces: bool
) -> tuple[list[jax.Device] | None, str]:
    """The devices of this process that would run `program` in it (module docstring), or
    None and why not."""
    from hlopar.codegen.one_program import fuses

    if not one_host:
        return None, "the cluster is not this machine's one host"
    if pieces:
        return None, "the plan cuts stacked layers into pieces"
    if not fuses(program):
        return None, "the plan is not one mesh compiling as one executable (one stage, one microbatch)"
    try:
        local = jax.devices(device_kind)
    except RuntimeError:
        local = []
    ids = program.devices[program.meshes[0]]
    if max(ids) >= len(local):
        return None, (
            f"this process's jax sees {len(local)} {device_kind} device(s), the plan's mesh needs {max(ids) + 1}"
        )
    return [local[d] for d in ids], ""


class InProcessRuntime:
    """The plan's one executable, run here (module docstring); a `protocol.Runtime`."""

    holds_workers = False
    restart_message = "loading the executable again"

    def __init__(
        self,
        program: PipelineProgram,
        devices: Sequence[jax.Device],
        *,
        log=None,
        phase=None,
        executables: ExecutableCache | None = None,
    ):
        from hlopar.codegen.executable_cache import ExecutableCache
        from hlopar.runtime.mesh_processes import worker_layout

        self.program = program
        # What planning compiled (with the lowering's host callbacks): the executable it holds is the one run.
        self.executables = executables if executables is not None else ExecutableCache()
        self.devices = list(devices)
        self.mesh = program.meshes[0]
        self.name = worker_layout(program.devices).of_mesh(self.mesh)[0].name  # the Ray worker's, for saves
        self.log = log or (lambda message: None)
        self.phase = phase or (lambda name: None)
        self.executable = None
        self.index = ProgramIndex.of(program)
        self.transport = LocalTransport()  # one executable: nothing moves between meshes
        self.step_id = 0
        self.last: list[jax.Array] = []  # the last step's results (what `save` writes)
        self.last_stats = None
        self.start_seconds: dict[str, float] = {}  # the last start's parts (`ParallelizedFunction.first_call`)
        self.placed = 0  # the last step's arguments placed (from the host, or moved to another layout)

    @property
    def alive(self) -> bool:
        return self.executable is not None

    def connect(self) -> None:
        """Nothing to reach: the devices are this process's."""

    def start(self) -> None:
        from hlopar.codegen.one_program import one_program

        self.phase("compiling")
        clock = time.perf_counter()
        name = "+".join(f.name for f in self.program.fragments)  # as the memory check names it
        self.executable = self.executables.executable(one_program(self.program), self.devices, name)
        how = self.executables.events[-1].how
        seconds = time.perf_counter() - clock
        self.start_seconds = {f"executable ({how})": seconds}
        self.log(
            f"{how} the plan's one executable for {len(self.devices)} {self.devices[0].platform} "
            f"device(s) of this process in {seconds:.1f} s (no workers)"
        )

    def shutdown(self) -> None:
        self.executable = None
        self.last = []

    def set_aside(self) -> None:
        """Another signature's runtime runs the calls for now: the last step's results, kept
        only for `save` (which saves the last call's), are let go, as `jax.jit` keeps no
        results."""
        self.last = []

    def run(self, arguments: Sequence, resident: Mapping[int, tuple[int, int]] | None = None) -> list[jax.Array]:
        """One step: @main's results, not waited for (`resident`: none, as it keeps no results)."""
        if self.executable is None:
            raise RuntimeError("the runtime is not started")
        program = self.program
        arguments = step_arguments(arguments, len(program.argument_shapes), program.index_arg, program.microbatches)
        check_batch(program, arguments)
        clock, started = time.perf_counter(), time.time()
        run = StepInterpreter(self.index, arguments, self.transport)
        outputs = run.whole(self.executable)
        self.step_id += 1
        self.last = outputs
        # No worker, and the step is not waited for: its time is its dispatch's (placing the
        # arguments, the launch).
        self.last_stats = StepStats(time.perf_counter() - clock, started=started)
        self.placed = run.placements.moved
        return outputs

    def outputs(self, output: Sequence[jax.Array], leaves: Sequence, parts: Sequence[tuple[int, ...]]) -> list:
        """`fn`'s result leaves: @main's results (one per leaf), typed keys wrapped back."""
        return wrap_keys(output, leaves)

    def save(self, directory: str | Path, record: Mapping, values: Sequence[jax.Array] | None = None) -> dict:
        """Writes the last step's results (or `values`) into `directory` (a save's staging
        directory, `checkpoint.save`) as the plan's Ray worker writes its part; returns what
        the manifest says of it."""
        from hlopar.runtime.checkpoint import CheckpointError, write_part

        values = self.last if values is None else values
        if not values or any(x.is_deleted() for x in values):
            raise CheckpointError("the step's results were donated or deleted: nothing whole to save")
        part = write_part(directory, self.name, {f"r{r}": np.asarray(x) for r, x in enumerate(values)}, record)
        return {
            "results": {r: self.mesh for r in range(len(self.program.results))},
            "workers": self.worker_meshes(),
            "parts": {self.name: part},
        }

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
        """The one part of a save, as the plan's Ray worker names it."""
        return {self.name: self.mesh}

    def load(self, directory: str | Path, keys: Sequence[str] = ()) -> list[jax.Array]:
        """What `save` wrote (here or by a Ray worker of the plan; checked by the caller,
        `checkpoint.read_manifest`), laid out as the executable makes it, as the results of
        a new step."""
        from hlopar.runtime.checkpoint import load_part

        item = Path(directory) / self.name
        data = load_part(item if item.is_dir() else Path(directory) / f"{self.name}.npz", keys)
        self.last = [
            jax.device_put(data[f"r{r}"], sharding) for r, sharding in enumerate(self.executable.output_shardings)
        ]
        self.step_id += 1
        return self.last
