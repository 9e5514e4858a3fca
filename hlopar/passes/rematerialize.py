"""hlopar-rematerialize: a backward fragment recomputes the forward values it reads.

Stage-level rematerialization (Alpa's layer remat, at the granularity of a stage). In the
MPMD program `hlopar-stage-construction` writes (`passes.mpmd_program`), a stage's backward
fragment reads values its forward fragment computed (activations, softmax outputs, masks):
a pipeline keeps them on the mesh from F(m) to B(m) of each microbatch in flight, the
stash. Here every backward fragment marked `hlopar.remat` (stage construction marks those
it chose; with `all=true`, every backward fragment) instead recomputes them:

- the forward ops those values depend on are cloned at the top of the backward fragment
  (with their attributes: `sdy.sharding`, `hlopar.microbatch`), back to the stage's inputs,
  the values its forward fragments read that no forward op of the stage makes (received
  activations, parameters, the microbatch's examples); the backward takes those inputs as
  operands of its own;
- a stage whose forward runs as several fragments (`mpmd_program.form_fragments`) is
  recomputed across them, from the inputs of the whole stage;
- the forward fragments then return only what some other op still reads (results no one
  reads are dropped, with the ops that only they needed).

A schedule therefore stashes only the stage's inputs between F and B
(`codegen.pipeline_program` counts a stage's stash as what its backward reads of its
forward's results and of the microbatch's examples; received activations are held until
B anyway), and B runs one more forward (its FLOPs, hence its simulated time, include it).

Random numbers: `stablehlo.rng_bit_generator` and the threefry arithmetic JAX emits are
functions of their operands, so a clone draws the forward's numbers. Ops whose result is
not a function of their operands (`stablehlo.rng`, a stateful generator in XLA; custom calls
with side effects; sends, receives, in/outfeeds, collectives) are never cloned: the forward
returns their results and the backward reads them as before (stashed), with a warning.

Per layer (`hlopar.remat = "layers"`, as `jax.checkpoint` around each layer does it): the
stage's ops carry their layer (`hlopar.layer`, which stage construction keeps on the stages
it marks so). A value of layer a that an op of a later layer reads (a layer boundary) is
stashed as made; every other forward value the backward reads is recomputed by a slice of
its own layer's ops, from the stage's inputs and the boundary values. Each layer's slice is
placed just before the first backward op that reads one of its values, behind a
`stablehlo.optimization_barrier` over the values the slice reads together with the values
earlier backward ops computed for that layer's backward ops (the cotangent arriving at the
layer): XLA cannot hoist the recompute above the backward's progress, so the backward holds
one layer's activations of one microbatch at a time, not the whole stage's. The stash is the
stage's inputs plus the boundary values the recomputes or the backward read.

`recompute_slice` is the choice over plain data (which values each op reads and defines),
`layer_slices` the per-layer one over it; the pass adapts fragments to them and rewrites
them. The backward keeps its mark (`all=true` sets the unit one), so running the pass again
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import mpmd, stablehlo

from hlopar.analysis.mesh import quote_string
from hlopar.dialect.attributes import LAYER_ATTR, REMAT_ATTR, REMAT_LAYERS, REMAT_STAGE
from hlopar.dialect.mpmd import fragment_mesh, fragment_role, fragment_stage, fragments, reshaped_fragment
from hlopar.ir.extract import clone_into
from hlopar.ir.module import planned_functions
from hlopar.passes.base import ModulePass, PassContext, option

__all__ = [
    "LayerRecompute",
    "Recompute",
    "RematerializePass",
    "fill_layers",
    "layer_slices",
    "recompute_slice",
    "remat_form",
]

# Ops whose results are not a function of their operands (or that talk to the outside):
# computing them again would not give the forward's values.
NOT_RECOMPUTED = frozenset(
    {
        "stablehlo.rng",
        "stablehlo.send",
        "stablehlo.recv",
        "stablehlo.infeed",
        "stablehlo.outfeed",
        "stablehlo.all_gather",
        "stablehlo.all_reduce",
        "stablehlo.all_to_all",
        "stablehlo.collective_broadcast",
        "stablehlo.collective_permute",
        "stablehlo.reduce_scatter",
        "stablehlo.partition_id",
        "stablehlo.replica_id",
    }
)


# --------------------------------------------------------------------------- pure planning


@dataclass(frozen=True)
class Recompute:
    """What a backward recomputes: forward ops to clone and what the clones read."""

    ops: tuple[int, ...]  # ops to clone, program order
    inputs: tuple[int, ...]  # values no op defines that the clones or the backward need, ascending
    kept: tuple[int, ...]  # needed values made by ops that cannot be cloned (still read as made), ascending


def recompute_slice(
    reads: Sequence[Iterable[int]], defines: Sequence[Iterable[int]], clonable: Sequence[bool], wanted: Iterable[int]
) -> Recompute:
    """The ops (program order, a topological order; `reads[i]`/`defines[i]` the values op i
    reads and defines) that recompute the `wanted` values from values no op defines: every
    op a wanted value depends on, stopping at ops that are not `clonable`, whose needed
    results are `kept`. Ops defining nothing are never needed."""
    reads = [tuple(r) for r in reads]
    defines = [tuple(d) for d in defines]
    if not len(reads) == len(defines) == len(clonable):
        raise ValueError(f"{len(reads)} read lists, {len(defines)} define lists, {len(clonable)} flags")
    needed = set(wanted)
    cloned, kept = [], set()
    for i in reversed(range(len(reads))):
        made = needed.intersection(defines[i])
        if not made:
            continue
        if clonable[i]:
            cloned.append(i)
            needed.update(reads[i])
        else:
            kept.update(made)
    defined = {v for d in defines for v in d}
    return Recompute(tuple(reversed(cloned)), tuple(sorted(needed - defined)), tuple(sorted(kept)))


@dataclass(frozen=True)
class LayerRecompute:
    """What a backward recomputes layer by layer."""

    slices: tuple[tuple[int, Recompute], ...]  # (layer, its slice), layers descending: the backward's order
    stashed: tuple[int, ...]  # wanted values that are layer boundaries: read as made, ascending


def fill_layers(
    reads: Sequence[Iterable[int]], defines: Sequence[Iterable[int]], layers: Sequence[int | None]
) -> list[int]:
    """`layers` with the ops that have none (the sharding constraints stage construction adds)
    given one: the latest layer among the ops whose values they read, else the earliest among
    the ops that read theirs, else the lowest layer there is (0 when none)."""
    reads = [tuple(r) for r in reads]
    defines = [tuple(d) for d in defines]
    filled = list(layers)
    producer: dict[int, int] = {}
    for i, layer in enumerate(filled):
        if layer is None:
            known = [producer[v] for v in reads[i] if v in producer]
            filled[i] = max(known) if known else None
        if filled[i] is not None:
            producer.update(dict.fromkeys(defines[i], filled[i]))
    reader: dict[int, int] = {}
    for i in reversed(range(len(filled))):
        if filled[i] is None:
            known = [reader[v] for v in defines[i] if v in reader]
            filled[i] = min(known) if known else None
        if filled[i] is not None:
            for v in reads[i]:
                reader[v] = min(reader.get(v, filled[i]), filled[i])
    lowest = min((layer for layer in filled if layer is not None), default=0)
    return [lowest if layer is None else layer for layer in filled]


def layer_slices(
    reads: Sequence[Iterable[int]],
    defines: Sequence[Iterable[int]],
    clonable: Sequence[bool],
    layers: Sequence[int],
    wanted: Iterable[tuple[int, int | None]],
) -> LayerRecompute:
    """Per-layer recompute of the `wanted` values, given as (value, layer of the op reading it,
    None when unknown), over the ops of `recompute_slice` with their `layers`. A value of layer a
    read by an op of a later layer (the forward's, or a wanted one's reader) is a boundary:
    never recomputed, every slice reads it as an input. Every other wanted value made by an op
    is recomputed by its layer's slice, cloning only that layer's ops; values of other layers
    that are not boundaries (a layering out of program order) and results of ops that cannot be
    cloned are `kept`. Ops computing from no input (constants, what is made of them alone) are
    no layer's: never boundaries, cloned by every slice that needs them."""
    reads = [tuple(r) for r in reads]
    defines = [tuple(d) for d in defines]
    if len(layers) != len(reads):
        raise ValueError(f"{len(reads)} read lists, {len(layers)} layers")
    wanted = list(wanted)
    constant: set[int] = set()
    free = [False] * len(reads)
    for i, r in enumerate(reads):
        free[i] = clonable[i] and all(v in constant for v in r)
        if free[i]:
            constant.update(defines[i])
    layer_of = {v: layers[i] for i, d in enumerate(defines) for v in d if v not in constant}
    boundary = {v for i, r in enumerate(reads) for v in r if v in layer_of and layer_of[v] < layers[i]}
    boundary |= {v for v, reader in wanted if v in layer_of and reader is not None and layer_of[v] < reader}
    unstashed = [tuple(v for v in d if v not in boundary) for d in defines]  # boundaries: inputs to every slice
    values = {v for v, _ in wanted}
    owner = {v: layer_of[v] for v in values - boundary if v in layer_of}
    owner.update({v: reader for v, reader in wanted if v in constant and reader is not None})  # its reader's
    slices = []
    for layer in sorted(set(owner.values()), reverse=True):
        mine = sorted(v for v, l in owner.items() if l == layer)
        ours = [ok and (l == layer or idle) for ok, l, idle in zip(clonable, layers, free)]
        slices.append((layer, recompute_slice(reads, unstashed, ours, mine)))
    return LayerRecompute(tuple(slices), tuple(sorted(values & boundary)))


