"""Finding the runs of identical iterations of an unrolled loop in a fragment's block
(`reroll_block`) and rolling each back into one `stablehlo.while` (`_Reroll`; the rules in
passes/reroll_stage_loops.py's docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.stage_loops import LoopRange, identical_runs
from hlopar.dialect.attributes import BATCH, KIND_ATTR, LAYER_ITERATION_ATTR, LAYER_LOOP_ATTR, SUM
from hlopar.ir.extract import clone_into
from hlopar.passes.stage_loops.rows import (
    dynamic_row,
    int_constant,
    pack_rows,
    rows_of_one,
    static_row,
    write_dynamic_row,
    zeros,
)

__all__ = ["op_structure", "reroll_block"]


def _tag(op: ir.Operation) -> tuple[int, int, int, int] | None:
    if LAYER_ITERATION_ATTR not in op.attributes:
        return None
    return tuple(ir.DenseI64ArrayAttr(op.attributes[LAYER_ITERATION_ATTR]))


_NAME = re.compile(r"[%^][\w#.$-]+")
_TAG_TEXT = re.compile(re.escape(LAYER_ITERATION_ATTR) + r" = array<i64:[^>]*>,? ?")


def op_structure(op: ir.Operation) -> str:
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
        loop: {i: tuple((tags[op][2], op_structure(op)) for op in ops) for i, ops in iterations.items()}
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
                        self.wiring[(j, o)] = rows_of_one(values) or ("packed", tuple(values))
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
        """Builds the while before the run's first op, points the uses outside the run at its
        results and erases the run."""
        groups = self.groups
        position = {op.operation: k for k, op in enumerate(self.block.operations)}
        first_op = min((op for ops in groups for op in ops), key=position.__getitem__)
        members = {op for ops in groups for op in ops}
        outputs, last_only, loop_kind = self._outputs(members)
        with ir.InsertionPoint(first_op), first_op.location:
            carried, slots = self._carried(outputs)
            loop = self._while(carried, loop_kind)
            self._body(loop.regions[1].blocks.append(*[v.type for v in carried]), slots)
            self._replace_uses(loop, slots, outputs, last_only, members)
        for op in sorted(members, key=position.__getitem__, reverse=True):
            op.erase()

    def _outputs(self, members: set[ir.Operation]) -> tuple[list[tuple[int, int]], set[tuple[int, int]], str | None]:
        """The template results (op position, result) read outside the run, each stacked into
        a buffer by the loop; the carries read outside only after the last iteration (the
        stage's output), which are the loop's results instead; the loop's microbatch kind."""
        groups, template = self.groups, self.groups[0]
        outputs = [
            (j, r)
            for j, op in enumerate(template)
            for r in range(len(op.results))
            if any(_used_outside(ops[j].results[r], members) for ops in groups)
        ]
        carried_out = {how[2] for how in self.wiring.values() if how[0] == "carry"}
        kinds = {_kind(op) for op in members}
        loop_kind = next((kind for kind in (BATCH, SUM) if kind in kinds), None)
        last_only = {
            (j, r)
            for j, r in outputs
            if (j, r) in carried_out
            and _kind(template[j]) == loop_kind
            and not any(_used_outside(ops[j].results[r], members) for ops in groups[:-1])
        }
        return [o for o in outputs if o not in last_only], last_only, loop_kind

    def _carried(self, outputs: list[tuple[int, int]]) -> tuple[list[ir.Value], dict[tuple, int]]:
        """What the loop carries (its counter first, then carries, invariants, held ranges,
        packed stacks, output buffers) and, per wiring key, its position among them."""
        template, trips = self.groups[0], len(self.groups)
        carried: list[ir.Value] = [int_constant(_counter_type(), 0)]
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
                slot(how, pack_rows(how[1]))
        for j, r in outputs:
            t = ir.RankedTensorType(template[j].results[r].type)
            buffer = zeros(ir.RankedTensorType.get([trips] + list(t.shape), t.element_type, t.encoding))
            slot(("output", j, r), buffer)
        return carried, slots

    def _while(self, carried: list[ir.Value], loop_kind: str | None) -> ir.Operation:
        """The while over `carried` with its condition (counter < trips); the body comes next."""
        loop = stablehlo.WhileOp([v.type for v in carried], carried)
        loop.attributes[LAYER_LOOP_ATTR] = ir.DenseI64ArrayAttr.get(list(self.tag))
        if loop_kind is not None:  # what codegen reads of a value the loop returns
            loop.attributes[KIND_ATTR] = ir.StringAttr.get(loop_kind)
        cond = loop.regions[0].blocks.append(*[v.type for v in carried])
        with ir.InsertionPoint(cond):
            more = stablehlo.CompareOp(
                cond.arguments[0],
                int_constant(_counter_type(), len(self.groups)),
                stablehlo.ComparisonDirectionAttr.get("LT"),
                compare_type=stablehlo.ComparisonTypeAttr.get("SIGNED"),
            ).result
            stablehlo.ReturnOp([more])
        return loop

    def _body(self, body: ir.Block, slots: dict[tuple, int]) -> None:
        """The loop body: the template's ops cloned, reading per `wiring`; it returns the next
        counter, the next carries and the buffers with this iteration's row written."""
        template = self.groups[0]
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
                        value = dynamic_row(args[slots[how]], counter, how[1][0].type)
                    elif kind == "rows":  # one read per row and type, however many ops read it
                        key = (how, str(op.operands[o].type))
                        if key not in rows_read:
                            rows_read[key] = dynamic_row(
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
            returned[0] = stablehlo.AddOp(counter, int_constant(_counter_type(), 1)).result
            for key, k in slots.items():
                if key[0] == "carry":
                    jj, rr = key[2]
                    returned[k] = clones[jj].results[rr]
                elif key[0] == "output":
                    _, j, r = key
                    returned[k] = write_dynamic_row(args[k], clones[j].results[r], counter)
            stablehlo.ReturnOp(returned)

    def _replace_uses(
        self,
        loop: ir.Operation,
        slots: dict[tuple, int],
        outputs: list[tuple[int, int]],
        last_only: set[tuple[int, int]],
        members: set[ir.Operation],
    ) -> None:
        """Points the reads outside the run at the loop: a last-only carry at its result, an
        output at its iteration's row of the stacked buffer."""
        groups = self.groups
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
                    row = static_row(stacked, i, value.type)
                    if KIND_ATTR in ops[j].attributes:  # what codegen reads of a returned value
                        row.owner.attributes[KIND_ATTR] = ops[j].attributes[KIND_ATTR]
                    for use in list(value.uses):
                        if use.owner.operation not in members:
                            use.owner.operands[use.operand_number] = row


def _counter_type() -> ir.RankedTensorType:
    """The loop counter's type (and of its bounds): a 32-bit integer scalar."""
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))


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
