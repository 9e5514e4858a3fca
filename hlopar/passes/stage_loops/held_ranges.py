"""A stage holds the layers it loops over as one range (`hold_ranges`, `return_stacks`): the
pieces of a stacked argument or result of `@main` become one value of rows, which fragments
read by slices, so a rolled loop reads them by its counter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import mpmd, stablehlo

from hlopar.analysis.mesh import quote_string
from hlopar.analysis.mpmd import MeshTensorType
from hlopar.analysis.sharding import DimSharding
from hlopar.analysis.stage_loops import HeldRange
from hlopar.dialect.attributes import BATCH_ARGS_ATTR, INDEX_ARG_ATTR, KIND_ATTR, LAYER_PIECES_ATTR
from hlopar.dialect.layers import LayerPieces
from hlopar.dialect.mpmd import fragments, is_fragment, reshaped_fragment
from hlopar.passes.stage_loops.rows import row_of, shape_of

__all__ = ["hold_ranges", "return_stacks"]

ALIAS = "tf.aliasing_output"


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
    new = reshaped_fragment(fragment, types, operands)
    block.append_to(new.regions[0])
    terminator = list(block.operations)[-1].operation
    with ir.InsertionPoint(terminator), terminator.location:
        mpmd.ReturnOp(list(returned))
    terminator.erase()
    return new


def _read_as_one(fragment: ir.Operation, groups: Sequence[tuple[Sequence[ir.Value], ir.Value]]) -> ir.Operation:
    """`fragment` reading, per group `(parts, whole)`, `whole` (a stack of rows `parts`, in
    order) in place of the parts: each part's block argument becomes a slice of the new one (a
    loop over the rows then reads the stack by its counter, `rows_of_one`)."""
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
        if not is_fragment(op):
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
        row = row_of(value)
        if row is not None and isinstance(row[0].owner, ir.OpView) and row[0].owner.operation.name == "stablehlo.while":
            by_stack.setdefault(row[0], {}).setdefault(row[1], position)
    groups = []
    for stack, rows in by_stack.items():
        positions = [rows.get(r) for r in range(shape_of(stack)[0])]
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
        lead = shape_of(stack)[1:] == shape_of(returned[positions[0]])
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
    holding = _Holding(main, pieces)
    held: list[HeldRange] = []
    for mesh, ranges in sorted(spans.items()):
        for a, b in ranges:
            arguments = holding.join_arguments(mesh, a, b)
            results = holding.join_results(mesh, a, b)
            if arguments or results:
                held.append(HeldRange(mesh, a, b - a, arguments, results))
    _read_everywhere_as_one(holding.arg_groups)
    if held:
        _renumber(main, pieces, holding.arg_rows, holding.result_rows, holding.dropped_args, holding.dropped_results)
        for fragment in fragments(main):
            returned = list(fragment.regions[0].blocks[0].operations)[-1].operands
            if any(v in holding.joined_parts for v in returned):
                _drop_unread(fragment)
    return held


class _Holding:
    """What `hold_ranges` has joined so far in `@main`: per argument and result its rows, the
    ones joined into another (dropped), the argument groups its readers will read as one."""

    def __init__(self, main: ir.Operation, pieces: LayerPieces):
        self.block = main.regions[0].blocks[0]
        self.ret = list(self.block.operations)[-1].operation
        self.args_at = {
            (o, p): k for k, (o, p, r) in enumerate(zip(pieces.arg_origin, pieces.arg_piece, pieces.arg_rows)) if r == 1
        }
        self.results_at = {
            (o, p): k
            for k, (o, p, r) in enumerate(zip(pieces.result_origin, pieces.result_piece, pieces.result_rows))
            if r == 1
        }
        self.arg_rows, self.result_rows = list(pieces.arg_rows), list(pieces.result_rows)
        self.dropped_args: set[int] = set()
        self.dropped_results: set[int] = set()
        self.joined_parts: set[ir.Value] = set()  # values fragments now return joined (their own results unread)
        self.arg_groups: list[tuple[list[ir.Value], ir.Value]] = []  # read as one once all are known

    def join_arguments(self, mesh: str, a: int, b: int) -> int:
        """Joins the pieces a..b-1 of each stacked argument that only fragments on `mesh`
        read into its first piece's argument (retyped to rows a:b); returns how many."""
        count = 0
        for origin in sorted({o for o, _ in self.args_at}):
            ks = [self.args_at.get((origin, p)) for p in range(a, b)]
            if None in ks:
                continue
            parts = [self.block.arguments[k] for k in ks]
            if not all(MeshTensorType.parse(str(v.type)).mesh_name == mesh and _readers(v) for v in parts):
                continue
            whole = parts[0]
            whole.set_type(_mesh_type(whole, _stacked(_tensor(whole), b - a, False), False))
            self.arg_groups.append((parts, whole))
            self.arg_rows[ks[0]] = b - a
            self.dropped_args.update(ks[1:])
            count += 1
        return count

    def join_results(self, mesh: str, a: int, b: int) -> int:
        """Joins the pieces a..b-1 of each stacked result that one fragment on `mesh` makes
        (and only `@main` returns) into one result of that fragment; returns how many."""
        count = 0
        ret = self.ret
        for origin in sorted({o for o, _ in self.results_at}):
            rs = [self.results_at.get((origin, p)) for p in range(a, b)]
            if None in rs:
                continue
            values = [ret.operands[r] for r in rs]
            makers = {v.owner.operation if isinstance(v, ir.OpResult) else None for v in values}
            maker = makers.pop() if len(makers) == 1 else None
            if (
                maker is None
                or not is_fragment(maker)
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
            self.joined_parts.update(inner[p] for p in positions)
            self.result_rows[rs[0]] = b - a
            self.dropped_results.update(rs[1:])
            count += 1
        return count


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
