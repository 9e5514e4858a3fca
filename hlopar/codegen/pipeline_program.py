"""A split, stage-constructed MPMD program as what a pipeline runtime needs: plain data.

`pipeline_program(module)` reads the program `hlopar-split-microbatches`,
`hlopar-stage-construction` and (optionally) `hlopar-cross-mesh-resharding` wrote, and
returns a `PipelineProgram`:

- its meshes and their physical devices (`hlopar.devices`);
- every value of `@main`, numbered: where it lives, whether there is one per microbatch
  (made by a forward or backward fragment, or a batch argument, or a copy of one) or one
  per step, and whether it is summed over microbatches (read once: by an update fragment,
  or returned);
- every fragment: its name (unique, e.g. `stage0_forward`), mesh, stage, role (`forward`
  `"stage<k>"`, `backward` `"stage<k>"(1)`, `update` `"stage<k>_update"`), operand and
  result values, FLOPs, and its executable module: the standalone module of
  `fragments.fragment_module`, turned by `executables.accumulating_module` into one that
  adds the results summed over microbatches into donated accumulators;
- the training state an update fragment takes in place: where `@main`'s argument is donated
  (the user's `donate_argnums`: `tf.aliasing_output = N`, `jax.buffer_donor`), the update
  fragment that reads it donates it (`executables.set_donation`): to its result that is
  `@main`'s result N when the layouts match, so the new state is written into the old
  state's buffers as `jax.jit` does, else to any result. Only where nothing reads the old
  value after that update: it is read by no other update fragment and not returned, and the
  copies of it on other meshes are read by no update fragment and not returned (forward and
  backward fragments run before every update of their own mesh, and a copy on another
  mesh is taken before that mesh's stream, which the update's mesh waits for);
- with `split_backward` (for backward weight delaying), each backward fragment cut by
  `weight_split.split_module` into B (role `backward`: what other stages read per
  microbatch, the input gradients) and W (role `weight`, `stage<k>_weight`: the results
  only the update reads or `@main` returns, the weight gradients, accumulated there); the
  values B hands to W are values of their own, numbered after all others;
- every transfer between meshes (`mpmd.transfer`, or a `hlopar.cross_mesh_transfer` decoded
  by `codegen.transfers`), named `t<i>`, with its bytes, and which SEND/RECV carries it;
- the stage graph (`PipelineTopology`): stages are the meshes of the per-microbatch
  fragments, an edge for each pair of stages that hand each other per-microbatch values,
  with the bytes each way and each stage's stash (what its backward reads of its forward's
  values and of the microbatch's examples).

`PipelineProgram.streams(schedule)` gives the instruction streams of a schedule on that
stage graph (`schedules.build_streams`), bound to the program: each RUN names the fragments
it runs (a whole-backward schedule's RUN B runs a split program's B and W fragments), each
SEND/RECV the transfers it carries. A runtime executes those and nothing else
(`hlopar.runtime.local_executor.PipelinedStep`); the simulator prices them
(`hlopar.codegen.bundle`).

Programs this refuses (`ProgramError`, located at the op): with several microbatches,
optimizer ('step') ops in a forward or backward fragment, per-example values in an update
fragment or reaching a result unplaced (with one, every fragment runs once and these are the
step's own values; with several, the split returns per-example results as sums of each
microbatch's rows placed in the whole batch, `passes.microbatching.per_example_results`, accumulated like
gradients); stages not numbered 0..S-1, meshes holding unequal numbers of stages, ops other
than fragments and transfers at the top level of `@main`.

Several stages on one mesh (virtual stages, `analysis.schedules.chunked`): the topology's
meshes repeat; a value passed between two stages of one mesh (an `mpmd.transfer` from the
mesh to itself, moved when first read) is a hand-over edge, carried by no SEND/RECV; the
streams' instructions name their stage, which binds a RUN to its stage's fragments and a
SEND/RECV to the transfers of its stage pair (`carried_stages`).

Host callbacks (`jax.debug.print`, `jax.debug.callback`, `io_callback`, `pure_callback`:
`hlopar.ir.host_callbacks`) call a Python function that lives only in the process that
lowered the step. A program holding one is read only for a caller that runs it in that
process (`pipeline_program(..., host_callbacks=True)`: `parallelize`'s in-process runtime),
and only where it is one mesh and one microbatch, which that runtime compiles as one
executable with the lowering's functions, calling each as `jax.jit` would (once per step,
or once per device where `partitioned=True`). Otherwise it would run on Ray workers, other
processes that do not hold the function, or per microbatch and stage (a pipelined plan in
that process: an `io_callback`'s answer would differ per microbatch): refused
(`ProgramError` at the callback's line, `host_callback_message`), never run to crash a
worker, and never dropped (a user's print lost, an `io_callback`'s effect skipped).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
from jaxlib.mlir import ir

from hlopar.analysis.flops import function_flops
from hlopar.analysis.mpmd import MeshTensorType
from hlopar.analysis.schedules import PipelineStreams, build_streams, get_schedule
from hlopar.analysis.schedules.instructions import RECV, RUN, SEND, Instruction, MeshStream
from hlopar.analysis.schedules.topology import Edge, PipelineTopology
from hlopar.codegen.executables import accumulating_module, set_donation
from hlopar.codegen.fragments import fragment_module, program_devices, program_topology
from hlopar.codegen.transfers import PlannedTransfer, planned_transfer
from hlopar.codegen.weight_split import split_module
from hlopar.dialect.attributes import BATCH, CROSS_MESH_TRANSFER, KIND_ATTR, STEP
from hlopar.dialect.mpmd import TRANSFER, fragment_mesh, fragment_role, fragment_stage, is_fragment
from hlopar.dialect.split import read_index_arg, read_split
from hlopar.ir.diagnostics import SourceLocation, source_location
from hlopar.ir.graph import FuncGraph, bit_width
from hlopar.ir.host_callbacks import callback_target, host_callbacks
from hlopar.ir.module import find_main, print_module
from hlopar.ir.signature import FuncSignature

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "UPDATE",
    "HostCallback",
    "PipelineProgram",
    "ProgramError",
    "ProgramFragment",
    "ProgramTransfer",
    "ProgramValue",
    "host_callback_message",
    "pipeline_program",
]

FORWARD, BACKWARD, WEIGHT, UPDATE = "forward", "backward", "weight", "update"
_RUN_ROLES = {"F": (FORWARD,), "B": (BACKWARD, WEIGHT), "W": (WEIGHT,)}  # a whole backward: B and W


class ProgramError(ValueError):
    """A program the pipeline runtime cannot run; `location` is where (an `ir.Location`)."""

    def __init__(self, message: str, location: ir.Location | None = None):
        super().__init__(message)
        self.location = location


@dataclass
class ProgramValue:
    """One value of `@main`: where it lives and how it is made."""

    mesh: str | None
    per_microbatch: bool  # one copy per microbatch (else one per step)
    nbytes: int
    accumulated: bool = False  # a sum over microbatches, read once
    producer: int | None = None  # fragment index
    transfer: int | None = None  # transfer index
    argument: int | None = None  # argument number


@dataclass
class ProgramFragment:
    """One `mpmd.fragment` and its executable module."""

    index: int  # position among the program's fragments
    name: str  # unique in the program; the bundle's file name
    mesh: str
    stage: int | None
    role: str  # forward, backward (B when split), weight (W), update
    operands: tuple[int, ...]  # value numbers
    results: tuple[int, ...]
    flops: float
    module: ir.Operation  # what the runtime compiles: @main(accumulators..., operands...)
    accumulate: tuple[int, ...] = ()  # result positions summed over microbatches (accumulators first)
    keep: tuple[int, ...] = ()  # of those, the ones per-microbatch code also reads as they are
    donated: dict[int, int | None] = field(default_factory=dict)  # operand position -> result it is donated to

    @property
    def text(self) -> str:
        return print_module(self.module)


@dataclass
class ProgramTransfer:
    """A value moved between meshes: a copy (`mpmd.transfer`) or planned unit ops."""

    index: int
    name: str  # t<index>
    source: int  # value numbers
    result: int
    src_mesh: str
    dst_mesh: str
    nbytes: int
    plan: PlannedTransfer | None = None  # None: an mpmd.transfer (a plain copy)
    streamed: bool = False  # carried per microbatch by a SEND/RECV pair (else copied once, when first read)
    shape: tuple[int, ...] = ()  # the global shape
    element: str = ""  # the element type, as MLIR prints it (f32, bf16, i1): for a receiver sent bytes


@dataclass(frozen=True)
class HostCallback:
    """A host callback op of the program: its call target and the user's line."""

    target: str
    location: SourceLocation | None


