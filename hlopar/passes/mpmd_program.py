"""Write a decided pipeline as an MPMD program in Shardy's `mpmd` dialect.

Given `@main` (a training step after `hlopar-import`), the stage and the role (forward,
backward, update) of each of its top-level ops, and the mesh of each stage, `@main` is
rewritten in place:

- a `topology` attribute names every mesh, `hlopar.devices` (docs/ir.md) gives their
  physical devices, and one `sdy.mesh` per mesh, named like its `mpmd` mesh, is the symbol
  every sharding of its stages refers to (in mesh tensor types and inside fragments);
- several stages may share a mesh (virtual stages: the meshes' names repeat, with equal
  shapes and devices): each keeps its fragments (`stage=k`) and its own intra-op plan, and a
  value one stage hands another of its mesh goes through an `mpmd.transfer` from the mesh to
  itself, which codegen takes as a hand-over (no SEND/RECV, docs/codegen.md);
- the ops of each (stage, role) go into one `mpmd.fragment` on the stage's mesh, in program
  order: forward `origin=["stage<k>"], stage=k`, backward `origin=["stage<k>"(1)], stage=k`
  (so both share the stage's mesh), update `origin=["stage<k>_update"]` with no `stage`
  (Shardy allows one fragment per mesh, stage and transpose count; updates are neither);
- a value read on another mesh than the one it lives on goes through one `mpmd.transfer`
  per destination mesh, placed just before the first fragment there that reads it;
- arguments live on the mesh of the first fragment that reads them (unused ones on the
  first mesh) and are transferred to the others; results are returned from where they live.

A pipeline runs, per microbatch, the forward of stages 0..S-1, then the backward of
S-1..0, and the updates last. A split in which an op reads a value that runs later in that
order (a backward op of stage 1 reading a backward value of stage 0: a stage cut inside a
block whose backward the layering kept together) can run as no pipeline: with `pipelined`
(the default) it is refused, naming the op's source line (`misordered_reads`), where the
runtime would otherwise find a value read before it is made.

Two choices keep the program well formed and small:

- A (stage, role) group whose ops are not contiguous can form a cycle with other groups
  (forward of stage 0 feeds stage 1, which feeds more forward ops of stage 0). Ops are then
  taken in program order and each joins the first fragment of its group that it can join
  without closing a cycle among fragments; otherwise it starts a new fragment of the group
  (same origin and stage: one stage then runs as several fragments, which Shardy's
  `mpmd-verify-stage-merging`, not in jaxlib, would reject). Fragments are emitted in a
  topological order, ties by their first op. Without cycles this is exactly one fragment
  per group. In a pipelined split only update groups can still cycle (the order check
  refuses the rest); they run once per step, in this order.
- Constants and iotas are not transferred: each fragment that reads one gets its own copy
  (a returned one also stays in its own group's fragment).

With `plan_shardings`, each stage's ops (all roles together, so that the layouts of the
values kept from forward to backward agree) are cut out into a function of their own and
planned by `hlopar-auto-sharding` on the stage's logical mesh. The fragments are built from
the planned ops, so the `sdy.sharding`s stay where the planner put them, and each value
crossing a fragment boundary has the layout the planner gave it (as a result where it is
made, as an argument where it is transferred to) in its mesh tensor type. A layout that
mesh tensor types cannot hold (not dividing the dimension) is written replicated. A
training state's old and new value (argument i and result i of one type) sit at equal
positions of the stage function, so the planner gives them one layout. Shardings already
in the input are not supported: they stay on the ops, naming the input's mesh.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import mpmd, sdy

from hlopar.analysis.mesh import quote_string
from hlopar.analysis.sharding import ShardingPerValue, TensorSharding
from hlopar.analysis.stages.ilp_pool import solve_all
from hlopar.dialect.attributes import ROLES
from hlopar.dialect.mpmd import TOPOLOGY_ATTR, build_fragment, write_devices
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, source_location
from hlopar.ir.extract import Extraction, clone_into, extract_function
from hlopar.ir.graph import FuncGraph, reaches
from hlopar.ir.module import main_func
from hlopar.passes.intra_op_plan import SDY_SHARDING, IntraOpOptions, ModulePlanning, start_planning

__all__ = [
    "FragmentSpec",
    "ProgramLayout",
    "StageMesh",
    "form_fragments",
    "is_floating",
    "layout_program",
    "misordered_reads",
    "write_mpmd_program",
]

# Ops that read nothing: each fragment that needs one gets its own copy.
FLOATING_OPS = frozenset({"stablehlo.constant", "stablehlo.iota"})


@dataclass(frozen=True)
class StageMesh:
    """One pipeline stage's mesh."""

    name: str  # "m0", "m1", ...
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]  # logical mesh shape
    devices: tuple[int, ...]  # physical device ids, logical order
    # More `IntraOpOptions` fields for this stage's plan (e.g. weight_update_sharding), as pairs.
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"mesh '{self.name}': axes {self.axis_names} and shape {self.shape} differ in length")
        if math.prod(self.shape) != len(self.devices):
            raise ValueError(
                f"mesh '{self.name}' of shape {self.shape} needs {math.prod(self.shape)} devices, "
                f"got {len(self.devices)}"
            )

    @property
    def size(self) -> int:
        return len(self.devices)

    def axes_text(self) -> str:
        """`<["x"=2, "y"=2]>`, as in `sdy.mesh` and `#mpmd.topology`."""
        return "<[" + ", ".join(f"{quote_string(n)}={s}" for n, s in zip(self.axis_names, self.shape)) + "]>"