def remat_form(fragment: ir.Operation) -> str | None:
    """The form a backward fragment's mark asks for (None: unmarked); ValueError for another."""
    if REMAT_ATTR not in fragment.attributes:
        return None
    attr = fragment.attributes[REMAT_ATTR]
    if isinstance(attr, ir.UnitAttr):
        return REMAT_STAGE
    if isinstance(attr, ir.StringAttr) and attr.value in (REMAT_STAGE, REMAT_LAYERS):
        return attr.value
    raise ValueError(f'{REMAT_ATTR} must be a unit attribute, "{REMAT_STAGE}" or "{REMAT_LAYERS}", got {attr}')


# --------------------------------------------------------------------------- the pass


@dataclass
class RematerializePass(ModulePass):
    name = "hlopar-rematerialize"
    summary = (
        "backward fragments marked hlopar.remat recompute the forward values they read from the "
        "stage's inputs, so that pipelines stash only those"
    )

    all: bool = option(False, "rematerialize every backward fragment, marked or not")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        functions = planned_functions(module)
        if not functions:
            self.fail(module, "the module has no function to rewrite")
        main = functions[0]
        with module.context, ir.Location.unknown():
            backwards = [
                op
                for op in fragments(main)
                if fragment_role(op) == "backward" and (self.all or REMAT_ATTR in op.attributes)
            ]
            changed = set()
            for backward in backwards:
                stage = fragment_stage(backward)
                if stage is None:
                    self.fail(backward, "a backward fragment without a stage (stage=k) cannot be rematerialized")
                try:
                    form = remat_form(backward) or REMAT_STAGE
                except ValueError as error:
                    self.fail(backward, str(error))
                if self._rematerialize(main, backward, form, context):
                    changed.add(stage)
            for stage in changed:
                forwards = [
                    _prune(op)
                    for op in fragments(main)
                    if fragment_role(op) == "forward" and fragment_stage(op) == stage
                ]
                empty = [op for op in forwards if not len(op.results) and len(_body(op)) == 1]
                for op in empty[: len(forwards) - 1]:  # nothing to do: it goes, unless it is the stage's only one
                    op.erase()
        module.verify()

    def _rematerialize(self, main: ir.Operation, backward: ir.Operation, form: str, context: PassContext) -> bool:
        """Rewrites one backward fragment (module docstring); whether it recomputes anything."""
        stage = fragment_stage(backward)
        while True:
            forwards = [
                op
                for op in fragments(main)
                if fragment_role(op) == "forward" and fragment_stage(op) == stage and op.is_before_in_block(backward)
            ]
            view = _StageForward.of(forwards)
            if form == REMAT_LAYERS:
                if view.layers and all(layer is None for layer in view.layers):
                    self.fail(
                        backward,
                        f'stage {stage}\'s backward is marked {REMAT_ATTR} = "{REMAT_LAYERS}" but its '
                        f"forward ops carry no {LAYER_ATTR} (stage construction keeps it on the "
                        "stages it marks so)",
                    )
                layers = fill_layers(view.reads, view.defines, view.layers)
                wanted = [
                    (view.number[v], reader) for v, reader in _readers(backward) if view.number.get(v) in view.made
                ]
                plan = layer_slices(view.reads, view.defines, view.clonable, layers, wanted)
                slices = [s for _, s in plan.slices]
                read = [*plan.stashed, *(v for s in slices for v in (*s.inputs, *s.kept))]
            else:
                wanted = [view.number[v] for v in backward.operands if view.number.get(v) in view.made]
                plan = recompute_slice(view.reads, view.defines, view.clonable, wanted)
                slices = [plan]
                read = list(plan.kept)
            if not any(s.ops for s in slices):
                return False
            unreturned = list(dict.fromkeys(v for v in read if v in view.made and v not in view.outer))
            if not unreturned:
                break
            # A value the backward reads as made that the forward does not return yet: return it, then look again.
            for position, fragment in enumerate(forwards):
                extra = [view.inner[v] for v in unreturned if view.fragment_of[v] == position]
                if extra:
                    _rebuilt(fragment, returned=[*_terminator(fragment).operands, *extra])
        for v in sorted({v for s in slices for v in s.kept}):
            op = view.inner[v].owner.operation
            if _clonable(op):
                continue
            context.warn(
                op.location,
                f"{self.name}: stage {stage}'s backward reads the result of '{op.name}' "
                "from its forward (stashed): it is not a function of its operands, so it is "
                "not computed again",
            )
        if form == REMAT_LAYERS:
            _recompute_layers_in(backward, view, plan)
        else:
            _recompute_in(backward, view, plan)
        return True