def host_callback_message(target: str, reason: str) -> str:
    """Why a program with a host callback cannot run where `reason` says it would."""
    return (
        f"host callback '{target}' (jax.debug.print, jax.debug.callback, io_callback or pure_callback) "
        f"calls a Python function of the process that lowered the step, and {reason}. "
        "hlopar runs it only where the plan runs in that process as one executable, as jax.jit runs it: one "
        "mesh and one microbatch on this machine (parallelize(..., method='shard', runtime='process'))"
    )


@dataclass
class PipelineProgram:
    """Everything a pipeline runtime reads of a planned program (module docstring)."""

    microbatches: int
    batch_args: tuple[int, ...]
    argument_shapes: tuple[tuple[int, ...], ...]
    meshes: tuple[str, ...]  # topology order
    devices: dict[str, tuple[int, ...]]  # physical ids per mesh, in the mesh's logical order
    values: list[ProgramValue]
    fragments: list[ProgramFragment]
    transfers: list[ProgramTransfer]
    results: tuple[int, ...]
    topology: PipelineTopology
    stage_of_mesh: dict[str, int]
    kept: frozenset[int]  # summed values whose per-microbatch copy other stages read too
    needed_once: frozenset[int]  # never freed with a microbatch (the update reads the last one's)
    carried: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)  # (src, dst) -> transfers
    # (src stage, dst stage) -> the transfers between meshes that carry what one hands the other
    carried_stages: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    stages_of_mesh: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a mesh's stages, in order
    split_backward: bool = False  # backwards cut into B and W fragments
    index_arg: int | None = None  # the microbatch index argument the split added (`dialect.split`)
    host_callbacks: tuple[HostCallback, ...] = ()  # run only in this process (module docstring)

    @property
    def mesh_of_stage(self) -> dict[int, str]:
        return {s: m for m, s in self.stage_of_mesh.items()}

    def fragment(self, name: str) -> ProgramFragment:
        for f in self.fragments:
            if f.name == name:
                return f
        raise KeyError(name)

    def transfer(self, name: str) -> ProgramTransfer:
        for t in self.transfers:
            if t.name == name:
                return t
        raise KeyError(name)

    def stage_fragments(self, stage: int, role: str) -> list[ProgramFragment]:
        """The fragments of a stage's forward or backward, in program order."""
        return [f for f in self.fragments if f.stage == stage and f.role == role]

    def stage_flops(self, stage: int) -> tuple[float, float]:
        """(forward, backward) FLOPs of a stage per microbatch; backward: B and W together."""
        return (
            sum(f.flops for f in self.stage_fragments(stage, FORWARD)),
            sum(f.flops for f in self.stage_fragments(stage, BACKWARD) + self.stage_fragments(stage, WEIGHT)),
        )

    def stage_weight_flops(self, stage: int) -> float:
        """FLOPs of a stage's W fragments per microbatch (0 unless split)."""
        return sum(f.flops for f in self.stage_fragments(stage, WEIGHT))

    def streams(self, schedule: str) -> PipelineStreams:
        """The instruction streams of `schedule` on this program's stages, bound to it: each
        RUN names the fragments it runs, each SEND/RECV the transfers it carries."""
        if get_schedule(schedule).split_backward and not self.split_backward:
            raise ValueError(
                f"schedule {schedule!r} splits backwards into input and weight gradients; the "
                "program's backward fragments are whole: read it with "
                "pipeline_program(module, split_backward=True)"
            )
        streams = build_streams(self.topology, schedule, self.microbatches)
        return PipelineStreams(
            streams.schedule,
            streams.num_microbatches,
            streams.split_backward,
            tuple(
                MeshStream(
                    s.mesh, s.stage, tuple(self._bind(i, streams.split_backward) for i in s.instructions), s.stages
                )
                for s in streams.streams
            ),
        )

    def _bind(self, inst: Instruction, split: bool) -> Instruction:
        if inst.op == RUN:
            roles = (BACKWARD,) if split and inst.kind == "B" else _RUN_ROLES[inst.kind]
            stage = self.stage_of_mesh[inst.mesh] if inst.stage is None else inst.stage
            names = tuple(f.name for f in self.fragments if f.stage == stage and f.role in roles)
            return replace(inst, executables=names)
        if inst.op in (SEND, RECV) and inst.stage is not None:
            pair = (inst.stage, inst.peer_stage) if inst.op == SEND else (inst.peer_stage, inst.stage)
            carried = self.carried_stages.get(pair, ())
            return replace(inst, transfers=tuple(self.transfers[t].name for t in carried))
        if inst.op in (SEND, RECV):
            src, dst = (inst.mesh, inst.peer) if inst.op == SEND else (inst.peer, inst.mesh)
            return replace(inst, transfers=tuple(self.transfers[t].name for t in self.carried.get((src, dst), ())))
        return inst

    def summary(self) -> dict:
        """The program as JSON-ready data (the bundle's `pipeline.json`)."""
        return {
            "microbatches": self.microbatches,
            "split_backward": self.split_backward,
            "batch_args": list(self.batch_args),
            "meshes": [
                {"mesh": m, "stage": self.stage_of_mesh.get(m), "devices": list(self.devices[m])} for m in self.meshes
            ],
            "stages": [
                {
                    "stage": k,
                    "mesh": self.topology.meshes[k],
                    "forward_flops": self.stage_flops(k)[0],
                    "backward_flops": self.stage_flops(k)[1],
                    "weight_flops": self.stage_weight_flops(k),
                    "stash_bytes": self.topology.activation_bytes[k],
                    "carry_bytes": self.topology.carry_bytes[k],
                }
                for k in range(self.topology.num_stages)
            ],
            "edges": [
                {"src": e.src, "dst": e.dst, "act_bytes": e.nbytes, "grad_bytes": e.backward_bytes}
                for e in self.topology.edges
            ],
            "fragments": [
                {
                    "name": f.name,
                    "mesh": f.mesh,
                    "stage": f.stage,
                    "role": f.role,
                    "file": f"meshes/{f.mesh}/{f.name}.mlir",
                    "operands": list(f.operands),
                    "results": list(f.results),
                    "accumulate": list(f.accumulate),
                    "keep": list(f.keep),
                    "donated": {str(p): r for p, r in f.donated.items()},
                    "flops": f.flops,
                }
                for f in self.fragments
            ],
            "transfers": [
                {
                    "name": t.name,
                    "source": t.source,
                    "result": t.result,
                    "src_mesh": t.src_mesh,
                    "dst_mesh": t.dst_mesh,
                    "bytes": t.nbytes,
                    "streamed": t.streamed,
                    "planned": t.plan is not None,
                    "predicted_time": t.plan.predicted_time if t.plan is not None else None,
                    "unit_ops": len(t.plan.ops) if t.plan is not None else None,
                }
                for t in self.transfers
            ],
            "results": list(self.results),
        }


