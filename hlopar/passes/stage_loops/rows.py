"""Rows of a stacked value in stablehlo: reading one (by a loop's counter or a fixed index),
writing one, packing values into a stack, and recognizing a value as a row of a stack."""

from __future__ import annotations

from collections.abc import Sequence

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

__all__ = [
    "dynamic_row",
    "int_array",
    "int_constant",
    "pack_rows",
    "row_of",
    "row_range",
    "rows_of_one",
    "shape_of",
    "static_row",
    "with_unit_dim",
    "write_dynamic_row",
    "zeros",
]


def int_constant(t: ir.RankedTensorType, number: int) -> ir.Value:
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, number))).result


def zeros(t: ir.RankedTensorType) -> ir.Value:
    element = t.element_type
    zero = ir.IntegerAttr.get(element, 0) if isinstance(element, ir.IntegerType) else ir.FloatAttr.get(element, 0.0)
    scalar = ir.RankedTensorType.get([], element)
    return stablehlo.BroadcastInDimOp(
        t, stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(scalar, zero)).result, ir.DenseI64ArrayAttr.get([])
    ).result


def with_unit_dim(t: ir.Type) -> ir.RankedTensorType:
    t = ir.RankedTensorType(t)
    return ir.RankedTensorType.get([1] + list(t.shape), t.element_type, t.encoding)


def pack_rows(values: Sequence[ir.Value]) -> ir.Value:
    """One stack of per-iteration values, in iteration order."""
    t = ir.RankedTensorType(values[0].type)
    rows = [stablehlo.ReshapeOp(with_unit_dim(t), v).result for v in values]
    stacked = ir.RankedTensorType.get([len(values)] + list(t.shape), t.element_type, t.encoding)
    return stablehlo.ConcatenateOp(rows, 0, results=[stacked]).result


def dynamic_row(stacked: ir.Value, counter: ir.Value, row_type: ir.Type, first: int = 0, step: int = 1) -> ir.Value:
    """Row `first + step * counter` of `stacked`, as `row_type` (the row itself, or without
    its unit leading dim)."""
    t, source = ir.RankedTensorType(row_type), ir.RankedTensorType(stacked.type)
    index_type = ir.RankedTensorType(counter.type)
    zero = int_constant(index_type, 0)
    index = counter
    if step != 1:
        index = stablehlo.MulOp(index, int_constant(index_type, step)).result
    if first:
        index = stablehlo.AddOp(index, int_constant(index_type, first)).result
    row = stablehlo.DynamicSliceOp(stacked, [index] + [zero] * (source.rank - 1), [1] + list(source.shape)[1:]).result
    return row if row.type == t else stablehlo.ReshapeOp(t, row).result


def write_dynamic_row(buffer: ir.Value, value: ir.Value, counter: ir.Value) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    zero = int_constant(ir.RankedTensorType(counter.type), 0)
    row = stablehlo.ReshapeOp(with_unit_dim(t), value).result
    return stablehlo.DynamicUpdateSliceOp(buffer, row, [counter] + [zero] * t.rank).result


def static_row(stacked: ir.Value, i: int, row_type: ir.Type) -> ir.Value:
    t = ir.RankedTensorType(row_type)
    row = stablehlo.SliceOp(stacked, [i] + [0] * t.rank, [i + 1] + list(t.shape), [1] * (t.rank + 1)).result
    return stablehlo.ReshapeOp(t, row).result


def row_range(stack: ir.Value, first: int, step: int, n: int, wide: ir.RankedTensorType) -> ir.Value:
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


def row_of(value: ir.Value) -> tuple[ir.Value, int] | None:
    """`(stack, r)` when `value` is row r of `stack` (a unit slice of its leading dim, whole
    in the others, maybe reshaped without that dim; through a sharding constraint on it,
    which a loop reading the row by its counter does without), else None."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    op = owner.operation
    if op.name == "sdy.sharding_constraint":
        return row_of(op.operands[0])
    if op.name == "stablehlo.reshape" and not isinstance(op.operands[0].owner, ir.Block):
        inner = op.operands[0].owner.operation
        if inner.name == "stablehlo.slice" and list(shape_of(op.operands[0])[1:]) == shape_of(value):
            op = inner
    if op.name != "stablehlo.slice":
        return None
    source = op.operands[0]
    start, limit = int_array(op, "start_indices"), int_array(op, "limit_indices")
    if (
        limit[0] - start[0] != 1
        or any(start[1:])
        or limit[1:] != shape_of(source)[1:]
        or set(int_array(op, "strides")) != {1}
    ):
        return None
    return source, start[0]


def rows_of_one(values: Sequence[ir.Value]) -> tuple | None:
    """`("rows", stack, first, step)` when the per-iteration `values` are rows first,
    first + step, ... (step +1 or -1) of one stack: the loop then slices the stack itself
    instead of packing copies of its rows."""
    rows = [row_of(v) for v in values]
    if any(r is None for r in rows) or len({r[0] for r in rows}) != 1:
        return None
    first = rows[0][1]
    for step in (1, -1):
        if all(r[1] == first + step * i for i, r in enumerate(rows)):
            return ("rows", rows[0][0], first, step)
    return None


def shape_of(value: ir.Value) -> list[int]:
    return list(ir.RankedTensorType(value.type).shape)


def int_array(op: ir.Operation, name: str) -> list[int]:
    return list(ir.DenseI64ArrayAttr(op.attributes[name]))