@dataclass
class _StageForward:
    """A stage's forward fragments as one graph over numbered values: a block argument has the
    number of the operand it binds, a fragment's result that of the value it returns."""

    number: dict[ir.Value, int]
    inner: dict[int, ir.Value]  # per number: a value inside a fragment holding it
    outer: dict[int, ir.Value]  # per number: a value of @main holding it (a stage input, a fragment's result)
    made: set[int]  # numbers some forward op defines
    fragment_of: dict[int, int]  # per made number: the position of its fragment
    ops: list[ir.Operation]
    read_values: list[tuple[ir.Value, ...]]  # per op: the values it reads from outside itself
    reads: list[tuple[int, ...]]
    defines: list[tuple[int, ...]]
    clonable: list[bool]
    layers: list[int | None]  # per op: its hlopar.layer

    @classmethod
    def of(cls, forwards: Sequence[ir.Operation]) -> _StageForward:
        view = cls({}, {}, {}, set(), {}, [], [], [], [], [], [])
        number = view.number
        for position, fragment in enumerate(forwards):
            block = fragment.regions[0].blocks[0]
            for operand, argument in zip(fragment.operands, block.arguments):
                if operand not in number:
                    number[operand] = len(number)
                    view.outer[number[operand]] = operand
                number[argument] = number[operand]
                view.inner.setdefault(number[operand], argument)
            body = _body(fragment)
            for op in body[:-1]:
                read = _read_values(op, number)
                view.read_values.append(read)
                view.reads.append(tuple(dict.fromkeys(number[v] for v in read)))
                defined = []
                for result in op.results:
                    number[result] = len(number)
                    view.inner[number[result]] = result
                    view.made.add(number[result])
                    view.fragment_of[number[result]] = position
                    defined.append(number[result])
                view.defines.append(tuple(defined))
                view.ops.append(op)
                view.clonable.append(_clonable(op))
                view.layers.append(_layer(op))
            for returned, result in zip(body[-1].operands, fragment.results):
                number[result] = number[returned]
                view.outer.setdefault(number[returned], result)
        return view


