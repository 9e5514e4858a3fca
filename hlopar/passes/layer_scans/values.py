"""What the layer-scan rewrites ask of values: shapes and constant indices."""

from __future__ import annotations

from jaxlib.mlir import ir

__all__ = ["constant_int", "dense_ints", "is_constant", "shape_of"]


def shape_of(value: ir.Value) -> list[int] | None:
    try:
        return list(ir.RankedTensorType(value.type).shape)
    except ValueError:
        return None


def constant_int(value: ir.Value) -> int | None:
    """The value of a scalar integer computed from constants (an unrolled loop's layer index:
    the counter, `L - 1 - i` of a reversed scan, JAX's wrap of negative indices), else None."""
    owner = value.owner
    if not isinstance(owner, ir.OpView):
        return None
    op = owner.operation
    name = op.name
    if name == "stablehlo.constant":
        try:
            attr = ir.DenseIntElementsAttr(op.attributes["value"])
        except ValueError:
            return None
        return int(attr[0]) if attr.is_splat or len(attr) == 1 else None
    if name in ("stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim", "sdy.sharding_constraint"):
        shape = shape_of(op.results[0])
        return constant_int(op.operands[0]) if shape is not None and all(d == 1 for d in shape) else None
    operands = [constant_int(v) for v in op.operands]
    if any(x is None for x in operands):
        return None
    if name == "stablehlo.compare":
        a, b = operands
        direction = str(op.attributes["comparison_direction"])
        for key, result in (
            ("LT", a < b),
            ("LE", a <= b),
            ("GT", a > b),
            ("GE", a >= b),
            ("EQ", a == b),
            ("NE", a != b),
        ):
            if key in direction:
                return int(result)
        return None
    arithmetic = {
        "stablehlo.add": lambda a, b: a + b,
        "stablehlo.subtract": lambda a, b: a - b,
        "stablehlo.multiply": lambda a, b: a * b,
        "stablehlo.maximum": max,
        "stablehlo.minimum": min,
        "stablehlo.negate": lambda a: -a,
        "stablehlo.select": lambda p, a, b: a if p else b,
        "stablehlo.clamp": lambda lo, x, hi: min(max(x, lo), hi),
    }
    return arithmetic[name](*operands) if name in arithmetic else None


def is_constant(value: ir.Value) -> bool:
    owner = value.owner
    return isinstance(owner, ir.OpView) and owner.operation.name == "stablehlo.constant"


def dense_ints(op: ir.Operation, name: str) -> list[int]:
    """An op's integer array attribute (`array<i64>` or a dense elements attribute)."""
    attr = op.attributes[name]
    try:
        return list(ir.DenseI64ArrayAttr(attr))
    except ValueError:
        return [int(x) for x in ir.DenseIntElementsAttr(attr)]
