"""hlopar-reroll-stage-loops: a stage runs its range of a scanned layer stack as a loop again.

Planning wants a scanned stack unrolled (`hlopar-unstack-layer-scans`: each layer's ops are
ops of their own, so clustering and stage construction can cut between layers). Running it
unrolled costs compile time and executable size in proportion to the layers a stage holds.
So after the MPMD program is written, this pass looks inside each fragment for the copies
of one loop's body that the unstack pass tagged (`hlopar.layer_iteration`, docs/ir.md) and
turns each run of at least `min-trips` consecutive, identical iterations back into one
`stablehlo.while` over that range ("unroll to plan, re-roll to run"):

- identical: the same ops in the same order, with the same attributes (shardings included),
  types and regions; the iterations of a run differ only in what they read;
- what an iteration reads is, across the run, either made by the same op of the same
  iteration (the loop body's own wiring), or by an op of the previous iteration (a carry,
  its first value read from before the run), or the same value for every iteration (an
  invariant, carried unchanged), or a value of its own per iteration made outside the run
  (a layer's parameter piece, a residual the forward stashed): those are packed into one
  stack in iteration order, sliced by the loop's counter;
- what an iteration makes that is read outside the run (its residuals, its gradients, the
  carry that leaves the stage) is written into a stacked buffer by `dynamic_update_slice`
  and read back, per iteration, by a slice after the loop.

Anything else (an iteration reading a value two iterations back, a region capturing a value
from outside, an op outside the run that both reads the run and is read by it) keeps the
run unrolled, and the report says why. The update fragments (the optimizer, elementwise per
piece) stay unrolled.

With `hold-ranges` (the default), the stage also holds the layers it loops over as one range
(`hold_ranges`, before the rolling): the pieces a..b-1 of each stacked argument and result of
`@main` (`hlopar.layer_pieces`) become one value of rows a:b, which fragments read by slices,
so a loop's per-iteration inputs are the rows of one value and it reads them by its counter
instead of packing copies (`_rows_of_one`); after the rolling, a fragment returns a loop's
stacked stash or gradients as one value (`return_stacks`). Without it the fragments'
arguments and results are unchanged and the loops pack their pieces each run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import mpmd, stablehlo

from hlopar.analysis.limits import check_count
from hlopar.analysis.mesh import quote_string
from hlopar.analysis.mpmd import MeshTensorType
from hlopar.analysis.sharding import DimSharding, TensorSharding
from hlopar.dialect.attributes import (
    BATCH,
    BATCH_ARGS_ATTR,
    INDEX_ARG_ATTR,
    KIND_ATTR,
    LAYER_ITERATION_ATTR,
    LAYER_LOOP_ATTR,
    LAYER_PIECES_ATTR,
    SUM,
)
from hlopar.dialect.layers import LayerPieces
from hlopar.dialect.mpmd import fragment_role
from hlopar.ir.extract import clone_into
from hlopar.passes.base import ModulePass, PassContext, option, report_option
from hlopar.passes.layer_scans.values import ELEMENTWISE

__all__ = [
    "LAYER_LOOP_ATTR",
    "LoopRange",
    "RerollStageLoopsPass",
    "fragments",
    "identical_runs",
    "reroll_block",
    "stage_loop_lines",
]

ALIAS = "tf.aliasing_output"


@dataclass(frozen=True)
class LoopRange:
    """What became of one run of iterations of one unrolled loop inside one fragment."""

    fragment: str  # the fragment's origin, e.g. stage0, stage0(1)
    loop: int  # the loop's number among the unrolled ones (0: the first scan, often the forward)
    first: int  # its first iteration
    trips: int  # how many iterations
    layers: tuple[int, ...]  # the layer each iteration reads (-1: none)
    rolled: bool
    reason: str = ""  # why it stays unrolled


def identical_runs(keys: dict[int, object], min_trips: int) -> list[tuple[int, int]]:
    """Maximal runs `(first, trips)` of consecutive iterations with equal keys, of at least
    `min_trips` iterations. `keys`: iteration -> its structure."""
    runs: list[tuple[int, int]] = []
    for iteration in sorted(keys):
        if runs and iteration == runs[-1][0] + runs[-1][1] and keys[iteration] == keys[runs[-1][0]]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((iteration, 1))
    return [r for r in runs if r[1] >= min_trips]


@dataclass
class RerollStageLoopsPass(ModulePass):
    name = "hlopar-reroll-stage-loops"
    summary = (
        "inside each fragment, run the iterations of an unrolled layer scan that the fragment holds as one "
        "stablehlo.while over their range again"
    )

    reroll: Literal["auto", "never"] = option(
        "auto", "auto: re-roll each run of at least min-trips identical iterations; never: keep every stage unrolled"
    )
    min_trips: int = option(
        2,
        "re-roll runs of at least this many iterations (one iteration is cheaper unrolled)",
        check=lambda n: check_count(n, low=1),
    )
    report: str | None = report_option("write a JSON report of the rolled and unrolled ranges to this path")

    hold_ranges: bool = option(
        True,
        "hold the pieces of the layers a stage loops over as one range of rows: one @main argument and "
        "result per stacked parameter or state, one value for the stash and the gradients between its "
        "fragments, read by the loop's counter (false: the loop packs the pieces each run)",
    )

    def run(self, module: ir.Operation, context: PassContext) -> None:
        ranges: list[LoopRange] = []
        held: list[HeldRange] = []
        with module.context, ir.Location.unknown():
            if self.reroll == "auto" and self.hold_ranges and fragments(module):
                spans = self._spans(module)
                held = hold_ranges(fragments(module)[0].parent, spans)
            for number in range(len(fragments(module))):
                fragment = fragments(module)[number]  # the list changes as fragments are rebuilt
                if fragment_role(fragment) == "update":  # the optimizer: elementwise per piece, not a loop body
                    continue
                block = fragment.regions[0].blocks[0]
                made = reroll_block(block, _origin(fragment), min_trips=self.min_trips, rewrite=self.reroll == "auto")
                for r in made:
                    if not r.rolled and r.trips >= self.min_trips and self.reroll == "auto":
                        context.warn(
                            fragment,
                            f"{self.name}: layers {r.layers[0]}..{r.layers[-1]} of loop {r.loop} "
                            f"stay unrolled in {r.fragment}: {r.reason}",
                        )
                ranges += made
                if any(r.rolled for r in made):
                    if self.hold_ranges:
                        fragment = return_stacks(fragment)
                    _erase_unread(fragment.regions[0].blocks[0])
            if held:
                for fragment in fragments(module):
                    if fragment_role(fragment) == "update":
                        widen_joins(fragment)
        if self.wants_report(context):
            self.emit_report(
                module,
                context,
                {
                    "pass": self.name,
                    "reroll": self.reroll,
                    "ranges": [asdict(r) for r in ranges],
                    "held": [asdict(h) for h in held],
                },
                end="",
            )

    def _spans(self, module: ir.Operation) -> dict[str, list[tuple[int, int]]]:
        """Per mesh, the disjoint layer ranges `[a, b)` that its fragments have runs of at
        least min-trips identical iterations over (the longest first)."""
        found: dict[str, set[tuple[int, int]]] = {}
        for fragment in fragments(module):
            if fragment_role(fragment) == "update":
                continue
            mesh = ir.StringAttr(fragment.attributes["mesh_name"]).value
            for r in reroll_block(fragment.regions[0].blocks[0], "", min_trips=self.min_trips, rewrite=False):
                layers = sorted(r.layers)
                if r.trips >= self.min_trips and layers[0] >= 0 and layers == list(range(layers[0], layers[-1] + 1)):
                    found.setdefault(mesh, set()).add((layers[0], layers[-1] + 1))
        spans: dict[str, list[tuple[int, int]]] = {}
        for mesh, candidates in found.items():
            chosen: list[tuple[int, int]] = []
            for a, b in sorted(candidates, key=lambda r: (r[0] - r[1], r[0])):
                if all(b <= c or d <= a for c, d in chosen):
                    chosen.append((a, b))
            spans[mesh] = sorted(chosen)
        return spans


_UNREAD = frozenset({"stablehlo.slice", "stablehlo.reshape", "stablehlo.concatenate", "sdy.sharding_constraint"})


def _erase_unread(block: ir.Block) -> None:
    """The slices and reshapes no one reads any more (a rolled loop reads a range by its counter)."""
    for op in reversed(list(block.operations)):
        op = op.operation
        if op.name in _UNREAD and not any(list(r.uses) for r in op.results):
            op.erase()


def stage_loop_lines(report: dict | None) -> list[str]:
    """The plan summary's lines on which fragments loop over which layers and which stay
    unrolled, and why (from this pass's report)."""
    if not report:
        return []
    rolled, unrolled = [], []
    for r in report["ranges"]:
        layers = r["layers"]
        span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]}"
        if r["rolled"]:
            rolled.append(f"{r['fragment']} loop {r['loop']} over {span}")
        else:
            unrolled.append(f"{r['fragment']} loop {r['loop']} {span} ({r['reason']})")
    lines = []
    if rolled:
        lines.append(f"  run as loops (hlopar-reroll-stage-loops): {'; '.join(rolled)}")
    held = [
        f"{h['mesh']} layers {h['first']}..{h['first'] + h['rows'] - 1} ({h['arguments']} argument(s), "
        f"{h['results']} result(s))"
        for h in report.get("held", ())
    ]
    if held:
        lines.append(f"  held as one range of rows per stacked leaf: {'; '.join(held)}")
    if unrolled:
        lines.append(f"  left unrolled: {'; '.join(unrolled)}")
    return lines


