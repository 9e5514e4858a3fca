"""The executor core: one step of a program's instruction streams on the meshes one process plays.

Every runtime runs a step with `StepInterpreter`: the local one plays every mesh in one
process (`local_executor.PipelinedStep`), a Ray worker plays its own mesh
(`ray_worker.MeshWorker`), the in-process runtime runs the plan's one executable
(`in_process.InProcessRuntime`). They differ only in their `Transport`: where a fragment
runs (and whether it is waited for), how a value moves between meshes, and what happens when
a value is read before it exists.

The value store holds a step's values by (value, microbatch), or (value, None) for one that
does not depend on the microbatch; the sums over microbatches apart (`sums`). The read rule
(`read`): a summed value read once (by an update) is its sum; an argument is the caller's,
cut per microbatch where it is a batch argument; a transfer's result that is moved once (a
sum, a parameter, a batch argument: not carried per microbatch by a SEND/RECV pair) is moved
by the transport when first read; anything else was made here, by a fragment or a RECV.

The instructions (`analysis.schedules.instructions`): RUN runs the fragments it names for its
microbatch (`fragment_calls.run_fragment`: the sums accumulate inside the executables, so
ACCUMULATE has nothing left to do); SEND and RECV are the transport's; FREE drops a
microbatch's stash (`fragment_calls.free_stash`); UPDATE ends a mesh's stream, after which
the update fragments run once, in program order, on the sums (`updates`).

No work per instruction beyond what the instruction says: nothing is copied or waited for
unless the transport does it (a Ray worker waits for each executable, to time it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hlopar.analysis.schedules import FREE, RECV, RUN, SEND
from hlopar.analysis.schedules.instructions import Instruction, MeshStream
from hlopar.analysis.schedules.timeline import COMPUTE, SEND_LANE
from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.one_program import fused_arguments
from hlopar.codegen.pipeline_program import UPDATE, PipelineProgram, ProgramFragment, ProgramTransfer
from hlopar.runtime.fragment_calls import Placements, free_stash, run_fragment

__all__ = ["ProgramIndex", "StepInterpreter", "Transport", "argument_origin", "value_layouts"]


class Transport(Protocol):
    """Where fragments run and how values move between meshes: what tells the in-process,
    local and Ray runtimes apart (module docstring). On Ray workers the collective
    transport is a channel behind `worker_transport.WorkerTransport`, not another one."""

    def executable(self, fragment: ProgramFragment) -> DeviceExecutable:
        """The executable that runs `fragment` on this process's devices of its mesh."""

    def launch(self, step: StepInterpreter, call: Callable[[], list]) -> list:
        """Runs one executable (`call` launches it and returns its outputs)."""

    def moves_once(self, transfer: ProgramTransfer, summed: bool) -> bool:
        """Whether the transfer's result is moved when first read (not received by a RECV)."""

    def move(self, step: StepInterpreter, transfer: ProgramTransfer, m: int, once: bool):
        """The result of a transfer moved once, for microbatch `m` (`once`: as the update reads it)."""

    def send(self, step: StepInterpreter, inst: Instruction) -> None:
        """A SEND: carries out the transfers it names (their sources exist)."""

    def receive(self, step: StepInterpreter, inst: Instruction) -> None:
        """A RECV: the transfers it names arrive in the store."""

    def unmade(self, step: StepInterpreter, v: int, m: int | None, ready: Callable[[], bool], wait: bool) -> None:
        """Value `v` of microbatch `m` (None: its sum) is read before it exists: waits until
        `ready()` where another thread makes it (`wait`: a peer's pull), else raises."""

    def made(self, step: StepInterpreter) -> None:
        """Values were made: wakes whoever waits for them."""


def argument_origin(program: PipelineProgram, v: int) -> int | None:
    """The argument a value is a copy of (through transfers), or None."""
    values = program.values
    while values[v].transfer is not None:
        v = program.transfers[values[v].transfer].source
    return values[v].argument