def pipeline_program(
    module: ir.Operation, split_backward: bool = False, *, host_callbacks: bool = False
) -> PipelineProgram:
    """Reads a split, stage-constructed MPMD program (module docstring); `split_backward`
    cuts each backward into B and W fragments, as backward weight delaying runs them.
    `host_callbacks`: the caller runs a one-mesh, one-microbatch program in the process that
    lowered it, where its host callbacks live; otherwise a program with one is refused."""
    return _Reader(module, split_backward, host_callbacks).read()


class _Reader:
    def __init__(self, module: ir.Operation, split_backward: bool = False, host_callbacks: bool = False):
        self.module = module
        self.split_backward = split_backward
        self.runs_here = host_callbacks
        self.main = _entry(module)
        try:
            self.microbatches, self.batch_args = read_split(self.main)
        except ValueError as error:
            raise ProgramError(str(error), self.main.location) from None
        try:
            self.topology = program_topology(self.main)
            self.physical = program_devices(module, self.topology)
        except ValueError as error:
            raise ProgramError(str(error), self.main.location) from None
        self.values: list[ProgramValue] = []
        self.fragments: list[ProgramFragment] = []
        self.transfers: list[ProgramTransfer] = []
        self.ops: dict[int, ir.Operation] = {}  # fragment index -> mpmd.fragment
        self.names: dict[str, int] = {}
        self.carry_bytes: dict[int, int] = {}  # stage -> what its B fragments hand to W, per microbatch

    def read(self) -> PipelineProgram:
        callbacks = self._host_callbacks()
        block = self.main.regions[0].blocks[0]
        number: dict[ir.Value, int] = {}
        shapes = []
        for i, arg in enumerate(block.arguments):
            number[arg] = len(self.values)
            mesh, shape, nbytes = _mesh_tensor(arg)
            self.values.append(ProgramValue(mesh, i in self.batch_args, nbytes, argument=i))
            shapes.append(shape)
        results: tuple[int, ...] = ()
        for op in block.operations:
            op = op.operation
            if is_fragment(op):
                self._fragment(op, number)
            elif op.name in (TRANSFER, CROSS_MESH_TRANSFER):
                self._transfer(op, number)
            elif op.name == "func.return":
                results = tuple(number[v] for v in op.operands)
            else:
                raise ProgramError(
                    f"a pipeline cannot run '{op.name}' at the top level of @main "
                    "(expected mpmd.fragment, mpmd.transfer, hlopar.cross_mesh_transfer)",
                    op.location,
                )
        read_once, read_each = self._mark_accumulated(results)
        kept = frozenset(f.results[p] for f in self.fragments for p in f.keep)
        needed_once = frozenset(read_once | {t.result for t in self.transfers if self._origin(t.source) in read_once})
        self._donate_state(results)
        self._build_modules(read_once - read_each)
        mesh_of_stage = self._stages()
        stage_of_mesh: dict[str, int] = {}
        for k, mesh in sorted(mesh_of_stage.items()):
            stage_of_mesh.setdefault(mesh, k)  # a mesh's first stage
        carried, by_stage, local = self._carried(mesh_of_stage, kept)
        topology = self._stage_graph(mesh_of_stage, by_stage, local)
        return PipelineProgram(
            self.microbatches,
            self.batch_args,
            tuple(shapes),
            tuple(self.topology),
            dict(self.physical),
            self.values,
            self.fragments,
            self.transfers,
            results,
            topology,
            stage_of_mesh,
            kept,
            needed_once,
            carried,
            {pair: ts for pair, ts in by_stage.items() if mesh_of_stage[pair[0]] != mesh_of_stage[pair[1]]},
            {m: topology.stages_on(m) for m in topology.mesh_names},
            self.split_backward,
            read_index_arg(self.main),
            callbacks,
        )

    def _host_callbacks(self) -> tuple[HostCallback, ...]:
        """The program's host callbacks, where it may hold them (module docstring)."""
        ops = host_callbacks(self.main)
        if not ops:
            return ()
        if not self.runs_here:
            reason = "the plan runs on Ray workers: other processes, which do not hold it"
        elif len(self.topology) != 1 or self.microbatches != 1:
            reason = (
                f"the plan runs in {self.microbatches} microbatch(es) on {len(self.topology)} mesh(es), which would "
                "call it once per microbatch and stage, not once per step as jax.jit does"
            )
        else:
            return tuple(HostCallback(callback_target(op), source_location(op.location)) for op in ops)
        raise ProgramError(host_callback_message(callback_target(ops[0]), reason), ops[0].location)

    # -- ops

    def _fragment(self, op: ir.Operation, number: dict) -> None:
        mesh = fragment_mesh(op)
        origin = str(op.attributes["origin"])
        stage = fragment_stage(op)
        role = fragment_role(op)
        kinds = {
            ir.StringAttr(inner.attributes[KIND_ATTR]).value for inner in _ops_in(op) if KIND_ATTR in inner.attributes
        }
        if self.microbatches == 1:
            pass  # one microbatch: every fragment runs once per step, whatever it holds
        elif role == UPDATE:
            if BATCH in kinds:
                raise ProgramError(
                    f"update fragment on {mesh} ({origin}) holds per-example values: the stage "
                    "construction does not respect the microbatch split",
                    op.location,
                )
        elif STEP in kinds:
            raise ProgramError(
                f"{role} fragment of stage {stage} ({origin}) runs optimizer ('step') ops that must "
                "run once per step, on the summed gradients",
                op.location,
            )
        index = len(self.fragments)
        results = []
        for result in op.results:
            number[result] = len(self.values)
            results.append(len(self.values))
            self.values.append(ProgramValue(mesh, role != UPDATE, _mesh_tensor(result)[2], producer=index))
        self.ops[index] = op
        self.fragments.append(
            ProgramFragment(
                index,
                self._name(origin, role, index),
                mesh,
                stage,
                role,
                tuple(number[v] for v in op.operands),
                tuple(results),
                0.0,
                None,
            )
        )

    def _name(self, origin: str, role: str, index: int) -> str:
        found = re.search(r'"([^"]*)"', origin)
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", found.group(1)) if found and found.group(1) else f"fragment{index}"
        base = base.removesuffix("_update")
        name = f"{base}_{role}"
        count = self.names.get(name, 0) + 1
        self.names[name] = count
        return name if count == 1 else f"{name}_{count}"

    def _transfer(self, op: ir.Operation, number: dict) -> None:
        source = number[op.operands[0]]
        mesh, shape, nbytes = _mesh_tensor(op.results[0])
        element = str(_tensor_type(op.results[0]).element_type)
        plan = None
        if op.name == CROSS_MESH_TRANSFER:
            try:
                plan = planned_transfer(op, self.topology, self.physical)
            except ValueError as error:
                raise ProgramError(str(error), op.location) from None
        number[op.results[0]] = len(self.values)
        index = len(self.transfers)
        transfer = ProgramTransfer(
            index,
            f"t{index}",
            source,
            len(self.values),
            self.values[source].mesh,
            mesh,
            nbytes,
            plan,
            shape=shape,
            element=element,
        )
        self.transfers.append(transfer)
        self.values.append(ProgramValue(mesh, self.values[source].per_microbatch, nbytes, transfer=index))

    # -- what is summed over microbatches

    def _origin(self, v: int) -> int:
        while self.values[v].transfer is not None:
            v = self.transfers[self.values[v].transfer].source
        return v

    def _mark_accumulated(self, results: tuple[int, ...]) -> tuple[set[int], set[int]]:
        """Per-microbatch values read once (by an update fragment or as a result) are summed.
        Returns the values read once and those read per microbatch (by other fragments)."""
        read_once, read_each = set(), set()
        for fragment in self.fragments:
            for v in fragment.operands:
                (read_once if fragment.role == UPDATE else read_each).add(self._origin(v))
        read_once.update(self._origin(v) for v in results)
        for v in read_once:
            if self.values[v].argument in self.batch_args and self.microbatches > 1:
                raise ProgramError(
                    f"batch argument {self.values[v].argument} is read by an update fragment or returned",
                    self.main.location,
                )
        for fragment in self.fragments:
            if fragment.role == UPDATE:
                continue
            op = self.ops[fragment.index]
            returned = list(op.regions[0].blocks[0].operations)[-1].operands
            accumulate, keep = [], []
            for position, v in enumerate(fragment.results):
                if v not in read_once:
                    continue
                kind = _kind_of_returned(returned[position])
                if kind is None:
                    continue  # the same in every microbatch: the last one's is kept
                if kind == BATCH and self.microbatches > 1:  # one microbatch: its values are the step's
                    raise ProgramError(
                        f"a per-example value of the {fragment.role} fragment of stage "
                        f"{fragment.stage} is read by an update fragment or returned",
                        op.location,
                    )
                accumulate.append(position)
                if v in read_each:
                    keep.append(position)
                self.values[v].accumulated = True
            fragment.accumulate, fragment.keep = tuple(accumulate), tuple(keep)
        return read_once, read_each

    def _donate_state(self, results: tuple[int, ...]) -> None:
        """The donated arguments each update fragment consumes (module docstring), in its
        `donated`: operand position -> the position of the result that is the argument's
        `@main` result, or None (any result)."""
        signature = FuncSignature.of(self.main)
        donations = dict.fromkeys(sorted(signature.donors)) | {a: results[n] for a, n in signature.aliases}
        returned = {self._origin(v) for v in results}  # a copy returned counts as its argument
        read_by_updates = {u for f in self.fragments if f.role == UPDATE for u in f.operands}
        stage_meshes = {f.mesh for f in self.fragments if f.role != UPDATE}
        for arg, result in donations.items():
            v = arg  # arguments are the first values, in order
            readers = [f for f in self.fragments if v in f.operands]
            updates = [f for f in readers if f.role == UPDATE]
            copies = {t.result for t in self.transfers if self._origin(t.source) == v}
            if (
                len(updates) != 1
                or readers[-1] is not updates[0]
                or v in returned
                or copies & read_by_updates
                or (copies and updates[0].mesh not in stage_meshes)
            ):
                continue
            update = updates[0]
            made_here = (
                result is not None
                and self.values[result].producer == update.index
                and self.values[result].transfer is None
            )
            update.donated[update.operands.index(v)] = update.results.index(result) if made_here else None

    def _build_modules(self, only_once: set[int]) -> None:
        """Each fragment's executable module; with `split_backward`, a backward fragment
        becomes B and W (W makes the results in `only_once`), numbered in its place."""
        fragments: list[ProgramFragment] = []
        ops: dict[int, ir.Operation] = {}
        for fragment in self.fragments:
            op = self.ops[fragment.index]
            try:
                module = fragment_module(op, self.topology)
            except ValueError as error:
                raise ProgramError(str(error), op.location) from None
            parts = [(fragment, module)]
            if self.split_backward and fragment.role == BACKWARD:
                parts = self._split(fragment, module, only_once, str(op.attributes["origin"]))
            for part, module in parts:
                part.index = len(fragments)
                for v in part.results:
                    self.values[v].producer = part.index
                ops[part.index] = op
                part.flops = float(sum(function_flops(FuncGraph.from_module(module))))
                if part.accumulate:
                    module = accumulating_module(module, part.accumulate, part.keep)
                if part.donated:
                    part.donated = _set_donation(module, part.donated)
                part.module = module
                fragments.append(part)
        self.fragments, self.ops = fragments, ops

    def _split(
        self, whole: ProgramFragment, module: ir.Operation, only_once: set[int], origin: str
    ) -> list[tuple[ProgramFragment, ir.Operation]]:
        """B and W of a backward fragment (one of them alone when the other has no result)."""
        halves = split_module(module, [p for p, v in enumerate(whole.results) if v in only_once])
        extra = []  # carried values that are not results of the whole fragment: values of their own
        for j, nbytes in zip(halves.carried_from, halves.carried_bytes):
            if j >= len(halves.input_results):
                extra.append(len(self.values))
                self.values.append(ProgramValue(whole.mesh, True, nbytes))
        made_by_b = [whole.results[p] for p in halves.input_results] + extra
        carried = tuple(made_by_b[j] for j in halves.carried_from)
        self.carry_bytes[whole.stage] = self.carry_bytes.get(whole.stage, 0) + sum(halves.carried_bytes)

        def half(role: str, name: str, args, positions, operands: tuple = (), results: tuple = ()):
            return ProgramFragment(
                0,
                name,
                whole.mesh,
                whole.stage,
                role,
                tuple(whole.operands[a] for a in args) + operands,
                tuple(whole.results[p] for p in positions) + results,
                0.0,
                None,
                accumulate=tuple(j for j, p in enumerate(positions) if p in whole.accumulate),
                keep=tuple(j for j, p in enumerate(positions) if p in whole.keep),
            )

        parts = []
        if halves.input is not None:
            parts.append(
                (
                    half(BACKWARD, whole.name, halves.input_args, halves.input_results, results=tuple(extra)),
                    halves.input,
                )
            )
        if halves.weight is not None:
            parts.append(
                (
                    half(
                        WEIGHT,
                        self._name(origin, WEIGHT, whole.index),
                        halves.weight_args,
                        halves.weight_results,
                        operands=carried,
                    ),
                    halves.weight,
                )
            )
        return parts

    # -- the stage graph

    def _stages(self) -> dict[int, str]:
        """Each stage's mesh (one mesh per stage; a mesh may hold several stages)."""
        mesh_of_stage: dict[int, str] = {}
        for f in self.fragments:
            if f.stage is not None and mesh_of_stage.setdefault(f.stage, f.mesh) != f.mesh:
                raise ProgramError(
                    f"stage {f.stage} runs on meshes {mesh_of_stage[f.stage]} and {f.mesh}", self.ops[f.index].location
                )
        stages = sorted(mesh_of_stage)
        if stages != list(range(len(stages))):
            raise ProgramError(f"stages {stages} are not numbered 0..S-1", self.main.location)
        if not stages:
            raise ProgramError("the program has no forward or backward fragment (no stage)", self.main.location)
        held = {mesh: list(mesh_of_stage.values()).count(mesh) for mesh in mesh_of_stage.values()}
        if len(set(held.values())) != 1:
            raise ProgramError(f"meshes hold unequal numbers of stages: {held}", self.main.location)
        return mesh_of_stage

    def _reader_stage(self, t: ProgramTransfer) -> int | None:
        """The stage of the (forward or backward) fragments that read a transfer's result."""
        stages = {f.stage for f in self.fragments if f.stage is not None and t.result in f.operands}
        if len(stages) > 1:
            raise ProgramError(
                f"transfer {t.name} is read by stages {sorted(stages)} of mesh {t.dst_mesh}", self.main.location
            )
        return next(iter(stages), None)

    def _carried(self, mesh_of_stage: Mapping[int, str], kept: frozenset[int]):
        """The transfers of values a forward or backward makes per microbatch and another stage
        reads per microbatch (sums read only by the update are moved once, after the last
        microbatch): per (source mesh, destination mesh) those between meshes, per (source
        stage, destination stage) the same, and the stage pairs of one mesh (hand-overs)."""
        meshes = set(mesh_of_stage.values())
        several = len(meshes) < len(mesh_of_stage)
        first = {m: min(k for k, n in mesh_of_stage.items() if n == m) for m in meshes}
        carried: dict[tuple[str, str], list[int]] = {}
        by_stage: dict[tuple[int, int], list[int]] = {}
        local: dict[tuple[int, int], list[int]] = {}
        for t in self.transfers:
            source = self.values[t.source]
            if not (
                source.per_microbatch
                and source.producer is not None
                and t.src_mesh in meshes
                and t.dst_mesh in meshes
                and (not source.accumulated or t.source in kept)
            ):
                continue
            if several:
                src, dst = self.fragments[source.producer].stage, self._reader_stage(t)
            else:
                src, dst = first[t.src_mesh], first[t.dst_mesh]
            if t.src_mesh != t.dst_mesh:
                carried.setdefault((t.src_mesh, t.dst_mesh), []).append(t.index)
                t.streamed = True
                by_stage.setdefault((src, dst), []).append(t.index)
            elif src is not None and dst is not None and src != dst:
                local.setdefault((src, dst), []).append(t.index)
        return (
            {pair: tuple(ts) for pair, ts in carried.items()},
            {pair: tuple(ts) for pair, ts in by_stage.items()},
            {pair: tuple(ts) for pair, ts in local.items()},
        )

    def _stage_graph(self, mesh_of_stage: Mapping[int, str], by_stage, local) -> PipelineTopology:
        forward: dict[tuple[int, int], int] = {}
        backward: dict[tuple[int, int], int] = {}
        for (i, j), indices in list(by_stage.items()) + list(local.items()):
            size = sum(self.transfers[t].nbytes for t in indices)
            if i < j:
                forward[i, j] = forward.get((i, j), 0) + size
            else:
                backward[j, i] = backward.get((j, i), 0) + size
        edges = tuple(
            Edge(i, j, forward.get((i, j), 0), backward.get((i, j), 0)) for i, j in sorted(set(forward) | set(backward))
        )
        num_stages = len(mesh_of_stage)
        return PipelineTopology(
            num_stages,
            edges,
            self._stash_bytes(num_stages),
            meshes=tuple(mesh_of_stage[s] for s in range(num_stages)),
            carry_bytes=tuple(self.carry_bytes.get(k, 0) for k in range(num_stages)),
        )

    def _stash_bytes(self, num_stages: int) -> tuple[int, ...]:
        """Per stage, what its backward reads per microbatch of its own forward's results and of
        the microbatch's examples (received activations are counted as received buffers)."""
        stash = [0] * num_stages
        for k in range(num_stages):
            read = {v for f in self.fragments if f.stage == k and f.role in (BACKWARD, WEIGHT) for v in f.operands}
            for v in read:
                value = self.values[v]
                producer = self.fragments[value.producer] if value.producer is not None else None
                if (producer is not None and producer.stage == k and producer.role == FORWARD) or (
                    value.argument is not None and value.per_microbatch
                ):
                    stash[k] += value.nbytes
        return tuple(stash)