def fragments(module: ir.Operation) -> list[ir.Operation]:
    """Every `mpmd.fragment` of the module, in program order."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "mpmd.fragment":
            found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module.walk(visit)
    return found


def _origin(fragment: ir.Operation) -> str:
    text = str(fragment.attributes["origin"])
    match = re.search(r'"([^"]+)"(\(\d+\))?', text)
    return (match.group(1) + (match.group(2) or "")) if match else fragment_role(fragment)


# --------------------------------------------------------------------------- finding runs


def _tag(op: ir.Operation) -> tuple[int, int, int, int] | None:
    if LAYER_ITERATION_ATTR not in op.attributes:
        return None
    return tuple(ir.DenseI64ArrayAttr(op.attributes[LAYER_ITERATION_ATTR]))


_NAME = re.compile(r"[%^][\w#.$-]+")
_TAG_TEXT = re.compile(re.escape(LAYER_ITERATION_ATTR) + r" = array<i64:[^>]*>,? ?")


def _structure(op: ir.Operation) -> str:
    """An op as text without its operands' names and its iteration tag: equal for the copies
    of one body op that differ only in what they read."""
    names: dict[str, str] = {}

    def renamed(match: re.Match) -> str:
        return names.setdefault(match.group(0), f"%{len(names)}")

    text = op.get_asm(print_generic_op_form=True, use_local_scope=True)  # local: not the whole block's names
    return _NAME.sub(renamed, _TAG_TEXT.sub("", text))


def reroll_block(block: ir.Block, fragment: str, *, min_trips: int = 2, rewrite: bool = True) -> list[LoopRange]:
    """Re-rolls, in one block, each run of identical tagged iterations; returns what was done."""
    by_loop: dict[int, dict[int, list[ir.Operation]]] = {}
    layer_of: dict[tuple[int, int], int] = {}
    tags: dict[ir.Operation, tuple[int, int, int, int]] = {}
    for op in list(block.operations)[:-1]:
        op = op.operation
        tag = _tag(op)
        if tag is None and op.name == "sdy.sharding_constraint":
            # Written by hlopar-auto-sharding on a result after the unrolling: part of its maker's iteration.
            maker = op.operands[0].owner
            tag = None if isinstance(maker, ir.Block) else tags.get(maker.operation)
        if tag is None:
            continue
        tags[op] = tag
        loop, iteration, _, layer = tag
        by_loop.setdefault(loop, {}).setdefault(iteration, []).append(op)
        layer_of[(loop, iteration)] = layer
    keys = {
        loop: {i: tuple((tags[op][2], _structure(op)) for op in ops) for i, ops in iterations.items()}
        for loop, iterations in by_loop.items()
    }  # before any rewrite
    done: list[LoopRange] = []
    for loop, iterations in sorted(by_loop.items()):
        for first, trips in identical_runs(keys[loop], 1):
            layers = tuple(layer_of[(loop, i)] for i in range(first, first + trips))
            if trips < min_trips:
                reason = f"{trips} iteration(s): cheaper unrolled (min-trips={min_trips})"
            elif not rewrite:
                reason = "reroll=never"
            else:
                groups = [iterations[i] for i in range(first, first + trips)]
                reason = _Reroll(block, groups, (loop, first, trips)).run()
            done.append(LoopRange(fragment, loop, first, trips, layers, not reason, reason))
    return done


# --------------------------------------------------------------------------- rewriting


@dataclass
class _Reroll:
    """Turns `groups` (per iteration, its ops in the same order) into one while."""

    block: ir.Block
    groups: list[list[ir.Operation]]
    tag: tuple[int, int, int]
    # per template operand (op position, operand number): how it is read
    wiring: dict[tuple[int, int], tuple] = field(default_factory=dict)

    def run(self) -> str:
        """'' when rolled, else why not (the block is then unchanged)."""
        reason = self._wire() or self._order()
        if reason:
            return reason
        self._rewrite()
        return ""

    def _wire(self) -> str:
        where: dict[ir.Value, tuple[int, int, int]] = {}  # value -> (iteration, op position, result)
        for i, ops in enumerate(self.groups):
            for j, op in enumerate(ops):
                for r, value in enumerate(op.results):
                    where[value] = (i, j, r)
        for j, template in enumerate(self.groups[0]):
            for region in template.regions:
                for inner_block in region.blocks:
                    for inner in inner_block.operations:
                        if _captures(inner.operation, template):
                            return f"'{template.name}' has a region reading a value from outside it"
            for o in range(len(template.operands)):
                values = [ops[j].operands[o] for ops in self.groups]
                made = [where.get(v) for v in values]
                if all(m is not None and m[0] == i for i, m in enumerate(made)) and len({m[1:] for m in made}) == 1:
                    self.wiring[(j, o)] = ("body", made[0][1:])
                elif (
                    made[0] is None
                    and all(m is not None and m[0] == i - 1 for i, m in enumerate(made) if i)
                    and len({m[1:] for m in made[1:]}) == 1
                ):
                    self.wiring[(j, o)] = ("carry", values[0], made[1][1:])  # one slot per (first, next)
                elif all(m is None for m in made):
                    if all(v == values[0] for v in values):
                        self.wiring[(j, o)] = ("invariant", values[0])
                    else:
                        self.wiring[(j, o)] = _rows_of_one(values) or ("packed", tuple(values))
                else:
                    return (
                        f"operand {o} of '{template.name}' reads values of other iterations than the loop's "
                        "own or its previous one"
                    )
        return ""

    def _order(self) -> str:
        """Moves the ops outside the run that it reads before its first op ('' if it can)."""
        members = {op for ops in self.groups for op in ops}
        ops = [op.operation for op in self.block.operations]
        position = {op: k for k, op in enumerate(ops)}
        first = min(position[op] for op in members)
        needed: set[ir.Operation] = set()
        frontier = [v for op in members for v in _read(op)]
        while frontier:
            value = frontier.pop()
            owner = value.owner
            if isinstance(owner, ir.Block):
                continue
            op = owner.operation
            if op in members or op in needed or op not in position:
                continue
            needed.add(op)
            frontier += _read(op)
        later = sorted((op for op in needed if position[op] > first), key=position.__getitem__)
        # An op the run reads that itself reads the run: no single place for the loop.
        made = {v for op in members for v in op.results}
        for op in later:
            if any(v in made for v in _read(op)) or _reads_from(op, made, needed):
                return f"'{op.name}' outside the run both reads it and is read by it"
        anchor = ops[first]
        for op in later:
            op.move_before(anchor)
        return ""

    def _rewrite(self) -> None:
        groups, template = self.groups, self.groups[0]
        trips = len(groups)
        position = {op.operation: k for k, op in enumerate(self.block.operations)}
        first_op = min((op for ops in groups for op in ops), key=position.__getitem__)
        members = {op for ops in groups for op in ops}
        outputs = [
            (j, r)
            for j, op in enumerate(template)
            for r in range(len(op.results))
            if any(_used_outside(ops[j].results[r], members) for ops in groups)
        ]
        carried_out = {how[2] for how in self.wiring.values() if how[0] == "carry"}
        # A carry read outside only after the last iteration (the stage's output): the loop's result.
        kinds = {_kind(op) for op in members}
        loop_kind = next((kind for kind in (BATCH, SUM) if kind in kinds), None)
        last_only = {
            (j, r)
            for j, r in outputs
            if (j, r) in carried_out
            and _kind(template[j]) == loop_kind
            and not any(_used_outside(ops[j].results[r], members) for ops in groups[:-1])
        }
        outputs = [o for o in outputs if o not in last_only]
        with ir.InsertionPoint(first_op), first_op.location:
            scalar = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
            zero = _constant(scalar, 0)
            carried: list[ir.Value] = [zero]
            slots: dict[tuple, int] = {}  # what the loop carries -> its position among the operands

            def slot(key, value: ir.Value) -> int:
                if key not in slots:
                    slots[key] = len(carried)
                    carried.append(value)
                return slots[key]

            for how in self.wiring.values():
                if how[0] in ("carry", "invariant"):
                    slot(how, how[1])
                elif how[0] == "rows":  # a range held as one value: carried as it is
                    slot(("invariant", how[1]), how[1])
                elif how[0] == "packed" and how not in slots:
                    slot(how, _pack(how[1]))
            for j, r in outputs:
                t = ir.RankedTensorType(template[j].results[r].type)
                buffer = _zeros(ir.RankedTensorType.get([trips] + list(t.shape), t.element_type, t.encoding))
                slot(("output", j, r), buffer)
            loop = stablehlo.WhileOp([v.type for v in carried], carried)
            loop.attributes[LAYER_LOOP_ATTR] = ir.DenseI64ArrayAttr.get(list(self.tag))
            if loop_kind is not None:  # what codegen reads of a value the loop returns
                loop.attributes[KIND_ATTR] = ir.StringAttr.get(loop_kind)
            cond = loop.regions[0].blocks.append(*[v.type for v in carried])
            with ir.InsertionPoint(cond):
                more = stablehlo.CompareOp(
                    cond.arguments[0],
                    _constant(scalar, trips),
                    stablehlo.ComparisonDirectionAttr.get("LT"),
                    compare_type=stablehlo.ComparisonTypeAttr.get("SIGNED"),
                ).result
                stablehlo.ReturnOp([more])
            body = loop.regions[1].blocks.append(*[v.type for v in carried])
            args = body.arguments
            counter = args[0]
            with ir.InsertionPoint(body):
                mapping: dict[ir.Value, ir.Value] = {}
                rows_read: dict[tuple, ir.Value] = {}
                clones: list[ir.Operation] = []
                for j, op in enumerate(template):
                    for o in range(len(op.operands)):
                        how = self.wiring[(j, o)]
                        kind = how[0]
                        if kind == "body":
                            value = clones[how[1][0]].results[how[1][1]]
                        elif kind == "packed":
                            value = _row(args[slots[how]], counter, how[1][0].type)
                        elif kind == "rows":  # one read per row and type, however many ops read it
                            key = (how, str(op.operands[o].type))
                            if key not in rows_read:
                                rows_read[key] = _row(
                                    args[slots[("invariant", how[1])]],
                                    counter,
                                    op.operands[o].type,
                                    first=how[2],
                                    step=how[3],
                                )
                            value = rows_read[key]
                        else:
                            value = args[slots[how]]
                        mapping[op.operands[o]] = value
                    clone = clone_into(op, {op.operands[o]: mapping[op.operands[o]] for o in range(len(op.operands))})
                    clones.append(clone)
                returned = list(args)
                returned[0] = stablehlo.AddOp(counter, _constant(scalar, 1)).result
                for key, k in slots.items():
                    if key[0] == "carry":
                        jj, rr = key[2]
                        returned[k] = clones[jj].results[rr]
                    elif key[0] == "output":
                        _, j, r = key
                        returned[k] = _write_row(args[k], clones[j].results[r], counter)
                stablehlo.ReturnOp(returned)
            for key, k in slots.items():
                if key[0] == "carry" and key[2] in last_only:
                    value = groups[-1][key[2][0]].results[key[2][1]]
                    for use in list(value.uses):
                        if use.owner.operation not in members:
                            use.owner.operands[use.operand_number] = loop.results[k]
            for j, r in outputs:
                stacked = loop.results[slots[("output", j, r)]]
                for i, ops in enumerate(groups):
                    value = ops[j].results[r]
                    if _used_outside(value, members):
                        row = _static_row(stacked, i, value.type)
                        if KIND_ATTR in ops[j].attributes:  # what codegen reads of a returned value
                            row.owner.attributes[KIND_ATTR] = ops[j].attributes[KIND_ATTR]
                        for use in list(value.uses):
                            if use.owner.operation not in members:
                                use.owner.operands[use.operand_number] = row
        for op in sorted(members, key=position.__getitem__, reverse=True):
            op.erase()


def _kind(op: ir.Operation) -> str | None:
    return ir.StringAttr(op.attributes[KIND_ATTR]).value if KIND_ATTR in op.attributes else None


def _read(op: ir.Operation) -> list[ir.Value]:
    """The values `op` reads, its regions' reads from outside included."""
    values = list(op.operands)

    def visit(inner: ir.Operation) -> ir.WalkResult:
        values.extend(inner.operands)
        return ir.WalkResult.ADVANCE

    for region in op.regions:
        for inner_block in region.blocks:
            for inner in inner_block.operations:
                inner.operation.walk(visit)
    return values


