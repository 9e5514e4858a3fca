"""Run a training step over B microbatches in one process on local devices.

Two executors, both taking the step's ORIGINAL arguments (the whole batch) and returning its
results:

- `MicrobatchedStep`: no pipeline. The module as `hlopar-split-microbatches` wrote it is cut
  by `split_step` into the per-microbatch part and the update; the first is compiled to
  accumulate its sums in donated buffers (`accumulating_module`), runs on each batch slice
  in turn, and the update runs once on the sums.
- `PipelinedStep`: the same program after `hlopar-stage-construction` (an MPMD program whose
  forward and backward fragments run per microbatch and whose update fragments run once),
  as codegen reads it (`codegen.pipeline_program`: the fragments' executable modules, the
  transfers, the stage graph), executed by following the instruction streams codegen makes
  for a schedule (GPipe, 1F1B, eager-1F1B, eager-1F1B with backward weight delaying),
  bound to the program. One process plays every mesh: it repeatedly takes, mesh by mesh, the
  next instruction whose dependencies have run. RUN executes the fragments it names for that
  microbatch on the stage's devices (F: forward; B: backward, or its input-gradient half
  when split; W: the weight-gradient half); the values that leave the per-microbatch part
  (gradients, the loss's share) are summed inside those executables, in donated accumulators
  (per-example results: the microbatch's rows written at their place). SEND carries out the
  transfers it names for the microbatch (an `mpmd.transfer` is a copy; a `hlopar.cross_mesh_transfer` runs its
  unit ops device to device, `local_transfer.run_planned_transfer`), RECV checks they came;
  ACCUMULATE and FREE release what the schedule says is dead; UPDATE marks the end of a
  mesh's stream. When every stream has ended, the update fragments run once, in program
  order, on the sums. Values that do not depend on the microbatch (parameters moved to
  another mesh, sums moved to the update's mesh) are moved once, when first needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jaxlib.mlir import ir

from hlopar.analysis.schedules import DEFAULT_SCHEDULE, FREE, RECV, RUN, SEND, PipelineStreams, get_schedule
from hlopar.codegen.executables import DeviceExecutable, accumulating_module, compile_executable
from hlopar.codegen.pipeline_program import (
    UPDATE,
    PipelineProgram,
    ProgramFragment,
    ProgramTransfer,
    pipeline_program,
)
from hlopar.passes.base import PassContext
from hlopar.passes.split_microbatches import SplitMicrobatchesPass, read_split, split_step
from hlopar.runtime.fragment_calls import Placements, free_stash, run_fragment
from hlopar.runtime.local_transfer import run_planned_transfer
from hlopar.runtime.step_arguments import step_arguments

__all__ = ["MicrobatchedStep", "PipelinedStep", "run_microbatched", "run_pipelined"]


# --------------------------------------------------------------------------- no pipeline


class MicrobatchedStep:
    """A split training step compiled for `devices` (default: the first local device)."""

    def __init__(self, module: ir.Operation, devices: Sequence[jax.Device] | None = None):
        split = split_step(module)
        self.split = split
        self.devices = list(devices or jax.devices()[:1])
        outputs = range(split.num_sums)
        self.microbatch = compile_executable(accumulating_module(split.microbatch.module, list(outputs)), self.devices)
        self.update = compile_executable(split.update.module, self.devices)

    @property
    def microbatches(self) -> int:
        return self.split.microbatches

    def __call__(self, arguments: Sequence) -> list[np.ndarray]:
        split = self.split
        arguments = step_arguments(arguments, split.num_args, split.index_arg, split.microbatches)
        slices = _batch_slices(arguments, split.batch_args, split.argument_shapes, split.microbatches)
        sums = [
            jax.device_put(np.zeros(shape, dtype), sharding)
            for (shape, dtype), sharding in zip(
                self.microbatch.spmd.input_types[: split.num_sums], self.microbatch.input_shardings
            )
        ]
        fixed = {
            i: self.microbatch.place(split.num_sums + n, arguments[i])
            for n, i in enumerate(split.microbatch_args)
            if i not in split.batch_args
        }
        for k in range(split.microbatches):
            inputs = [slices[k][i] if i in split.batch_args else fixed[i] for i in split.microbatch_args]
            sums = self.microbatch.run(sums + inputs)
        results = self.update.run([arguments[i] for i in split.update_args] + sums)
        return [np.asarray(r) for r in results]


def run_microbatched(
    module: ir.Operation,
    arguments: Sequence,
    microbatches: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> list[np.ndarray]:
    """Runs a training step once over microbatches. `module` is either split already (by
    `hlopar-split-microbatches`) or a plain step, split here into `microbatches`."""
    return MicrobatchedStep(_split(module, microbatches), devices)(arguments)


def _split(module: ir.Operation, microbatches: int | None) -> ir.Operation:
    main = _entry(module)
    if "hlopar.microbatches" in main.attributes:
        if microbatches is not None and read_split(main)[0] != microbatches:
            raise ValueError(f"the module is split into {read_split(main)[0]} microbatches, not {microbatches}")
        return module
    if microbatches is None:
        raise ValueError("the module is not split into microbatches: give the number of microbatches")
    clone = module.clone()
    SplitMicrobatchesPass(microbatches=microbatches).run(clone, PassContext())
    return clone


def _batch_slices(arguments, batch_args, shapes, microbatches) -> list[dict[int, np.ndarray]]:
    """Per microbatch, its slice of every batch argument (rows k*b .. (k+1)*b of dim 0)."""
    slices: list[dict[int, np.ndarray]] = [{} for _ in range(microbatches)]
    for i in batch_args:
        full = np.asarray(arguments[i])
        size = shapes[i][0]
        if full.shape[0] != size * microbatches or tuple(full.shape[1:]) != tuple(shapes[i][1:]):
            raise ValueError(
                f"batch argument {i} has shape {full.shape}; {microbatches} microbatches of "
                f"{tuple(shapes[i])} make {(size * microbatches, *shapes[i][1:])}"
            )
        for k in range(microbatches):
            slices[k][i] = full[k * size : (k + 1) * size]
    return slices


# --------------------------------------------------------------------------- pipeline


class PipelinedStep:
    """A split training step after `hlopar-stage-construction` (and, optionally,
    `hlopar-cross-mesh-resharding`), compiled on local devices and run under a pipeline
    schedule (module docstring). Takes the program as codegen made it
    (`codegen.pipeline_program.PipelineProgram`), or the module, read here (its backwards
    split into B and W when the schedule delays weight gradients)."""

    def __init__(
        self,
        program: PipelineProgram | ir.Operation,
        schedule: str = DEFAULT_SCHEDULE,
        devices: Mapping[int, jax.Device] | None = None,
    ):
        if not isinstance(program, PipelineProgram):
            program = pipeline_program(program, split_backward=get_schedule(schedule).split_backward)
        self.program = program
        devices = dict(enumerate(jax.devices())) if devices is None else devices
        self.devices = devices
        self.mesh_devices = {name: [devices[d] for d in ids] for name, ids in program.devices.items()}
        self.streams: PipelineStreams = self.streams_for(schedule)
        self._compile()

    # what the program says
    microbatches = property(lambda self: self.program.microbatches)
    meshes = property(lambda self: list(self.program.meshes))
    fragments = property(lambda self: self.program.fragments)
    topology = property(lambda self: self.program.topology)
    stage_of_mesh = property(lambda self: self.program.stage_of_mesh)

    def streams_for(self, schedule: str) -> PipelineStreams:
        """The instruction streams of `schedule` on this program's stages."""
        return self.program.streams(schedule)

    def _compile(self) -> None:
        cache: dict[tuple[str, str], DeviceExecutable] = {}
        self.executables: dict[str, DeviceExecutable] = {}
        for fragment in self.program.fragments:
            key = (fragment.text, fragment.mesh)
            if key not in cache:
                cache[key] = compile_executable(fragment.module, self.mesh_devices[fragment.mesh])
            self.executables[fragment.name] = cache[key]
        self.compiled = len(cache)
        # Where a copy lands: as the first fragment that reads it lays it out.
        self.landing = {}
        for fragment in self.program.fragments:
            executable = self.executables[fragment.name]
            offset = len(fragment.accumulate)
            for position, v in enumerate(fragment.operands):
                self.landing.setdefault(v, executable.input_shardings[offset + position])

    # -- running

    def __call__(self, arguments: Sequence, schedule: str | None = None) -> list[np.ndarray]:
        """One step on the whole batch, following this step's streams or another schedule's."""
        return [np.asarray(r) for r in self.run(arguments, schedule)]

    def run(self, arguments: Sequence, schedule: str | None = None) -> list:
        """The same, its results left on their devices (`jax.Array`s, as the fragments made them)."""
        program = self.program
        arguments = step_arguments(arguments, len(program.argument_shapes), program.index_arg, program.microbatches)
        streams = self.streams if schedule is None else self.streams_for(schedule)
        run = _Run(self, arguments, streams)
        self.last_log = run.log
        run.streams()
        run.updates()
        return [run.read(v, program.microbatches - 1, once=True) for v in program.results]


