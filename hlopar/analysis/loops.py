"""Loops of a function's graph view: how many times a `while` runs.

Shared by the FLOP count (stage construction) and the auto-sharding ILP, which both weigh a
loop's body by its iterations.
"""

from __future__ import annotations

from jaxlib.mlir import ir

from hlopar.ir.graph import FuncGraph, OpNode


def trip_count(graph: FuncGraph, loop: OpNode) -> int:
    """Iterations of a `while` counting from a constant to a constant (JAX's `fori_loop`:
    `compare LT, counter, bound`); 1 when the pattern is not there."""
    (cond,), _ = loop.regions
    if not cond.ops or cond.ops[-1].name != "stablehlo.return":
        return 1
    (predicate,) = cond.ops[-1].operands or (None,)
    compare = graph.defining_op(_through_constraints(graph, predicate)) if predicate is not None else None
    if compare is None or compare.name != "stablehlo.compare" or compare.attrs is None:
        return 1
    direction = getattr(compare.attrs, "direction", None)
    lhs, rhs = (_through_constraints(graph, v) for v in compare.operands)
    if lhs not in cond.args or direction not in ("LT", "LE", "GT", "GE"):
        return 1
    start = _constant_int(graph, loop.operands[cond.args.index(lhs)])
    bound = _constant_int(graph, rhs)
    if start is None or bound is None:
        return 1
    count = {"LT": bound - start, "LE": bound - start + 1, "GT": start - bound, "GE": start - bound + 1}[direction]
    return max(1, count)


def _through_constraints(graph: FuncGraph, value_id: int) -> int:
    """The value a chain of `sdy.sharding_constraint`s (identities) starts from."""
    op = graph.defining_op(value_id)
    while op is not None and op.name == "sdy.sharding_constraint":
        value_id = op.operands[0]
        op = graph.defining_op(value_id)
    return value_id


def _constant_int(graph: FuncGraph, value_id: int) -> int | None:
    op = graph.defining_op(_through_constraints(graph, value_id))
    if op is None or op.name != "stablehlo.constant":
        return None
    try:
        attr = ir.DenseIntElementsAttr(op.mlir_op.attributes["value"])
        return int(attr[0]) if len(attr) >= 1 else None
    except (ValueError, TypeError, IndexError):
        return None