def _reads_from(op: ir.Operation, made: set[ir.Value], needed: set[ir.Operation]) -> bool:
    """Whether `op` reads, through ops of `needed`, a value of `made`."""
    seen: set[ir.Operation] = set()
    frontier = [op]
    while frontier:
        current = frontier.pop()
        for value in _read(current):
            if value in made:
                return True
            owner = value.owner
            if not isinstance(owner, ir.Block) and owner.operation in needed and owner.operation not in seen:
                seen.add(owner.operation)
                frontier.append(owner.operation)
    return False


def _captures(inner: ir.Operation, template: ir.Operation) -> bool:
    """Whether an op nested in `template` reads a value defined outside `template`."""
    for value in _read(inner):
        owner = value.owner
        node = owner.owner if isinstance(owner, ir.Block) else owner.operation
        while node is not None and node != template:
            node = node.parent
        if node is None:
            return True
    return False


def _used_outside(value: ir.Value, members: set[ir.Operation]) -> bool:
    return any(use.owner.operation not in members for use in value.uses)


def _constant(t: ir.RankedTensorType, number: int) -> ir.Value:
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, number))).result


def _zeros(t: ir.RankedTensorType) -> ir.Value:
    element = t.element_type
    if isinstance(element, ir.IntegerType):
        zero = ir.IntegerAttr.get(element, 0)
    else:
        zero = ir.FloatAttr.get(element, 0.0)
    scalar = ir.RankedTensorType.get([], element)
    return stablehlo.BroadcastInDimOp(
        t, stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(scalar, zero)).result, ir.DenseI64ArrayAttr.get([])
    ).result