class _Run:
    """The state of one step: values per microbatch, accumulators, the streams' progress."""

    def __init__(self, step: PipelinedStep, arguments: Sequence, streams: PipelineStreams):
        self.step, self.program, self.streams_ = step, step.program, streams
        program = step.program
        self.slices = _batch_slices(arguments, program.batch_args, program.argument_shapes, program.microbatches)
        self.arguments = arguments
        self.store: dict[tuple[int, int | None], object] = {}  # (value, microbatch or None) -> array
        self.sums: dict[int, jax.Array] = {}  # accumulated value -> running sum
        self.done: set[str] = set()
        self.log: list[str] = []
        self.placements = Placements()  # arguments placed as the fragments read them, once

    # values

    def read(self, v: int, m: int, once: bool = False):
        """Value v of microbatch m; `once`: as the update reads it (a summed value's sum,
        others as the last microbatch made them). Arguments, and copies of values that do not
        depend on the microbatch, are made on first use."""
        values = self.program.values
        value = values[v]
        if once and value.accumulated:
            return self.sums[v]
        transfer = self.program.transfers[value.transfer] if value.transfer is not None else None
        source = values[transfer.source] if transfer is not None else None
        summed = once and source is not None and source.accumulated
        key = (v, m if value.per_microbatch and not summed else None)
        if key in self.store:
            return self.store[key]
        if value.argument is not None:
            i = value.argument
            array = self.slices[m][i] if value.per_microbatch else self.arguments[i]
        elif transfer is not None and (summed or not transfer.streamed):
            array = self.copy(transfer, m, once)  # a sum, a parameter, a batch argument: on demand
        elif transfer is not None:
            raise RuntimeError(f"microbatch {m}'s value %{v} is read on {value.mesh} before the stream received it")
        else:
            raise RuntimeError(f"value %{v} of microbatch {m} is read before the fragment that makes it ran")
        self.store[key] = array
        return array

    def copy(self, transfer: ProgramTransfer, m: int, once: bool = False):
        """The transfer's result: its unit ops carried out device to device when it is planned
        (`hlopar.cross_mesh_transfer`), else a copy; placed as its first reader reads it."""
        source = self.read(transfer.source, m, once)
        if transfer.plan is not None:
            source = run_planned_transfer(transfer.plan, source, self.step.devices)
        landing = self.step.landing.get(transfer.result)
        if landing is None:  # only returned: the host takes it
            return source
        return jax.device_put(source, landing)

    def run_fragment(self, fragment: ProgramFragment, m: int) -> None:
        inputs = [self.read(v, m, once=fragment.role == UPDATE) for v in fragment.operands]
        run_fragment(
            self.program,
            self.step.executables[fragment.name],
            fragment,
            inputs,
            m,
            self.sums,
            self.store,
            self.placements,
        )

    # the streams

    def streams(self) -> None:
        streams = self.streams_.streams
        cursors = {s.mesh: 0 for s in streams}
        pending = sum(len(s) for s in streams)
        while pending:
            progressed = False
            for stream in streams:
                while cursors[stream.mesh] < len(stream):
                    inst = stream.instructions[cursors[stream.mesh]]
                    if not all(d in self.done for d in inst.deps):
                        break
                    self.execute(stream.mesh, inst)
                    self.done.add(inst.id)
                    cursors[stream.mesh] += 1
                    pending -= 1
                    progressed = True
            if not progressed:
                stuck = {s.mesh: str(s.instructions[cursors[s.mesh]]) for s in streams if cursors[s.mesh] < len(s)}
                raise RuntimeError(f"the instruction streams deadlock at {stuck}")

    def execute(self, mesh: str, inst) -> None:
        """One instruction, as codegen bound it to the program: a RUN runs the fragments it
        names, a SEND carries out the transfers it names (the data exist when it is issued),
        a RECV checks they arrived."""
        program = self.program
        self.log.append(f"{inst.id} {inst.describe()}")
        if inst.op == RUN:
            for name in inst.executables:
                self.run_fragment(program.fragment(name), inst.microbatch)
        elif inst.op == SEND:
            for name in inst.transfers:
                t = program.transfer(name)
                self.store[(t.result, inst.microbatch)] = self.copy(t, inst.microbatch)
        elif inst.op == RECV:
            for name in inst.transfers:
                if (program.transfer(name).result, inst.microbatch) not in self.store:
                    raise RuntimeError(f"{inst.id}: microbatch {inst.microbatch}'s value was never sent")
        elif inst.op == FREE:
            free_stash(self.program, self.store, mesh, inst.buffer)
        # ACCUMULATE: done inside the executables that make the sums; UPDATE: the update
        # fragments run after every stream (`updates`).

    def updates(self) -> None:
        last = self.program.microbatches - 1  # values that do not depend on the microbatch: the last one's
        for fragment in self.program.fragments:
            if fragment.role == UPDATE:
                self.run_fragment(fragment, last)


def run_pipelined(
    module: ir.Operation,
    arguments: Sequence,
    schedule: str = DEFAULT_SCHEDULE,
    devices: Mapping[int, jax.Device] | None = None,
) -> list[np.ndarray]:
    """Compiles and runs a pipelined split step once (see `PipelinedStep`)."""
    return PipelinedStep(module, schedule, devices)(arguments)


# --------------------------------------------------------------------------- helpers


def _entry(module: ir.Operation) -> ir.Operation:
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main":
            return op.operation
    raise ValueError("the module has no @main")
