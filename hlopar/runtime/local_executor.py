"""The local runtime: a training step over B microbatches under a pipeline schedule, every
mesh played by one process on local devices.

`PipelinedStep` takes a split training step after `hlopar-stage-construction` (an MPMD
program whose forward and backward fragments run per microbatch and whose update fragments
run once), as codegen reads it (`codegen.pipeline_program`: the fragments' executable
modules, the transfers, the stage graph), compiles each fragment once for its mesh's
devices, and runs a step by following the instruction streams codegen makes for a schedule
(GPipe, 1F1B, eager-1F1B, eager-1F1B with backward weight delaying), bound to the program,
with the executor core (`interpreter.StepInterpreter`): one process plays every mesh,
taking, mesh by mesh, the next instruction whose dependencies have run; values move between
meshes in this process (`local_transport.LocalTransport`). It takes the step's ORIGINAL
arguments (the whole batch) and returns its results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jaxlib.mlir import ir

from hlopar.analysis.schedules import DEFAULT_SCHEDULE, PipelineStreams, get_schedule
from hlopar.codegen.executables import DeviceExecutable, compile_executable
from hlopar.codegen.pipeline_program import PipelineProgram, pipeline_program
from hlopar.runtime.interpreter import ProgramIndex, StepInterpreter, value_layouts
from hlopar.runtime.local_transport import LocalTransport
from hlopar.runtime.step_arguments import check_batch, step_arguments

__all__ = ["PipelinedStep", "run_pipelined"]


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
        self.index = ProgramIndex.of(self.program)
        # Where a copy lands: as the first fragment that reads it lays it out.
        self.landing, _ = value_layouts(self.program, self.executables)
        self.transport = LocalTransport(self.executables, self.landing, self.devices)

    # -- running

    def __call__(self, arguments: Sequence, schedule: str | None = None) -> list[np.ndarray]:
        """One step on the whole batch, following this step's streams or another schedule's."""
        return [np.asarray(r) for r in self.run(arguments, schedule)]

    def run(self, arguments: Sequence, schedule: str | None = None) -> list:
        """The same, its results left on their devices (`jax.Array`s, as the fragments made them)."""
        program = self.program
        arguments = step_arguments(arguments, len(program.argument_shapes), program.index_arg, program.microbatches)
        check_batch(program, arguments)
        streams = self.streams if schedule is None else self.streams_for(schedule)
        run = StepInterpreter(self.index, arguments, self.transport, log=[])
        self.last_log = run.log
        run.streams(streams.streams)
        run.updates()
        return [run.result(v) for v in program.results]


def run_pipelined(
    module: ir.Operation,
    arguments: Sequence,
    schedule: str = DEFAULT_SCHEDULE,
    devices: Mapping[int, jax.Device] | None = None,
) -> list[np.ndarray]:
    """Compiles and runs a pipelined split step once (see `PipelinedStep`)."""
    return PipelinedStep(module, schedule, devices)(arguments)