def _unit(t: ir.Type) -> ir.RankedTensorType:
    t = ir.RankedTensorType(t)
    return ir.RankedTensorType.get([1] + list(t.shape), t.element_type, t.encoding)


def _pack(values: Sequence[ir.Value]) -> ir.Value:
    """One stack of per-iteration values, in iteration order."""
    t = ir.RankedTensorType(values[0].type)
    rows = [stablehlo.ReshapeOp(_unit(t), v).result for v in values]
    stacked = ir.RankedTensorType.get([len(values)] + list(t.shape), t.element_type, t.encoding)
    return stablehlo.ConcatenateOp(rows, 0, results=[stacked]).result


def _row(stacked: ir.Value, counter: ir.Value, row_type: ir.Type, first: int = 0, step: int = 1) -> ir.Value:
    """Row `first + step * counter` of `stacked`, as `row_type` (the row itself, or without
    its unit leading dim)."""
    t, source = ir.RankedTensorType(row_type), ir.RankedTensorType(stacked.type)
    index_type = ir.RankedTensorType(counter.type)
    zero = _constant(index_type, 0)
    index = counter
    if step != 1:
        index = stablehlo.MulOp(index, _constant(index_type, step)).result
    if first:
        index = stablehlo.AddOp(index, _constant(index_type, first)).result
    row = stablehlo.DynamicSliceOp(stacked, [index] + [zero] * (source.rank - 1), [1] + list(source.shape)[1:]).result
    return row if row.type == t else stablehlo.ReshapeOp(t, row).result