# --------------------------------------------------------------------------- pure planning


def form_fragments(reads: Sequence[Iterable[int]], keys: Sequence[Hashable | None]) -> list[tuple[int, ...]]:
    """Groups ops by key into fragments whose dependency graph is acyclic.

    `reads[i]`: the ops whose results op `i` reads (all before `i`); `keys[i]`: its group,
    None for an op left out (reads of it are ignored). Ops are taken in order; each joins
    the first fragment of its group that does not reach (in the fragment graph) a fragment
    it reads from, else starts a new one. Returns the fragments' ops, in program order,
    fragments in a topological order (ties: lowest first op).
    """
    frag_of: dict[int, int] = {}
    members: list[list[int]] = []
    preds: list[set[int]] = []
    succs: list[set[int]] = []
    by_key: dict[Hashable, list[int]] = {}
    for op, key in enumerate(keys):
        if key is None:
            continue
        sources = {frag_of[r] for r in reads[op] if r in frag_of}
        chosen = None
        for candidate in by_key.get(key, ()):
            new = sources - preds[candidate] - {candidate}
            if not new or not reaches(succs.__getitem__, candidate, new):
                chosen = candidate
                break
        if chosen is None:
            chosen = len(members)
            members.append([])
            preds.append(set())
            succs.append(set())
            by_key.setdefault(key, []).append(chosen)
        members[chosen].append(op)
        frag_of[op] = chosen
        for source in sources - {chosen}:
            preds[chosen].add(source)
            succs[source].add(chosen)
    waiting = [len(p) for p in preds]
    ready = [(members[f][0], f) for f in range(len(members)) if not waiting[f]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, f = heapq.heappop(ready)
        order.append(tuple(members[f]))
        for g in succs[f]:
            waiting[g] -= 1
            if not waiting[g]:
                heapq.heappush(ready, (members[g][0], g))
    return order


def misordered_reads(
    reads: Sequence[Iterable[int]], stage_of_op: Sequence[int], roles: Sequence[str], left_out: Sequence[bool]
) -> list[tuple[int, int]]:
    """(reader, producer) pairs where the reader runs before the producer in every pipeline
    schedule: per microbatch the forward of stages 0..S-1, then the backward of S-1..0, and
    the updates once per step after all of them (ops of one stage and role run in program
    order). `reads[i]`: the ops whose results op i reads; `left_out[i]`: op i is copied
    into every fragment that reads it (a constant), so it is never late."""
    num_stages = max(stage_of_op, default=0) + 1

    def slot(i: int) -> int:
        role, stage = roles[i], stage_of_op[i]
        return stage if role == "forward" else 2 * num_stages - 1 - stage if role == "backward" else 2 * num_stages

    return [
        (i, p)
        for i in range(len(roles))
        if not left_out[i]
        for p in sorted(reads[i])
        if not left_out[p] and slot(p) > slot(i)
    ]


@dataclass(frozen=True)
class FragmentSpec:
    """One fragment to write: its ops and the values crossing its boundary (value ids)."""

    stage: int
    role: str
    ops: tuple[int, ...]  # top-level op indices, program order (a constant may be in several)
    inputs: tuple[int, ...]  # read from outside, in order of first use
    outputs: tuple[int, ...]  # read by other fragments or returned, in order of definition


@dataclass(frozen=True)
class ProgramLayout:
    """Fragments in execution order, and the stage each crossing value lives on first."""

    fragments: tuple[FragmentSpec, ...]
    home: Mapping[int, int]  # value id -> stage (arguments and fragment outputs)

    def stage_ops(self, stage: int) -> tuple[int, ...]:
        return tuple(sorted({op for f in self.fragments if f.stage == stage for op in f.ops}))

    def stage_outputs(self, stage: int, results: Iterable[int]) -> tuple[int, ...]:
        """Values made on `stage` that leave it: read on another stage, or returned."""
        elsewhere = {v for f in self.fragments if f.stage != stage for v in f.inputs} | set(results)
        return tuple(
            dict.fromkeys(
                v
                for f in self.fragments
                if f.stage == stage
                for v in f.outputs
                if v in elsewhere and self.home.get(v) == stage
            )
        )


def is_floating(op) -> bool:
    """Whether a top-level op is copied into each fragment that reads it (a constant, an
    iota) instead of making a value that crosses fragments."""
    return op.name in FLOATING_OPS and not op.operands and not op.regions


def _reads(graph: FuncGraph) -> tuple[list[set[int]], list[bool]]:
    """Per top-level op, the top-level ops whose results it (or an op nested in it) reads,
    and whether it floats (a constant or iota copied into each fragment that reads it)."""
    floating = [is_floating(op) for op in graph.ops]
    reads: list[set[int]] = []
    for index, op in enumerate(graph.ops):
        producers = {graph.values[v].producer for node in op.walk() for v in node.operands}
        producers.discard(None)
        producers.discard(index)
        reads.append(producers)
    return reads, floating


def layout_program(graph: FuncGraph, stage_of_op: Sequence[int], roles: Sequence[str]) -> ProgramLayout:
    """The fragments of the MPMD program for a given stage and role of every top-level op."""
    ops = graph.ops
    reads, floating = _reads(graph)
    keys = [None if floating[i] else (stage_of_op[i], roles[i]) for i in range(len(ops))]
    pieces = [list(p) for p in form_fragments(reads, keys)]
    piece_key = [keys[p[0]] for p in pieces]

    # Constants join the fragments that read them; a returned one also its own group's.
    for piece in pieces:
        piece.extend({r for op in piece for r in reads[op] if floating[r]})
    returned = set(graph.results)
    float_home: dict[int, int] = {}
    for index, op in enumerate(ops):
        if floating[index] and any(v in returned for v in op.results):
            key = (stage_of_op[index], roles[index])
            target = next((i for i, k in enumerate(piece_key) if k == key), None)
            if target is None:
                pieces.insert(0, [])
                piece_key.insert(0, key)
                float_home = {op_: i + 1 for op_, i in float_home.items()}
                target = 0
            if index not in pieces[target]:
                pieces[target].append(index)
            float_home[index] = target

    frag_of = {op: i for i, piece in enumerate(pieces) for op in piece if not floating[op]}
    frag_of.update(float_home)
    fragments = []
    home: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        piece.sort()
        inside = set(piece)
        stage, role = piece_key[i]
        inputs: dict[int, None] = {}
        outputs = []
        for index in piece:
            for node in ops[index].walk():
                for v in node.operands:
                    producer = graph.values[v].producer
                    if producer is None or producer not in inside:
                        inputs.setdefault(v)
            if frag_of.get(index) != i:
                continue  # a constant's copy: its value leaves from its home fragment only
            for v in ops[index].results:
                value = graph.values[v]
                if v in returned or any(frag_of.get(u, i) != i for u in value.users if not floating[u]):
                    outputs.append(v)
                    home[v] = stage
        fragments.append(FragmentSpec(stage, role, tuple(piece), tuple(inputs), tuple(outputs)))
    for arg in graph.args:
        home[arg] = next((f.stage for f in fragments if arg in f.inputs), 0)
    return ProgramLayout(tuple(fragments), home)


def tie_order(
    inputs: Sequence[int], outputs: Sequence[int], tied: Mapping[int, int], type_of: Mapping[int, str]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Orders a stage function's inputs and outputs for `hlopar-auto-sharding`, which gives
    result i the layout of argument i when their types match: tied pairs (input → output,
    the old and new value of a training state) first at equal positions, then the rest with
    equal types at equal positions avoided where possible."""
    pairs = [(i, tied[i]) for i in inputs if i in tied and tied[i] in outputs]
    paired_in, paired_out = {i for i, _ in pairs}, {o for _, o in pairs}
    rest_in = [i for i in inputs if i not in paired_in]
    rest_out = [o for o in outputs if o not in paired_out]
    ordered_out = []
    for position in range(len(rest_out)):
        clash = type_of[rest_in[position]] if position < len(rest_in) else None
        pick = next((o for o in rest_out if type_of[o] != clash), rest_out[0])
        rest_out.remove(pick)
        ordered_out.append(pick)
    return (tuple(i for i, _ in pairs) + tuple(rest_in), tuple(o for _, o in pairs) + tuple(ordered_out))


# --------------------------------------------------------------------------- IR plumbing


def write_mpmd_program(
    module: ir.Operation,
    stage_of_op: Sequence[int],
    roles: Sequence[str],
    meshes: Sequence[StageMesh],
    *,
    plan_shardings: bool = True,
    preset: str = "cpu",
    auto_sharding: Mapping[str, Any] | None = None,
    pipelined: bool = True,
) -> None:
    """Rewrites `@main` of `module` in place into an MPMD program (see the module docstring).

    `meshes[k]`: stage k's mesh (a name repeats where stages share it). `stage_of_op[i]` (an
    index into `meshes`) and `roles[i]` are those of top-level op i of
    `@main` (`FuncGraph` numbering). `auto_sharding`: more `IntraOpOptions` fields for the
    per-stage plans (e.g. `{"latency": (0.0, 0.0)}`). `pipelined=False` accepts a split that
    only runs fragment by fragment in program order (no pipeline schedule can run it).
    Raises `DiagnosticError` at the first op that reads a value made later in the pipeline.
    """
    main = main_func(module)
    graph = FuncGraph.from_func(main)
    _check_plan(graph, stage_of_op, roles, meshes)
    if pipelined:
        _check_order(graph, stage_of_op, roles)
    layout = layout_program(graph, stage_of_op, roles)
    with module.context, ir.Location.unknown():
        stages = [_Stage.build(graph, layout, t, mesh) for t, mesh in enumerate(meshes)]
        if plan_shardings:
            _plan_stages(graph, stages, preset, [{**(auto_sharding or {}), **dict(mesh.options)} for mesh in meshes])
        _add_meshes(module, _distinct(meshes))
        _write_main(module, main, graph, layout, stages, _distinct(meshes))
    module.verify()


def _plan_stages(graph: FuncGraph, stages: Sequence[_Stage], preset: str, options: Sequence[Mapping[str, Any]]) -> None:
    """Each stage's intra-op plan (stages on one device need none): every stage's ILPs built,
    then solved together (`ilp_pool.solve_all`: big ones side by side), then written."""
    planning = [
        (stage, stage.start_plan(preset, opts))
        for stage, opts in zip(stages, options, strict=True)
        if stage.extraction is not None and stage.mesh.size > 1
    ]
    problems = [(problem, plan.time_limit) for _, plan in planning if plan is not None for problem in plan.problems]
    solutions = iter(solve_all(problems))
    for stage, plan in planning:
        if plan is not None:
            plan.finish([next(solutions) for _ in plan.problems])
        stage.read_plan(graph)


def _check_plan(graph: FuncGraph, stage_of_op, roles, meshes) -> None:
    if len(stage_of_op) != len(graph.ops) or len(roles) != len(graph.ops):
        raise ValueError(
            f"@main has {len(graph.ops)} top-level ops; got {len(stage_of_op)} stages and {len(roles)} roles"
        )
    if not meshes:
        raise ValueError("no stage meshes")
    distinct = _distinct(meshes)
    devices = [d for m in distinct for d in m.devices]
    if len(set(devices)) != len(devices):
        raise ValueError("stage meshes must not share physical devices")
    for i, (stage, role) in enumerate(zip(stage_of_op, roles)):
        if not 0 <= stage < len(meshes):
            raise ValueError(f"op {i}: stage {stage} is not a mesh index (0..{len(meshes) - 1})")
        if role not in ROLES:
            raise ValueError(f"op {i}: role {role!r} is not one of {ROLES}")
    for v in (*graph.args, *graph.results):
        if graph.values[v].shape is None or not graph.values[v].type.startswith("tensor<"):
            raise ValueError(f"value {graph.values[v].type} of @main's signature is not a ranked tensor")


def _distinct(meshes: Sequence[StageMesh]) -> list[StageMesh]:
    """The meshes once each, in order of their first stage; stages that share a mesh name
    must give it the same axes, shape and devices (their intra-op options may differ)."""
    first: dict[str, StageMesh] = {}
    for mesh in meshes:
        seen = first.setdefault(mesh.name, mesh)
        if (seen.axis_names, seen.shape, seen.devices) != (mesh.axis_names, mesh.shape, mesh.devices):
            raise ValueError(
                f"stages on mesh '{mesh.name}' give it different axes, shapes or devices: "
                f"{seen.axis_names}={seen.shape} on {seen.devices}, {mesh.axis_names}={mesh.shape} on {mesh.devices}"
            )
    return list(first.values())


def _check_order(graph: FuncGraph, stage_of_op: Sequence[int], roles: Sequence[str]) -> None:
    reads, floating = _reads(graph)
    misordered = misordered_reads(reads, stage_of_op, roles, floating)
    if not misordered:
        return
    reader, producer = misordered[0]

    def what(i: int) -> str:
        op = graph.ops[i]
        named = f" ({op.location.name})" if op.location is not None and op.location.name else ""
        return f"the {roles[i]} op {op.name}{named} of stage {stage_of_op[i]}"

    more = len({i for i, _ in misordered}) - 1
    message = (
        f"{what(reader)} reads a value made by {what(producer)}, which a pipeline runs after it "
        "(forward stages in order, then backward stages in reverse, then updates): the stage cut "
        "separates ops that must run together" + (f" ({more} more op{'s' if more > 1 else ''} like it)" if more else "")
    )
    raise DiagnosticError(
        [
            Diagnostic(
                "error",
                message,
                source_location(graph.ops[reader].mlir_op.location),
                notes=(
                    Diagnostic(
                        "note", f"{what(producer)} is here", source_location(graph.ops[producer].mlir_op.location)
                    ),
                ),
            )
        ]
    )


def _add_meshes(module: ir.Operation, meshes: Sequence[StageMesh]) -> None:
    """One `sdy.mesh` per stage mesh, named like it, and `hlopar.devices`."""
    body = module.regions[0].blocks[0]
    existing = {
        ir.StringAttr(op.operation.attributes["sym_name"]).value: op.operation
        for op in body.operations
        if op.operation.name == "sdy.mesh"
    }
    first = body.operations[0] if len(body.operations) else None
    for mesh in meshes:
        attr = ir.Attribute.parse(f"#sdy.mesh{mesh.axes_text()}")
        if mesh.name in existing:
            if str(existing[mesh.name].attributes["mesh"]) != str(attr):
                raise ValueError(f"the module already has a different sdy.mesh @{mesh.name}")
            continue
        with ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(body):
            sdy.MeshOp(mesh.name, attr)
    write_devices(module, {mesh.name: mesh.devices for mesh in meshes})


@dataclass
class _Stage:
    """One stage's ops cut out into a function (planned or not), and the layouts found."""

    mesh: StageMesh
    extraction: Extraction | None
    ops: dict[int, ir.Operation]  # source op index -> op in the stage function
    values: dict[int, ir.Value]  # value id -> value in the stage function
    layouts: dict[int, TensorSharding]  # value id -> layout on this mesh (absent: replicated)
    # Top-level ops the planner added to the stage function (`sdy.sharding_constraint`s
    # before a consumer), by their results: cloned into each fragment whose ops read them.
    added: dict[ir.Value, ir.Operation] = field(default_factory=dict)

    @classmethod
    def build(cls, graph: FuncGraph, layout: ProgramLayout, stage: int, mesh: StageMesh) -> _Stage:
        """The stage's function extracted, not yet planned (`_plan_stages`)."""
        ops = layout.stage_ops(stage)
        if not ops:
            return cls(mesh, None, {}, {}, {})
        inputs = _stage_inputs(graph, layout, stage)
        outputs = layout.stage_outputs(stage, graph.results)
        types = {v: graph.values[v].type for v in (*inputs, *outputs)}
        inputs, outputs = tie_order(inputs, outputs, _tied(graph), types)
        extraction = extract_function(graph, ops, inputs=inputs, outputs=outputs)
        body = list(extraction.func.regions[0].blocks[0].operations)
        stage_ops = {index: body[k].operation for k, index in enumerate(extraction.ops)}
        values = dict(zip(inputs, extraction.func.regions[0].blocks[0].arguments))
        for index, op in stage_ops.items():
            values.update(zip(graph.ops[index].results, op.results))
        return cls(mesh, extraction, stage_ops, values, {})

    def start_plan(self, preset: str, options: Mapping[str, Any]) -> ModulePlanning | None:
        """The stage's intra-op ILPs built (`intra_op_plan.start_planning`), to be solved."""
        # The stage's mesh goes first: the planner plans on the first mesh of the right shape.
        module = self.extraction.module
        body = module.regions[0].blocks[0]
        for op in list(body.operations):
            op = op.operation
            if op.name == "sdy.mesh" and ir.StringAttr(op.attributes["sym_name"]).value == self.mesh.name:
                op.erase()
        with ir.InsertionPoint(body.operations[0]):
            sdy.MeshOp(self.mesh.name, ir.Attribute.parse(f"#sdy.mesh{self.mesh.axes_text()}"))
        # No partial sums: a value crossing fragments leaves reduced (a fragment's executable
        # hands its results on whole), and the stage plan does not know the fragments' cuts.
        options = {**dict(options), "partial_sums": False}
        return start_planning(  # the stage plan's warnings are dropped
            module,
            IntraOpOptions(mesh_shape=self.mesh.shape, axis_names=self.mesh.axis_names, preset=preset, **options),
            warn=lambda where, message: None,
        )

    def read_plan(self, graph: FuncGraph) -> None:
        """The layouts the stage's plan wrote, and the ops it added."""
        func = self.extraction.func
        kept = set(self.ops.values())
        for op in func.regions[0].blocks[0].operations:
            op = op.operation
            if op not in kept and op.name != "func.return":
                self.added.update((result, op) for result in op.results)
        parsed: dict[str, ShardingPerValue] = {}  # a stage's ops share a few hundred distinct shardings
        for index, op in self.ops.items():
            if SDY_SHARDING in op.attributes:
                text = str(op.attributes[SDY_SHARDING])
                per_value = parsed.get(text)
                if per_value is None:
                    per_value = parsed[text] = ShardingPerValue.parse(text)
                for v, sharding in zip(graph.ops[index].results, per_value):
                    self.layouts[v] = sharding
        # The stage's results leave as the plan returns them: a training state's new value in
        # its argument's layout (the plan ties the two and prices the conversion), not in the
        # layout of the op that computes it, so the next step reads it as it is.
        for key, values in (("arg_attrs", self.extraction.inputs), ("res_attrs", self.extraction.outputs)):
            if key in func.attributes:
                for v, attrs in zip(values, ir.ArrayAttr(func.attributes[key])):
                    attrs = ir.DictAttr(attrs)
                    if SDY_SHARDING in attrs:
                        self.layouts[v] = TensorSharding.parse(str(attrs[SDY_SHARDING]))

    def type_of(self, graph: FuncGraph, vid: int) -> ir.Type:
        value = graph.values[vid]
        if value.shape is None or not value.type.startswith("tensor<") or None in value.shape:
            raise ValueError(f"a value of type {value.type} crosses fragments; only static tensors can")
        tensor = ir.RankedTensorType(ir.Type.parse(value.type))
        sharding = _fitting(self.layouts.get(vid), self.mesh, tuple(tensor.shape))
        text = f"!mpmd.mesh_tensor<{quote_string(self.mesh.name)}, {tensor}"
        if sharding is not None:
            text += f", sharding=<{sharding.format_body()}>"
        return ir.Type.parse(text + ">")


def _stage_inputs(graph: FuncGraph, layout: ProgramLayout, stage: int) -> tuple[int, ...]:
    """Values the stage's fragments read and no op of the stage makes, in order of first use."""
    ops = set(layout.stage_ops(stage))
    return tuple(
        dict.fromkeys(
            v for f in layout.fragments if f.stage == stage for v in f.inputs if graph.values[v].producer not in ops
        )
    )


def _tied(graph: FuncGraph) -> dict[int, int]:
    """Argument i ↔ result i of equal type: the old and new value of a training state."""
    return {
        graph.args[i]: graph.results[i]
        for i in range(min(len(graph.args), len(graph.results)))
        if graph.values[graph.args[i]].type == graph.values[graph.results[i]].type
    }


def _fitting(sharding: TensorSharding | None, mesh: StageMesh, shape: tuple[int, ...]) -> TensorSharding | None:
    """The layout as a mesh tensor type holds it (whole axes of the mesh, each dimension
    divisible by its shard count), on the stage's mesh symbol; None for replicated."""
    if sharding is None or sharding.mesh_name != mesh.name:
        return None
    try:
        spec = sharding.to_spec()
    except ValueError:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    if spec.rank != len(shape) or any(a not in sizes for axes in spec.dims for a in axes):
        return None
    if any(dim % math.prod(sizes[a] for a in axes) for dim, axes in zip(shape, spec.dims)):
        return None
    if spec.is_replicated:
        return None
    return TensorSharding.from_spec(mesh.name, spec)


def _write_main(
    module,
    main: ir.Operation,
    graph: FuncGraph,
    layout: ProgramLayout,
    stages: Sequence[_Stage],
    meshes: Sequence[StageMesh],
) -> None:
    types: dict[tuple[int, int], ir.Type] = {}

    def type_on(vid: int, stage: int) -> ir.Type:
        if (vid, stage) not in types:
            types[vid, stage] = stages[stage].type_of(graph, vid)
        return types[vid, stage]

    home = layout.home
    arg_types = [type_on(a, home[a]) for a in graph.args]
    result_types = [type_on(v, home[v]) for v in graph.results]
    new_main = func_dialect.FuncOp("main", ir.FunctionType.get(arg_types, result_types), ip=ir.InsertionPoint(main))
    _copy_func_attrs(main, new_main.operation)
    topology = ", ".join(f"<{quote_string(m.name)} : {m.axes_text()}>" for m in meshes)
    new_main.operation.attributes[TOPOLOGY_ATTR] = ir.Attribute.parse(f"#mpmd.topology<{topology}>")
    entry = new_main.add_entry_block()
    on_mesh: dict[tuple[int, int], ir.Value] = {(a, home[a]): entry.arguments[i] for i, a in enumerate(graph.args)}

    def available(vid: int, stage: int) -> ir.Value:
        if (vid, stage) not in on_mesh:
            source = on_mesh[vid, home[vid]]
            on_mesh[vid, stage] = mpmd.TransferOp(type_on(vid, stage), source).result
        return on_mesh[vid, stage]

    with ir.InsertionPoint(entry):
        for spec in layout.fragments:
            stage = stages[spec.stage]
            operands = [available(v, spec.stage) for v in spec.inputs]
            fragment = build_fragment(
                [type_on(v, spec.stage) for v in spec.outputs], operands, spec.stage, spec.role, stage.mesh.name
            )
            block = fragment.regions[0].blocks.append(*[ir.Type.parse(graph.values[v].type) for v in spec.inputs])
            mapping = {stage.values[v]: arg for v, arg in zip(spec.inputs, block.arguments)}
            with ir.InsertionPoint(block):
                for index in spec.ops:
                    _clone_added(stage.ops[index], stage.added, mapping)
                    clone_into(stage.ops[index], mapping)
                mpmd.ReturnOp([mapping[stage.values[v]] for v in spec.outputs])
            for v, result in zip(spec.outputs, fragment.results):
                on_mesh[v, spec.stage] = result
        func_dialect.ReturnOp([on_mesh[v, home[v]] for v in graph.results])
    main.erase()


def _clone_added(op: ir.Operation, added: Mapping[ir.Value, ir.Operation], mapping: dict[ir.Value, ir.Value]) -> None:
    """Clones, before `op`, the planner-added ops whose results `op` (or an op nested in it)
    reads and that this fragment has no copy of yet (their own operands first)."""
    if not added:
        return
    needed: list[ir.Operation] = []

    def visit(inner: ir.Operation) -> ir.WalkResult:
        needed.extend(added[v] for v in inner.operands if v in added and v not in mapping)
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    for extra in needed:
        if extra.results[0] not in mapping:
            _clone_added(extra, added, mapping)
            clone_into(extra, mapping)


def _copy_func_attrs(old: ir.Operation, new: ir.Operation) -> None:
    """Everything but the signature; shardings of arguments and results now live in their types."""
    for name in old.attributes:
        if name in ("function_type", "sym_name"):
            continue
        attr = old.attributes[name]
        if name in ("arg_attrs", "res_attrs"):
            attr = ir.ArrayAttr.get(
                [
                    ir.DictAttr.get({n.name: n.attr for n in ir.DictAttr(d) if n.name != SDY_SHARDING})
                    for d in ir.ArrayAttr(attr)
                ]
            )
        new.attributes[name] = attr