def _recompute_in(backward: ir.Operation, view: _StageForward, plan: Recompute) -> None:
    """Rewrites `backward` to compute the forward values it read: clones of `plan.ops` at its
    top, reading the stage inputs (and kept values) it now takes after its other operands;
    the operands the clones replace are dropped."""
    new, available, targets = _take_inputs(backward, view, [plan])
    block = new.regions[0].blocks[0]
    with ir.InsertionPoint.at_block_begin(block):
        _clone_slice(view, plan.ops, available)
    _drop_replaced(new, targets, available)
    new.attributes[REMAT_ATTR] = ir.UnitAttr.get()


def _recompute_layers_in(backward: ir.Operation, view: _StageForward, plan: LayerRecompute) -> None:
    """Rewrites `backward` to compute the forward values it read layer by layer: each slice of
    `plan` cloned just before the first op reading one of its values, behind a barrier over what
    it reads and what the backward computed so far for that layer; the stage inputs and
    boundary values the slices read become operands after its others; the operands the clones
    replace are dropped."""
    new, available, targets = _take_inputs(backward, view, [piece for _, piece in plan.slices])
    block = new.regions[0].blocks[0]
    recomputed = {}
    for layer, piece in plan.slices:
        mine = {targets[v]: v for i in piece.ops for v in view.defines[i] if v in targets}
        body = _body(new)  # the terminator last: a value the backward only returns is made before it
        first = next(k for k, op in enumerate(body) if _read_values(op, mine))
        later = [op for op in body[first:-1] if _layer(op) in (layer, None)]
        made_before = _progress(body[:first], block)
        tie = list(dict.fromkeys(v for op in later for v in _read_values(op, made_before)))
        read = [*piece.inputs, *piece.kept]
        with ir.InsertionPoint(body[first]):
            if tie:
                barrier = stablehlo.OptimizationBarrierOp([*tie, *(available[v] for v in read)])
                _replace_reads(body[first:], dict(zip(tie, barrier.results)))
                local = dict(zip(read, list(barrier.results)[len(tie) :]))
            else:
                local = {v: available[v] for v in read}
            _clone_slice(view, piece.ops, local)
        recomputed.update({v: local[v] for v in mine.values()})
    _drop_replaced(new, targets, recomputed)
    new.attributes[REMAT_ATTR] = ir.StringAttr.get(REMAT_LAYERS)