def value_layouts(
    program: PipelineProgram,
    executables: Mapping[str, DeviceExecutable],
    landing: dict[int, object] | None = None,
    made: dict[int, object] | None = None,
) -> tuple[dict[int, object], dict[int, object]]:
    """Where values land and are made, from the executables of the fragments played here
    (fragment name -> executable): value -> the layout its first reader reads it in
    (`landing`: where a copy is placed), value -> the layout its maker writes it in (`made`:
    where a restored result is placed). Entries already in `landing` / `made` stay."""
    landing = {} if landing is None else landing
    made = {} if made is None else made
    for fragment in program.fragments:
        ex = executables.get(fragment.name)
        if ex is None:
            continue
        offset = len(fragment.accumulate)
        for position, v in enumerate(fragment.operands):
            landing.setdefault(v, ex.input_shardings[offset + position])
        for position, v in enumerate(fragment.results):
            made.setdefault(v, ex.output_shardings[position])
    return landing, made


@dataclass(frozen=True)
class ProgramIndex:
    """A program as one process runs it, made once per runtime: its fragments and transfers
    by name, and the update fragments of `meshes` in program order."""

    program: PipelineProgram
    meshes: frozenset[str]
    fragments: Mapping[str, ProgramFragment]
    transfers: Mapping[str, ProgramTransfer]
    updates: tuple[ProgramFragment, ...]

    @classmethod
    def of(cls, program: PipelineProgram, meshes: Collection[str] | None = None) -> ProgramIndex:
        """`meshes`: the ones this process plays (default: all)."""
        meshes = frozenset(program.meshes if meshes is None else meshes)
        return cls(
            program,
            meshes,
            {f.name: f for f in program.fragments},
            {t.name: t for t in program.transfers},
            tuple(f for f in program.fragments if f.role == UPDATE and f.mesh in meshes),
        )


