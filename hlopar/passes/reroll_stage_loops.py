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
run unrolled, and the report says why. The fragment's arguments and results are unchanged,
so the instruction streams, the transfers and the runtime run it as before; the update
fragments (the optimizer, elementwise per piece) stay unrolled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.ir.extract import clone_into
from hlopar.passes.base import ModulePass, PassContext, option
from hlopar.passes.mpmd_program import fragment_role
from hlopar.passes.split_microbatches import BATCH, KIND_ATTR, SUM
from hlopar.passes.unstack_layer_scans import LAYER_ITERATION_ATTR

__all__ = ["LAYER_LOOP_ATTR", "LoopRange", "RerollStageLoopsPass", "fragments", "identical_runs", "reroll_block",
           "stage_loop_lines"]

LAYER_LOOP_ATTR = "hlopar.layer_loop"


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
    summary = ("inside each fragment, run the iterations of an unrolled layer scan that the fragment holds as one "
               "stablehlo.while over their range again")

    reroll: Literal["auto", "never"] = option(
        "auto", "auto: re-roll each run of at least min-trips identical iterations; never: keep every stage unrolled")
    min_trips: int = option(2, "re-roll runs of at least this many iterations (one iteration is cheaper unrolled)")
    report: str | None = option(None, "write a JSON report of the rolled and unrolled ranges to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        if self.min_trips < 1:
            self.fail(module, f"min-trips must be at least 1, got {self.min_trips}")
        ranges: list[LoopRange] = []
        with module.context, ir.Location.unknown():
            for fragment in fragments(module):
                if fragment_role(fragment) == "update":  # the optimizer: elementwise per piece, not a loop body
                    continue
                made = reroll_block(fragment.regions[0].blocks[0], _origin(fragment),
                                    min_trips=self.min_trips, rewrite=self.reroll == "auto")
                for r in made:
                    if not r.rolled and r.trips >= self.min_trips and self.reroll == "auto":
                        context.warn(fragment, f"{self.name}: layers {r.layers[0]}..{r.layers[-1]} of loop {r.loop} "
                                               f"stay unrolled in {r.fragment}: {r.reason}")
                ranges += made
        if self.report:
            with open(self.report, "w") as out:
                json.dump({"pass": self.name, "reroll": self.reroll, "ranges": [asdict(r) for r in ranges]},
                          out, indent=1)


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
    keys = {loop: {i: tuple((tags[op][2], _structure(op)) for op in ops) for i, ops in iterations.items()}
            for loop, iterations in by_loop.items()}  # before any rewrite
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
                elif (made[0] is None and all(m is not None and m[0] == i - 1 for i, m in enumerate(made) if i)
                      and len({m[1:] for m in made[1:]}) == 1):
                    self.wiring[(j, o)] = ("carry", values[0], made[1][1:])  # one slot per (first, next)
                elif all(m is None for m in made):
                    if all(v == values[0] for v in values):
                        self.wiring[(j, o)] = ("invariant", values[0])
                    else:
                        self.wiring[(j, o)] = ("packed", tuple(values))
                else:
                    return (f"operand {o} of '{template.name}' reads values of other iterations than the loop's "
                            "own or its previous one")
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
        outputs = [(j, r) for j, op in enumerate(template) for r in range(len(op.results))
                   if any(_used_outside(ops[j].results[r], members) for ops in groups)]
        carried_out = {how[2] for how in self.wiring.values() if how[0] == "carry"}
        # A carry read outside only after the last iteration (the stage's output): the loop's result.
        kinds = {_kind(op) for op in members}
        loop_kind = next((kind for kind in (BATCH, SUM) if kind in kinds), None)
        last_only = {(j, r) for j, r in outputs if (j, r) in carried_out and _kind(template[j]) == loop_kind
                     and not any(_used_outside(ops[j].results[r], members) for ops in groups[:-1])}
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
                more = stablehlo.CompareOp(cond.arguments[0], _constant(scalar, trips),
                                           stablehlo.ComparisonDirectionAttr.get("LT"),
                                           compare_type=stablehlo.ComparisonTypeAttr.get("SIGNED")).result
                stablehlo.ReturnOp([more])
            body = loop.regions[1].blocks.append(*[v.type for v in carried])
            args = body.arguments
            counter = args[0]
            with ir.InsertionPoint(body):
                mapping: dict[ir.Value, ir.Value] = {}
                clones: list[ir.Operation] = []
                for j, op in enumerate(template):
                    for o in range(len(op.operands)):
                        how = self.wiring[(j, o)]
                        kind = how[0]
                        if kind == "body":
                            value = clones[how[1][0]].results[how[1][1]]
                        elif kind == "packed":
                            value = _row(args[slots[how]], counter, how[1][0].type)
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
    return stablehlo.BroadcastInDimOp(t, stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(scalar, zero)).result,
                                      ir.DenseI64ArrayAttr.get([])).result


def _unit(t: ir.Type) -> ir.RankedTensorType:
    t = ir.RankedTensorType(t)
    return ir.RankedTensorType.get([1] + list(t.shape), t.element_type, t.encoding)


def _pack(values: Sequence[ir.Value]) -> ir.Value:
    """One stack of per-iteration values, in iteration order."""
    t = ir.RankedTensorType(values[0].type)
    rows = [stablehlo.ReshapeOp(_unit(t), v).result for v in values]
    stacked = ir.RankedTensorType.get([len(values)] + list(t.shape), t.element_type, t.encoding)
    return stablehlo.ConcatenateOp(rows, 0, results=[stacked]).result


def _row(stacked: ir.Value, counter: ir.Value, row_type: ir.Type) -> ir.Value:
    t = ir.RankedTensorType(row_type)
    zero = _constant(ir.RankedTensorType(counter.type), 0)
    row = stablehlo.DynamicSliceOp(stacked, [counter] + [zero] * t.rank, [1] + list(t.shape)).result
    return stablehlo.ReshapeOp(t, row).result


def _write_row(buffer: ir.Value, value: ir.Value, counter: ir.Value) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    zero = _constant(ir.RankedTensorType(counter.type), 0)
    row = stablehlo.ReshapeOp(_unit(t), value).result
    return stablehlo.DynamicUpdateSliceOp(buffer, row, [counter] + [zero] * t.rank).result


def _static_row(stacked: ir.Value, i: int, row_type: ir.Type) -> ir.Value:
    t = ir.RankedTensorType(row_type)
    row = stablehlo.SliceOp(stacked, [i] + [0] * t.rank, [i + 1] + list(t.shape), [1] * (t.rank + 1)).result
    return stablehlo.ReshapeOp(t, row).result