def _take_inputs(backward: ir.Operation, view: _StageForward, slices: Sequence[Recompute]):
    """`backward` rebuilt to take, after its operands, the inputs (and kept values) `slices`
    read that it does not take yet: the new fragment, the value of its body holding each
    number it takes, and per number the clones will make, the block argument they replace."""
    cloned = {v for piece in slices for i in piece.ops for v in view.defines[i]}
    operands = list(backward.operands)
    replaced = [p for p, v in enumerate(operands) if view.number.get(v) in cloned]
    stay = [v for p, v in enumerate(operands) if p not in replaced]
    present = {view.number[v] for v in stay if v in view.number}
    added = list(dict.fromkeys(v for piece in slices for v in (*piece.inputs, *piece.kept) if v not in present))
    new = _rebuilt(backward, operands=[*stay, *(view.outer[v] for v in added)])
    block = new.regions[0].blocks[0]
    available = {
        view.number[v]: block.arguments[p] for p, v in enumerate(operands) if p not in replaced and v in view.number
    }
    for v in added:
        available[v] = block.add_argument(view.inner[v].type, ir.Location.unknown())
    return new, available, {view.number[operands[p]]: block.arguments[p] for p in replaced}


def _clone_slice(view: _StageForward, ops: Sequence[int], available: dict[int, ir.Value]) -> None:
    """Clones the forward ops `ops` at the insertion point, reading `available` (by number),
    where their results are recorded."""
    for i in ops:
        mapping = {value: available[view.number[value]] for value in view.read_values[i]}
        clone_into(view.ops[i], mapping)
        for result in view.ops[i].results:
            available[view.number[result]] = mapping[result]


def _drop_replaced(fragment: ir.Operation, targets: dict[int, ir.Value], made: dict[int, ir.Value]) -> None:
    """Erases the block arguments the clones replace (their uses moved to `made`)."""
    block = fragment.regions[0].blocks[0]
    for v, argument in sorted(targets.items(), key=lambda item: item[1].arg_number, reverse=True):
        argument.replace_all_uses_with(made[v])
        block.erase_argument(argument.arg_number)


def _progress(ops: Sequence[ir.Operation], block: ir.Block) -> set[ir.Value]:
    """The results of `ops` that depend on the block's arguments (not constants alone)."""
    found: set[ir.Value] = set(block.arguments)
    for op in ops:
        if _read_values(op, found):
            found.update(op.results)
    return found - set(block.arguments)