# --------------------------------------------------------------------------- helpers


def _entry(module: ir.Operation) -> ir.Operation:
    """`@main`, a located `ProgramError` without one."""
    main = find_main(module)
    if main is None:
        raise ProgramError("the module has no @main", module.location)
    return main


def _set_donation(module: ir.Operation, donated: Mapping[int, int | None]) -> dict[int, int | None]:
    """Marks the donations on the module, each pair whose types or layouts differ as a donor
    to any result instead; returns what was marked."""
    marked = {}
    for arg, result in donated.items():
        try:
            set_donation(module, {arg: result})
        except ValueError:
            set_donation(module, {arg: None})
            result = None
        marked[arg] = result
    return dict(sorted(marked.items()))


def _ops_in(op: ir.Operation) -> list[ir.Operation]:
    return [inner.operation for inner in op.regions[0].blocks[0].operations]


def _mesh_tensor(value: ir.Value) -> tuple[str, tuple[int, ...], int]:
    """(mesh, global shape, bytes) of a `!mpmd.mesh_tensor` value."""
    mesh_type = MeshTensorType.parse(str(value.type))
    tensor = _tensor_type(value)
    shape = tuple(tensor.shape)
    element_bytes = ((bit_width(tensor.element_type) or 32) + 7) // 8
    return mesh_type.mesh_name, shape, int(np.prod(shape, dtype=np.int64)) * element_bytes


def _tensor_type(value: ir.Value) -> ir.RankedTensorType:
    """The global tensor type of a `!mpmd.mesh_tensor` value."""
    mesh_type = MeshTensorType.parse(str(value.type))
    return ir.RankedTensorType(ir.Type.parse(mesh_type.tensor_type, context=value.type.context))


def _kind_of_returned(value: ir.Value) -> str | None:
    """`hlopar.microbatch` of the op that makes a fragment's returned value (None: a block
    argument or an op independent of the batch)."""
    if not isinstance(value, ir.OpResult):
        return None
    owner = value.owner
    return ir.StringAttr(owner.attributes[KIND_ATTR]).value if KIND_ATTR in owner.attributes else None