def _write_row(buffer: ir.Value, value: ir.Value, counter: ir.Value) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    zero = _constant(ir.RankedTensorType(counter.type), 0)
    row = stablehlo.ReshapeOp(_unit(t), value).result
    return stablehlo.DynamicUpdateSliceOp(buffer, row, [counter] + [zero] * t.rank).result


def _static_row(stacked: ir.Value, i: int, row_type: ir.Type) -> ir.Value:
    t = ir.RankedTensorType(row_type)
    row = stablehlo.SliceOp(stacked, [i] + [0] * t.rank, [i + 1] + list(t.shape), [1] * (t.rank + 1)).result
    return stablehlo.ReshapeOp(t, row).result


def _row_of(value: ir.Value) -> tuple[ir.Value, int] | None:
    """`(stack, r)` when `value` is row r of `stack` (a unit slice of its leading dim, whole
    in the others, maybe reshaped without that dim; through a sharding constraint on it,
    which a loop reading the row by its counter does without), else None."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    op = owner.operation
    if op.name == "sdy.sharding_constraint":
        return _row_of(op.operands[0])
    if op.name == "stablehlo.reshape" and not isinstance(op.operands[0].owner, ir.Block):
        inner = op.operands[0].owner.operation
        if inner.name == "stablehlo.slice" and list(_shape(op.operands[0])[1:]) == _shape(value):
            op = inner
    if op.name != "stablehlo.slice":
        return None
    source = op.operands[0]
    start, limit = _ints(op, "start_indices"), _ints(op, "limit_indices")
    if (
        limit[0] - start[0] != 1
        or any(start[1:])
        or limit[1:] != _shape(source)[1:]
        or set(_ints(op, "strides")) != {1}
    ):
        return None
    return source, start[0]


def _rows_of_one(values: Sequence[ir.Value]) -> tuple | None:
    """`("rows", stack, first, step)` when the per-iteration `values` are rows first,
    first + step, ... (step +1 or -1) of one stack: the loop then slices the stack itself
    instead of packing copies of its rows."""
    rows = [_row_of(v) for v in values]
    if any(r is None for r in rows) or len({r[0] for r in rows}) != 1:
        return None
    first = rows[0][1]
    for step in (1, -1):
        if all(r[1] == first + step * i for i, r in enumerate(rows)):
            return ("rows", rows[0][0], first, step)
    return None


def _shape(value: ir.Value) -> list[int]:
    return list(ir.RankedTensorType(value.type).shape)


def _ints(op: ir.Operation, name: str) -> list[int]:
    return list(ir.DenseI64ArrayAttr(op.attributes[name]))


# --------------------------------------------------------------------------- ranges held as one value


@dataclass(frozen=True)
class HeldRange:
    """Rows `first:first+rows` of stacked parameters/state a mesh holds as one value."""

    mesh: str
    first: int
    rows: int
    arguments: int  # @main arguments made of `rows` pieces each
    results: int  # @main results likewise


def _mesh_type(value: ir.Value, tensor: ir.RankedTensorType, lead: bool) -> ir.Type:
    """`value`'s mesh tensor type with the tensor `tensor`; `lead`: `tensor` has one more
    (unsharded) leading dim than `value`'s."""
    mesh_type = MeshTensorType.parse(str(value.type))
    text = f"!mpmd.mesh_tensor<{quote_string(mesh_type.mesh_name)}, {tensor}"
    sharding = mesh_type.sharding
    if sharding is not None:
        if lead:
            sharding = replace(sharding, dims=(DimSharding(),) + sharding.dims)
        text += f", sharding=<{sharding.format_body()}>"
    if mesh_type.memory_kind is not None:
        text += f", memory_kind={quote_string(mesh_type.memory_kind)}"
    return ir.Type.parse(text + ">")


def _stacked(t: ir.Type, rows: int, lead: bool) -> ir.RankedTensorType:
    t = ir.RankedTensorType(t)
    shape = [rows] + list(t.shape)[0 if lead else 1 :]
    return ir.RankedTensorType.get(shape, t.element_type, t.encoding)


def _refragment(
    fragment: ir.Operation, operands: Sequence[ir.Value], returned: Sequence[ir.Value], types: Sequence[ir.Type]
) -> ir.Operation:
    """`fragment` with these operands (its block's arguments already matching them) and these
    returned values of these result types: a new op with the old body; the caller moves the
    old results' uses."""
    block = fragment.regions[0].blocks[0]
    new = ir.Operation.create(
        "mpmd.fragment",
        results=list(types),
        operands=list(operands),
        attributes={fragment.attributes[k].name: fragment.attributes[k].attr for k in range(len(fragment.attributes))},
        regions=1,
        loc=fragment.location,
        ip=ir.InsertionPoint(fragment),
    )
    block.append_to(new.regions[0])
    terminator = list(block.operations)[-1].operation
    with ir.InsertionPoint(terminator), terminator.location:
        mpmd.ReturnOp(list(returned))
    terminator.erase()
    return new


def _read_as_one(fragment: ir.Operation, groups: Sequence[tuple[Sequence[ir.Value], ir.Value]]) -> ir.Operation:
    """`fragment` reading, per group `(parts, whole)`, `whole` (a stack of rows `parts`, in
    order) in place of the parts: each part's block argument becomes a slice of the new one (a
    loop over the rows then reads the stack by its counter, `_rows_of_one`)."""
    block = fragment.regions[0].blocks[0]
    operands = list(fragment.operands)
    first = list(block.operations)[0]
    gone: list[int] = []
    for parts, whole in groups:
        local = ir.RankedTensorType(ir.Type.parse(MeshTensorType.parse(str(whole.type)).tensor_type))
        argument = block.add_argument(local, whole.location)
        with ir.InsertionPoint(first), fragment.location:
            for k, v in enumerate(operands):
                if v not in parts:
                    continue
                gone.append(k)
                old, row = block.arguments[k], parts.index(v)
                t = ir.RankedTensorType(old.type)
                sliced = stablehlo.SliceOp(
                    argument, [row] + [0] * (local.rank - 1), [row + 1] + list(local.shape)[1:], [1] * local.rank
                ).result
                if sliced.type != t:
                    sliced = stablehlo.ReshapeOp(t, sliced).result
                old.replace_all_uses_with(sliced)
    for k in sorted(gone, reverse=True):
        block.erase_argument(k)
    new = _refragment(
        fragment,
        [v for k, v in enumerate(operands) if k not in gone] + [w for _, w in groups],
        list(list(block.operations)[-1].operands),
        [r.type for r in fragment.results],
    )
    for old, made in zip(fragment.results, new.results):
        old.replace_all_uses_with(made)
    fragment.erase()
    return new