class StepInterpreter:
    """One step: the value store, the sums, the streams' progress (module docstring).
    `arguments`: @main's, by number (a sequence, or a mapping of the ones read here);
    `spans`: a list to record what ran and was sent, when (a Ray worker's timeline), or None;
    `log`: a list to record each instruction run (`<id> <instruction>`), or None."""

    def __init__(
        self,
        index: ProgramIndex,
        arguments: Sequence | Mapping[int, object],
        transport: Transport,
        step: int = 0,
        spans: list[tuple] | None = None,
        log: list[str] | None = None,
    ):
        self.index = index
        self.program = index.program
        self.arguments = arguments
        self.transport = transport
        self.step = step
        self.spans = spans  # (lane, kind, microbatch, peer, start, end), wall-clock seconds
        self.log = log
        self.slices: dict[int, list] = {}
        self.store: dict[tuple[int, int | None], object] = {}  # (value, microbatch or None) -> array
        self.sums: dict[int, object] = {}  # accumulated value -> running sum
        self.placements = Placements()  # arguments placed as the fragments read them, once per step
        self.stash_frees: dict[tuple[str, int], int] = {}  # (mesh, microbatch) -> its stages' stash FREEs run
        self.stream_done = False

    # -- values

    def argument(self, i: int, m: int, per_microbatch: bool):
        """Argument `i`, or its rows of microbatch `m` (dim 0 cut in equal parts, once)."""
        if not per_microbatch:
            return self.arguments[i]
        if i not in self.slices:
            full = np.asarray(self.arguments[i])
            size = self.program.argument_shapes[i][0]
            self.slices[i] = [full[k * size : (k + 1) * size] for k in range(self.program.microbatches)]
        return self.slices[i][m]

    def read(self, v: int, m: int, once: bool = False, wait: bool = False):
        """Value v of microbatch m (the read rule, module docstring); `once`: as the update
        reads it (a summed value's sum, others as the last microbatch made them); `wait`:
        values made here are waited for (a peer's pull, on a Ray worker)."""
        program = self.program
        value = program.values[v]
        if once and value.accumulated:
            if not self.stream_done:
                self.transport.unmade(self, v, None, lambda: self.stream_done, wait)
            return self.sums[v]
        transfer = program.transfers[value.transfer] if value.transfer is not None else None
        summed = once and transfer is not None and program.values[transfer.source].accumulated
        key = (v, m if value.per_microbatch and not summed else None)
        if key in self.store:
            return self.store[key]
        if value.argument is not None:
            array = self.argument(value.argument, m, value.per_microbatch)
        elif transfer is not None and self.transport.moves_once(transfer, summed):
            array = self.transport.move(self, transfer, m, once)
        else:  # made here by a fragment or a RECV
            self.transport.unmade(self, v, m, lambda: key in self.store, wait)
            return self.store[key]
        self.store[key] = array
        return array

    def result(self, v: int):
        """A result of the step (after `updates`): as the update reads it."""
        return self.read(v, self.program.microbatches - 1, once=True)

    # -- running

    def run_fragment(self, fragment: ProgramFragment, m: int) -> None:
        inputs = [self.read(v, m, once=fragment.role == UPDATE) for v in fragment.operands]
        ex = self.transport.executable(fragment)
        self.transport.launch(
            self,
            lambda: run_fragment(self.program, ex, fragment, inputs, m, self.sums, self.store, self.placements),
        )
        self.transport.made(self)

    def whole(self, ex: DeviceExecutable) -> list:
        """The step as one executable (`codegen.one_program`): every argument in, every result out."""
        began = time.time() if self.spans is not None else 0.0
        inputs = [self.arguments[i] for i in fused_arguments(self.program)]
        outputs = self.transport.launch(self, lambda: ex.run(self.placements.inputs(ex, inputs, 0, tuple(ex.donated))))
        if self.spans is not None:
            self.spans.append((COMPUTE, "other", None, "", began, time.time()))
        self.stream_done = True
        self.transport.made(self)
        return outputs

    def streams(self, streams: Sequence[MeshStream]) -> None:
        """Runs the streams of the meshes played here: repeatedly, mesh by mesh, the next
        instruction whose dependencies on these meshes have run (a RECV's on another mesh's
        SEND is the transport's to wait for)."""
        mine = self.index.meshes
        done: set[str] = set()
        cursors = {s.mesh: 0 for s in streams}
        pending = sum(len(s) for s in streams)
        while pending:
            progressed = False
            for stream in streams:
                instructions, position = stream.instructions, cursors[stream.mesh]
                while position < len(instructions):
                    inst = instructions[position]
                    if not all(d in done or d.rpartition(":")[0] not in mine for d in inst.deps):
                        break
                    self.execute(inst)
                    done.add(inst.id)
                    position += 1
                    pending -= 1
                    progressed = True
                cursors[stream.mesh] = position
            if not progressed:
                if len(streams) == 1:
                    inst = streams[0].instructions[cursors[streams[0].mesh]]
                    raise RuntimeError(f"{inst.id} waits for a later instruction of its own stream")
                stuck = {s.mesh: str(s.instructions[cursors[s.mesh]]) for s in streams if cursors[s.mesh] < len(s)}
                raise RuntimeError(f"the instruction streams deadlock at {stuck}")
        self.stream_done = True
        self.transport.made(self)

    def execute(self, inst: Instruction) -> None:
        """One instruction (module docstring); ACCUMULATE is done inside the executables
        that make the sums, UPDATE by `updates` after the streams."""
        began = time.time() if self.spans is not None else 0.0
        if self.log is not None:
            self.log.append(f"{inst.id} {inst.describe()}")
        op = inst.op
        if op == RUN:
            fragments = self.index.fragments
            for name in inst.executables:
                self.run_fragment(fragments[name], inst.microbatch)
        elif op == SEND:
            self.transport.send(self, inst)
        elif op == RECV:
            self.transport.receive(self, inst)
        elif op == FREE:
            free_stash(self.program, self.store, inst.mesh, inst.buffer, self.stash_frees)
        if self.spans is not None and op in (RUN, SEND):
            self.spans.append(
                (COMPUTE if op == RUN else SEND_LANE, inst.kind, inst.microbatch, inst.peer, began, time.time())
            )

    def updates(self) -> None:
        """The update fragments of the meshes played here, once, on the sums (values that do
        not depend on the microbatch: the last one's)."""
        last = self.program.microbatches - 1
        for fragment in self.index.updates:
            began = time.time() if self.spans is not None else 0.0
            self.run_fragment(fragment, last)
            if self.spans is not None:
                self.spans.append((COMPUTE, "other", None, "", began, time.time()))
