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

`recompute_slice` is the choice over plain data (which values each op reads and defines);
the pass adapts fragments to it and rewrites them. The backward keeps `hlopar.remat`
(`all=true` sets it), so running the pass again changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import mpmd

from hlopar.analysis.mesh import quote_string
from hlopar.ir.extract import clone_into
from hlopar.passes.auto_sharding import planned_functions
from hlopar.passes.base import ModulePass, PassContext, option
from hlopar.passes.mpmd_program import fragment_role

__all__ = ["REMAT_ATTR", "Recompute", "RematerializePass", "recompute_slice"]

REMAT_ATTR = "hlopar.remat"
# Ops whose results are not a function of their operands (or that talk to the outside):
# computing them again would not give the forward's values.
NOT_RECOMPUTED = frozenset({
    "stablehlo.rng", "stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed",
    "stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.all_to_all", "stablehlo.collective_broadcast",
    "stablehlo.collective_permute", "stablehlo.reduce_scatter", "stablehlo.partition_id", "stablehlo.replica_id",
})


# --------------------------------------------------------------------------- pure planning


@dataclass(frozen=True)
class Recompute:
    """What a backward recomputes: forward ops to clone and what the clones read."""

    ops: tuple[int, ...]  # ops to clone, program order
    inputs: tuple[int, ...]  # values no op defines that the clones or the backward need, ascending
    kept: tuple[int, ...]  # needed values made by ops that cannot be cloned (still read as made), ascending


def recompute_slice(reads: Sequence[Iterable[int]], defines: Sequence[Iterable[int]],
                    clonable: Sequence[bool], wanted: Iterable[int]) -> Recompute:
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


# --------------------------------------------------------------------------- the pass


@dataclass
class RematerializePass(ModulePass):
    name = "hlopar-rematerialize"
    summary = ("backward fragments marked hlopar.remat recompute the forward values they read from the "
               "stage's inputs, so that pipelines stash only those")

    all: bool = option(False, "rematerialize every backward fragment, marked or not")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        functions = planned_functions(module)
        if not functions:
            self.fail(module, "the module has no function to rewrite")
        main = functions[0]
        with module.context, ir.Location.unknown():
            backwards = [op for op in _fragments(main) if fragment_role(op) == "backward"
                         and (self.all or REMAT_ATTR in op.attributes)]
            changed = set()
            for backward in backwards:
                stage = _stage(backward)
                if stage is None:
                    self.fail(backward, "a backward fragment without a stage (stage=k) cannot be rematerialized")
                if self._rematerialize(main, backward, context):
                    changed.add(stage)
            for stage in changed:
                forwards = [_prune(op) for op in _fragments(main) if fragment_role(op) == "forward"
                            and _stage(op) == stage]
                empty = [op for op in forwards if not len(op.results) and len(_body(op)) == 1]
                for op in empty[:len(forwards) - 1]:  # nothing to do: it goes, unless it is the stage's only one
                    op.erase()
        module.verify()

    def _rematerialize(self, main: ir.Operation, backward: ir.Operation, context: PassContext) -> bool:
        """Rewrites one backward fragment (module docstring); whether it recomputes anything."""
        stage = _stage(backward)
        while True:
            forwards = [op for op in _fragments(main) if fragment_role(op) == "forward" and _stage(op) == stage
                        and op.is_before_in_block(backward)]
            view = _StageForward.of(forwards)
            wanted = [view.number[v] for v in backward.operands if view.number.get(v) in view.made]
            plan = recompute_slice(view.reads, view.defines, view.clonable, wanted)
            if not plan.ops:
                return False
            unreturned = [v for v in plan.kept if v not in view.outer]
            if not unreturned:
                break
            # A kept value the forward does not return yet: return it, then look again.
            for position, fragment in enumerate(forwards):
                extra = [view.inner[v] for v in unreturned if view.fragment_of[v] == position]
                if extra:
                    _rebuilt(fragment, returned=[*_terminator(fragment).operands, *extra])
        for v in plan.kept:
            op = view.inner[v].owner.operation
            context.warn(op.location, f"{self.name}: stage {stage}'s backward reads the result of '{op.name}' "
                                      "from its forward (stashed): it is not a function of its operands, so it is "
                                      "not computed again")
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

    @classmethod
    def of(cls, forwards: Sequence[ir.Operation]) -> _StageForward:
        view = cls({}, {}, {}, set(), {}, [], [], [], [], [])
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
            for returned, result in zip(body[-1].operands, fragment.results):
                number[result] = number[returned]
                view.outer.setdefault(number[returned], result)
        return view