def _readers(value: ir.Value) -> list[ir.Operation] | None:
    """The fragments reading `value`, or None if anything else reads it (a transfer, the return)."""
    found: list[ir.Operation] = []
    for use in value.uses:
        op = use.owner.operation
        if op.name != "mpmd.fragment":
            return None
        if op not in found:
            found.append(op)
    return found


def _read_everywhere_as_one(groups: Sequence[tuple[Sequence[ir.Value], ir.Value]]) -> None:
    """Every fragment reading parts of the groups reads their wholes instead (`_read_as_one`),
    each rebuilt once."""
    readers: list[ir.Operation] = []
    for parts, _ in groups:
        for part in parts:
            readers += [op for op in _readers(part) if op not in readers]
    for reader in readers:
        read = [(parts, whole) for parts, whole in groups if any(v in parts for v in reader.operands)]
        _read_as_one(reader, read)


def return_stacks(fragment: ir.Operation) -> ir.Operation:
    """After its loops are rolled, `fragment` returns each stacked buffer of a loop whose
    every row it returned one by one (the stash its backward reads, the gradients its update
    reads) as one value, which its readers slice (a rolled reader by its counter)."""
    block = fragment.regions[0].blocks[0]
    returned = list(list(block.operations)[-1].operands)
    by_stack: dict[ir.Value, dict[int, int]] = {}
    for position, value in enumerate(returned):
        row = _row_of(value)
        if row is not None and isinstance(row[0].owner, ir.OpView) and row[0].owner.operation.name == "stablehlo.while":
            by_stack.setdefault(row[0], {}).setdefault(row[1], position)
    groups = []
    for stack, rows in by_stack.items():
        positions = [rows.get(r) for r in range(_shape(stack)[0])]
        if None not in positions and all(_readers(fragment.results[p]) for p in positions):
            groups.append((stack, positions))
    if not groups:
        return fragment
    gone = {p for _, positions in groups for p in positions}
    kept = [p for p in range(len(returned)) if p not in gone]
    values, types = [returned[p] for p in kept], [fragment.results[p].type for p in kept]
    terminator = list(block.operations)[-1].operation
    for stack, positions in groups:
        value = stack
        row = returned[positions[0]].owner.operation
        if KIND_ATTR in row.attributes:  # what codegen reads of a returned value (sum: accumulated)
            with ir.InsertionPoint(terminator), terminator.location:
                value = stablehlo.ReshapeOp(stack.type, stack).result
            value.owner.attributes[KIND_ATTR] = row.attributes[KIND_ATTR]
        values.append(value)
        part = fragment.results[positions[0]]
        lead = _shape(stack)[1:] == _shape(returned[positions[0]])
        types.append(_mesh_type(part, ir.RankedTensorType(stack.type), lead))
    new = _refragment(fragment, list(fragment.operands), values, types)
    for k, p in enumerate(kept):
        fragment.results[p].replace_all_uses_with(new.results[k])
    _read_everywhere_as_one(
        [
            ([fragment.results[p] for p in positions], new.results[len(kept) + g])
            for g, (_, positions) in enumerate(groups)
        ]
    )
    fragment.erase()
    return new


def hold_ranges(main: ir.Operation, spans: dict[str, list[tuple[int, int]]]) -> list[HeldRange]:
    """Joins, per mesh and layer range `[a, b)` of `spans`, the pieces a..b-1 of each stacked
    argument of `@main` (`hlopar.layer_pieces`) into one argument of rows a:b, where only
    fragments on that mesh read them (each reads slices of it), and the pieces a..b-1 of each
    stacked result that one fragment makes into one result (it concatenates them). Updates
    `hlopar.layer_pieces`, the arguments' donation and the numbers `@main` keeps of its arguments."""
    pieces = LayerPieces.of(main)
    if pieces is None:
        return []
    block = main.regions[0].blocks[0]
    ret = list(block.operations)[-1].operation
    args_at = {
        (o, p): k for k, (o, p, r) in enumerate(zip(pieces.arg_origin, pieces.arg_piece, pieces.arg_rows)) if r == 1
    }
    results_at = {
        (o, p): k
        for k, (o, p, r) in enumerate(zip(pieces.result_origin, pieces.result_piece, pieces.result_rows))
        if r == 1
    }
    arg_rows, result_rows = list(pieces.arg_rows), list(pieces.result_rows)
    dropped_args: set[int] = set()
    dropped_results: set[int] = set()
    joined_parts: set[ir.Value] = set()  # values fragments now return joined (their own results unread)
    arg_groups: list[tuple[list[ir.Value], ir.Value]] = []  # read as one once all are known
    held: list[HeldRange] = []
    for mesh, ranges in sorted(spans.items()):
        for a, b in ranges:
            arguments = results = 0
            for origin in sorted({o for o, _ in args_at}):
                ks = [args_at.get((origin, p)) for p in range(a, b)]
                if None in ks:
                    continue
                parts = [block.arguments[k] for k in ks]
                if not all(MeshTensorType.parse(str(v.type)).mesh_name == mesh and _readers(v) for v in parts):
                    continue
                whole = parts[0]
                whole.set_type(_mesh_type(whole, _stacked(_tensor(whole), b - a, False), False))
                arg_groups.append((parts, whole))
                arg_rows[ks[0]] = b - a
                dropped_args.update(ks[1:])
                arguments += 1
            for origin in sorted({o for o, _ in results_at}):
                rs = [results_at.get((origin, p)) for p in range(a, b)]
                if None in rs:
                    continue
                values = [ret.operands[r] for r in rs]
                makers = {v.owner.operation if isinstance(v, ir.OpResult) else None for v in values}
                maker = makers.pop() if len(makers) == 1 else None
                if (
                    maker is None
                    or maker.name != "mpmd.fragment"
                    or len(set(values)) != len(values)
                    or MeshTensorType.parse(str(values[0].type)).mesh_name != mesh
                    or any(len(list(v.uses)) != 1 for v in values)
                ):
                    continue
                terminator = list(maker.regions[0].blocks[0].operations)[-1].operation
                inner = list(terminator.operands)
                positions = [list(maker.results).index(v) for v in values]
                with ir.InsertionPoint(terminator), terminator.location:
                    joined = stablehlo.ConcatenateOp([inner[p] for p in positions], 0).result
                new = _refragment(
                    maker,
                    list(maker.operands),
                    inner + [joined],
                    [r.type for r in maker.results] + [_mesh_type(values[0], ir.RankedTensorType(joined.type), False)],
                )
                for old, made in zip(maker.results, new.results):
                    old.replace_all_uses_with(made)
                maker.erase()
                ret.operands[rs[0]] = new.results[-1]
                joined_parts.update(inner[p] for p in positions)
                result_rows[rs[0]] = b - a
                dropped_results.update(rs[1:])
                results += 1
            if arguments or results:
                held.append(HeldRange(mesh, a, b - a, arguments, results))
    _read_everywhere_as_one(arg_groups)
    if held:
        _renumber(main, pieces, arg_rows, result_rows, dropped_args, dropped_results)
        for fragment in [op.operation for op in block.operations if op.operation.name == "mpmd.fragment"]:
            returned = list(fragment.regions[0].blocks[0].operations)[-1].operands
            if any(v in joined_parts for v in returned):
                _drop_unread(fragment)
    return held