def _readers(backward: ir.Operation) -> list[tuple[ir.Value, int | None]]:
    """(operand, layer of a top-level op of the body reading it) for every such read."""
    block = backward.regions[0].blocks[0]
    argument_of = {argument: operand for operand, argument in zip(backward.operands, block.arguments)}
    return [(argument_of[v], _layer(op)) for op in _body(backward)[:-1] for v in _read_values(op, argument_of)]


def _replace_reads(ops: Sequence[ir.Operation], replacement: dict[ir.Value, ir.Value]) -> None:
    """Makes `ops` (and the ops nested in them) read `replacement[v]` where they read v."""

    def visit(inner: ir.Operation) -> ir.WalkResult:
        operands = inner.operands
        for position, operand in enumerate(operands):
            if operand in replacement:
                operands[position] = replacement[operand]
        return ir.WalkResult.ADVANCE

    for op in ops:
        op.walk(visit)


def _layer(op: ir.Operation) -> int | None:
    return ir.IntegerAttr(op.attributes[LAYER_ATTR]).value if LAYER_ATTR in op.attributes else None


def _prune(fragment: ir.Operation) -> ir.Operation:
    """Drops the results of a forward fragment no one reads, and the ops only they needed."""
    returned = list(_terminator(fragment).operands)
    used = [v for v, result in zip(returned, fragment.results) if _has_uses(result)]
    if len(used) < len(returned):
        fragment = _rebuilt(fragment, returned=used)
    for op in reversed(_body(fragment)[:-1]):
        if len(op.results) and not any(_has_uses(r) for r in op.results) and _clonable(op):
            op.erase()
    return fragment


def _rebuilt(
    fragment: ir.Operation, *, operands: Sequence[ir.Value] | None = None, returned: Sequence[ir.Value] | None = None
) -> ir.Operation:
    """`fragment` with other operands (the body's block arguments are the caller's to match)
    or other returned values (their results' uses follow them; a new one is a replicated mesh
    tensor): a new op with the same attributes, the old body moved into it."""
    block = fragment.regions[0].blocks[0]
    terminator = _terminator(fragment)
    old_returned = list(terminator.operands)
    returned = old_returned if returned is None else list(returned)
    mesh = fragment_mesh(fragment)

    def result_type(value: ir.Value) -> ir.Type:
        if value in old_returned:
            return fragment.results[old_returned.index(value)].type
        return ir.Type.parse(f"!mpmd.mesh_tensor<{quote_string(mesh)}, {value.type}>")

    new = reshaped_fragment(
        fragment,
        [result_type(v) for v in returned],
        list(fragment.operands if operands is None else operands),
    )
    block.append_to(new.regions[0])
    if returned is not old_returned:
        with ir.InsertionPoint(terminator):
            mpmd.ReturnOp(returned)
        terminator.erase()
    for position, result in enumerate(fragment.results):
        value = old_returned[position]
        if _has_uses(result):
            result.replace_all_uses_with(new.results[returned.index(value)])
    fragment.erase()
    return new


def _terminator(fragment: ir.Operation) -> ir.Operation:
    operations = fragment.regions[0].blocks[0].operations
    return operations[len(operations) - 1].operation


def _body(fragment: ir.Operation) -> list[ir.Operation]:
    """The fragment's ops, its terminator last."""
    return [op.operation for op in fragment.regions[0].blocks[0].operations]


def _has_uses(value: ir.Value) -> bool:
    return next(iter(value.uses), None) is not None


def _read_values(op: ir.Operation, number: dict[ir.Value, int]) -> tuple[ir.Value, ...]:
    """The numbered values `op` (or an op nested in it) reads: those defined outside it."""
    found: dict[ir.Value, None] = {}

    def visit(inner: ir.Operation) -> ir.WalkResult:
        for operand in inner.operands:
            if operand in number:
                found.setdefault(operand)
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return tuple(found)


def _clonable(op: ir.Operation) -> bool:
    """Whether computing `op` again gives its results again (nested ops included)."""
    ok = True

    def visit(inner: ir.Operation) -> ir.WalkResult:
        nonlocal ok
        if inner.name in NOT_RECOMPUTED or (
            inner.name == "stablehlo.custom_call"
            and "has_side_effect" in inner.attributes
            and ir.BoolAttr(inner.attributes["has_side_effect"]).value
        ):
            ok = False
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return ok