def _recompute_in(backward: ir.Operation, view: _StageForward, plan: Recompute) -> None:
    """Rewrites `backward` to compute the forward values it read: clones of `plan.ops` at its
    top, reading the stage inputs (and kept values) it now takes after its other operands;
    the operands the clones replace are dropped."""
    cloned = {v for i in plan.ops for v in view.defines[i]}
    operands = list(backward.operands)
    replaced = [p for p, v in enumerate(operands) if view.number.get(v) in cloned]
    stay = [v for p, v in enumerate(operands) if p not in replaced]
    present = {view.number[v] for v in stay if v in view.number}
    added = [v for v in (*plan.inputs, *plan.kept) if v not in present]
    new = _rebuilt(backward, operands=[*stay, *(view.outer[v] for v in added)])
    block = new.regions[0].blocks[0]
    available = {view.number[v]: block.arguments[p] for p, v in enumerate(operands)
                 if p not in replaced and v in view.number}
    for v in added:
        available[v] = block.add_argument(view.inner[v].type, ir.Location.unknown())
    with ir.InsertionPoint.at_block_begin(block):
        for i in plan.ops:
            mapping = {value: available[view.number[value]] for value in view.read_values[i]}
            clone_into(view.ops[i], mapping)
            for result in view.ops[i].results:
                available[view.number[result]] = mapping[result]
    for p in reversed(replaced):
        block.arguments[p].replace_all_uses_with(available[view.number[operands[p]]])
        block.erase_argument(p)
    new.attributes[REMAT_ATTR] = ir.UnitAttr.get()


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


def _rebuilt(fragment: ir.Operation, *, operands: Sequence[ir.Value] | None = None,
             returned: Sequence[ir.Value] | None = None) -> ir.Operation:
    """`fragment` with other operands (the body's block arguments are the caller's to match)
    or other returned values (their results' uses follow them; a new one is a replicated mesh
    tensor): a new op with the same attributes, the old body moved into it."""
    block = fragment.regions[0].blocks[0]
    terminator = _terminator(fragment)
    old_returned = list(terminator.operands)
    returned = old_returned if returned is None else list(returned)
    mesh = ir.StringAttr(fragment.attributes["mesh_name"]).value

    def result_type(value: ir.Value) -> ir.Type:
        if value in old_returned:
            return fragment.results[old_returned.index(value)].type
        return ir.Type.parse(f"!mpmd.mesh_tensor<{quote_string(mesh)}, {value.type}>")

    new = ir.Operation.create(
        "mpmd.fragment", results=[result_type(v) for v in returned],
        operands=list(fragment.operands if operands is None else operands),
        attributes={named.name: named.attr for named in map(fragment.attributes.__getitem__,
                                                            range(len(fragment.attributes)))},
        regions=1, loc=fragment.location, ip=ir.InsertionPoint(fragment))
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


def _stage(fragment: ir.Operation) -> int | None:
    return ir.IntegerAttr(fragment.attributes["stage_id"]).value if "stage_id" in fragment.attributes else None


def _fragments(main: ir.Operation) -> list[ir.Operation]:
    return [op.operation for op in main.regions[0].blocks[0].operations if op.operation.name == "mpmd.fragment"]


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
                inner.name == "stablehlo.custom_call" and "has_side_effect" in inner.attributes
                and ir.BoolAttr(inner.attributes["has_side_effect"]).value):
            ok = False
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return ok