def _tensor(value: ir.Value) -> ir.RankedTensorType:
    """The tensor type of a mesh tensor value."""
    return ir.RankedTensorType(ir.Type.parse(MeshTensorType.parse(str(value.type)).tensor_type))


def _drop_unread(fragment: ir.Operation) -> None:
    """`fragment` without the results no one reads."""
    returned = list(list(fragment.regions[0].blocks[0].operations)[-1].operands)
    kept = [k for k, r in enumerate(fragment.results) if list(r.uses)]
    if len(kept) == len(returned):
        return
    new = _refragment(
        fragment, list(fragment.operands), [returned[k] for k in kept], [fragment.results[k].type for k in kept]
    )
    for n, k in enumerate(kept):
        fragment.results[k].replace_all_uses_with(new.results[n])
    fragment.erase()


def _renumber(
    main: ir.Operation,
    pieces: LayerPieces,
    arg_rows: list[int],
    result_rows: list[int],
    dropped_args: set[int],
    dropped_results: set[int],
) -> None:
    """`@main` without the arguments and results joined into others: its signature, its
    arguments' and results' attributes (a donation kept where the argument and its result
    are still alike), `hlopar.layer_pieces` and the argument numbers it names."""
    block = main.regions[0].blocks[0]
    ret = list(block.operations)[-1].operation
    args = [k for k in range(len(block.arguments)) if k not in dropped_args]
    results = [k for k in range(len(ret.operands)) if k not in dropped_results]
    new_arg = {k: n for n, k in enumerate(args)}
    new_result = {k: n for n, k in enumerate(results)}
    values = [ret.operands[k] for k in results]
    with ir.InsertionPoint(ret), ret.location:
        func_dialect.ReturnOp(values)
    ret.erase()
    for k in sorted(dropped_args, reverse=True):
        block.erase_argument(k)
    count = len(pieces.arg_origin)
    arg_attrs = (
        list(ir.ArrayAttr(main.attributes["arg_attrs"]))
        if "arg_attrs" in main.attributes
        else ([ir.DictAttr.get({})] * count)
    )
    new_attrs = []
    for k in args:
        entries = {a.name: a.attr for a in ir.DictAttr(arg_attrs[k])}
        if ALIAS in entries:
            target = new_result.get(ir.IntegerAttr(entries[ALIAS]).value)
            if target is None or values[target].type != block.arguments[new_arg[k]].type:
                del entries[ALIAS]
            else:
                entries[ALIAS] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), target)
        new_attrs.append(ir.DictAttr.get(entries))
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(new_attrs)
    if "res_attrs" in main.attributes:
        res_attrs = list(ir.ArrayAttr(main.attributes["res_attrs"]))
        main.attributes["res_attrs"] = ir.ArrayAttr.get([res_attrs[k] for k in results])
    main.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in values])
    )
    main.attributes[LAYER_PIECES_ATTR] = LayerPieces(
        tuple(pieces.arg_origin[k] for k in args),
        tuple(pieces.arg_piece[k] for k in args),
        tuple(pieces.result_origin[k] for k in results),
        tuple(pieces.result_piece[k] for k in results),
        tuple(arg_rows[k] for k in args),
        tuple(result_rows[k] for k in results),
    ).attribute()
    if BATCH_ARGS_ATTR in main.attributes:
        main.attributes[BATCH_ARGS_ATTR] = ir.DenseI64ArrayAttr.get(
            [new_arg[k] for k in ir.DenseI64ArrayAttr(main.attributes[BATCH_ARGS_ATTR])]
        )
    if INDEX_ARG_ATTR in main.attributes:
        main.attributes[INDEX_ARG_ATTR] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(64), new_arg[ir.IntegerAttr(main.attributes[INDEX_ARG_ATTR]).value]
        )


def widen_joins(fragment: ir.Operation) -> int:
    """In an update fragment, each range result joined by `concatenate` from per-layer pieces
    computed alike (the optimizer's elementwise ops on each layer's rows) is computed once on
    the whole range instead (`_Widen`); returns how many joins were widened."""
    block = fragment.regions[0].blocks[0]
    terminator = list(block.operations)[-1].operation
    widen = _Widen(terminator)
    count = 0
    for value in list(terminator.operands):
        owner = value.owner
        if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.concatenate":
            continue
        join = owner.operation
        if ir.IntegerAttr(join.attributes["dimension"]).value != 0 or any(_shape(v)[0] != 1 for v in join.operands):
            continue
        wide = widen(tuple(join.operands))
        if wide is not None and wide.type == value.type:
            value.replace_all_uses_with(wide)
            count += 1
    if count:
        for op in reversed(list(block.operations)[:-1]):
            op = op.operation
            if op.name in _PURE and not any(list(r.uses) for r in op.results):
                op.erase()
    return count


