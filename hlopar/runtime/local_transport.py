"""The executor core's transport inside one process (`interpreter.Transport`): every mesh's
devices are this process's, so a fragment runs where its executable was compiled, without
waiting for it (jax's asynchronous dispatch), and a value moves between meshes as a copy
laid out as its first reader reads it. A `hlopar.cross_mesh_transfer` first runs its unit
ops device to device (`local_transfer.run_planned_transfer`), where `unit_ops`: the local
executor does, to prove plans; the in-process runtime copies the value to where its reader
reads it in one `jax.device_put` (the same bytes, without a trip through the host per
unit op: 8 ms a transfer on the tiny MLP's 2-stage plan). A SEND makes the copy at once
(its source exists when it is issued), a RECV checks that it came. Used by the local runtime
(`local_executor.PipelinedStep`, every mesh in one process) and the in-process one
(`in_process.InProcessRuntime`, the plan's one executable)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from jax.sharding import Sharding

from hlopar.analysis.schedules.instructions import Instruction
from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.pipeline_program import ProgramFragment, ProgramTransfer
from hlopar.runtime.interpreter import StepInterpreter
from hlopar.runtime.local_transfer import run_planned_transfer

__all__ = ["LocalTransport"]


class LocalTransport:
    """`executables`: fragment name -> its executable; `landing`: value -> the layout its
    first reader reads it in; `devices`: physical id -> device (a planned transfer's);
    `unit_ops`: carry out a planned transfer's unit ops (else one copy where a landing is
    known)."""

    def __init__(
        self,
        executables: Mapping[str, DeviceExecutable] | None = None,
        landing: Mapping[int, Sharding] | None = None,
        devices: Mapping[int, jax.Device] | None = None,
        unit_ops: bool = True,
    ):
        self.executables = executables or {}
        self.landing = landing or {}
        self.devices = devices or {}
        self.unit_ops = unit_ops

    def executable(self, fragment: ProgramFragment) -> DeviceExecutable:
        return self.executables[fragment.name]

    def launch(self, step: StepInterpreter, call: Callable[[], list]) -> list:
        return call()

    def moves_once(self, transfer: ProgramTransfer, summed: bool) -> bool:
        return summed or not transfer.streamed  # a sum, a parameter, a batch argument: on demand

    def move(self, step: StepInterpreter, transfer: ProgramTransfer, m: int, once: bool = False):
        """The transfer's result: its unit ops carried out device to device when it is planned,
        else a copy; placed as its first reader reads it (only returned: the host takes it)."""
        source = step.read(transfer.source, m, once)
        landing = self.landing.get(transfer.result)
        if transfer.plan is not None and (self.unit_ops or landing is None):
            source = run_planned_transfer(transfer.plan, source, self.devices)
        if landing is None:
            return source
        return jax.device_put(source, landing)

    def send(self, step: StepInterpreter, inst: Instruction) -> None:
        for name in inst.transfers:
            t = step.index.transfers[name]
            step.store[(t.result, inst.microbatch)] = self.move(step, t, inst.microbatch)

    def receive(self, step: StepInterpreter, inst: Instruction) -> None:
        for name in inst.transfers:
            if (step.index.transfers[name].result, inst.microbatch) not in step.store:
                raise RuntimeError(f"{inst.id}: microbatch {inst.microbatch}'s value was never sent")

    def unmade(self, step: StepInterpreter, v: int, m: int | None, ready: Callable[[], bool], wait: bool) -> None:
        if m is None:  # a sum: the updates run after every stream
            return
        value = step.program.values[v]
        if value.transfer is not None:
            raise RuntimeError(f"microbatch {m}'s value %{v} is read on {value.mesh} before the stream received it")
        raise RuntimeError(f"value %{v} of microbatch {m} is read before the fragment that makes it ran")

    def made(self, step: StepInterpreter) -> None:
        pass