_SHARDING = re.compile(r"sdy\.sharding = #sdy\.sharding_per_value<\[(?:<[^<>]*>(?:, )?)*\]>,? ?")
_PURE = ELEMENTWISE | {
    "stablehlo.slice",
    "stablehlo.reshape",
    "stablehlo.concatenate",
    "stablehlo.broadcast_in_dim",
    "stablehlo.constant",
    "stablehlo.reverse",
}


@dataclass
class _Widen:
    """One value of n rows from n values (row i of the result is the i-th: with `lead`, each
    value's unit leading dim becomes the rows, else a leading dim is added), made before
    `before`: a value shared by all rows is broadcast, rows of one stack in order are that
    stack's slice (reversed for a descending order), values made alike by elementwise ops (and
    broadcasts, sharding constraints) are made once from their widened operands; None where
    neither holds."""

    before: ir.Operation
    made: dict[tuple, ir.Value | None] = field(default_factory=dict)

    def __call__(self, values: tuple[ir.Value, ...], lead: bool = True) -> ir.Value | None:
        if (values, lead) not in self.made:
            with ir.InsertionPoint(self.before), self.before.location:
                self.made[(values, lead)] = self._widened(values, lead)
        return self.made[(values, lead)]

    def _widened(self, values: tuple[ir.Value, ...], lead: bool) -> ir.Value | None:
        n, t = len(values), ir.RankedTensorType(values[0].type)
        if lead and (t.rank == 0 or t.shape[0] != 1):
            return values[0] if t.rank == 0 and len(set(values)) == 1 else None  # a shared scalar operand
        rest = list(t.shape[1:] if lead else t.shape)
        wide = ir.RankedTensorType.get([n] + rest, t.element_type, t.encoding)
        if len(set(values)) == 1:
            dims = list(range(t.rank)) if lead else list(range(1, t.rank + 1))
            return stablehlo.BroadcastInDimOp(wide, values[0], ir.DenseI64ArrayAttr.get(dims)).result
        rows = _rows_of_one(values)
        if rows is not None:
            return _rows(rows[1], rows[2], rows[3], n, wide)
        owners = [v.owner for v in values]
        ops = [None if isinstance(o, ir.Block) else o.operation for o in owners]
        if any(op is None for op in ops) or len(ops[0].results) != 1:
            return self._joined(values, wide)
        structures = {_structure(op) for op in ops}
        if len(structures) > 1 and all(op.name == "sdy.sharding_constraint" for op in ops):
            return self(tuple(op.operands[0] for op in ops), lead)  # differing constraints: none
        # Layers laid out differently (a layer cut between stages) are computed alike all the same.
        if len({_SHARDING.sub("", text) for text in structures}) != 1:
            return self._joined(values, wide)
        name = ops[0].name
        if name == "stablehlo.constant":
            attr = ir.DenseElementsAttr(ops[0].attributes["value"])
            if not attr.is_splat:
                return None
            return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(wide, attr.get_splat_value())).result
        if name == "stablehlo.broadcast_in_dim":
            dims = _ints(ops[0], "broadcast_dimensions")
            if lead and 0 in dims:
                return None
            operand = self(tuple(op.operands[0] for op in ops), lead=False)
            if operand is None:
                return None
            return stablehlo.BroadcastInDimOp(
                wide, operand, ir.DenseI64ArrayAttr.get([0] + [d if lead else d + 1 for d in dims])
            ).result
        if name not in ELEMENTWISE:
            return self._joined(values, wide)
        operands = [self(tuple(op.operands[k] for op in ops), lead) for k in range(len(ops[0].operands))]
        if any(v is None for v in operands):
            return None
        clone = ops[0].clone(ip=ir.InsertionPoint(self.before))
        for k, v in enumerate(operands):
            clone.operands[k] = v
        clone.results[0].set_type(wide)
        if name == "sdy.sharding_constraint" and not lead:  # the new rows dim: whole
            sharding = TensorSharding.parse(str(clone.attributes["sharding"]))
            clone.attributes["sharding"] = ir.Attribute.parse(
                replace(sharding, dims=(DimSharding(),) + sharding.dims).format()
            )
        elif "sdy.sharding" in clone.attributes and (not lead or len(structures) > 1):
            del clone.attributes["sdy.sharding"]  # of the rank before, or differing: left to propagation
        return clone.results[0]

    def _joined(self, values: tuple[ir.Value, ...], wide: ir.RankedTensorType) -> ir.Value | None:
        """The values as runs of rows of stacks (in order, each run at least two rows) and
        single values between them, concatenated (the layer a stage computed outside its
        loop beside the loop's rows); None without such a run."""
        segments: list[tuple[int, int]] = []  # (start, end) in values
        start = 0
        while start < len(values):
            end = start + 1
            while end < len(values) and _rows_of_one(values[start : end + 1]) is not None:
                end += 1
            segments.append((start, end))
            start = end
        if all(end - start == 1 for start, end in segments):
            return None
        parts = []
        for start, end in segments:
            t = ir.RankedTensorType.get([end - start] + list(wide.shape[1:]), wide.element_type, wide.encoding)
            if end - start == 1:
                value = values[start]
                parts.append(value if value.type == t else stablehlo.ReshapeOp(t, value).result)
            else:
                _, stack, first, step = _rows_of_one(values[start:end])
                parts.append(_rows(stack, first, step, end - start, t))
        return stablehlo.ConcatenateOp(parts, 0).result


def _rows(stack: ir.Value, first: int, step: int, n: int, wide: ir.RankedTensorType) -> ir.Value:
    """Rows first, first + step, ... (n of them) of `stack`, as `wide`."""
    low = first if step == 1 else first - n + 1
    source = ir.RankedTensorType(stack.type)
    if low != 0 or source.shape[0] != n:
        stack = stablehlo.SliceOp(
            stack, [low] + [0] * (source.rank - 1), [low + n] + list(source.shape[1:]), [1] * source.rank
        ).result
    if step == -1:
        stack = stablehlo.ReverseOp(stack, ir.DenseI64ArrayAttr.get([0])).result
    return stack if stack.type == wide else stablehlo.ReshapeOp(wide, stack).result
