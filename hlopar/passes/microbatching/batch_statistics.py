"""Batch statistics under microbatching: the means over the batch a step uses per example.

Batch normalization in training mode normalizes each example by the mean and variance of
its batch. Split into B microbatches, GPipe (Huang et al. 2019, §2.2) computes those
statistics over each microbatch: the microbatch program is the step itself on n = N/B
examples. In the IR of the whole step a mean over the batch is a sum over the batch divided
by the number of elements it sums (`jnp.mean`: `divide(reduce(x), N*H*W)`); its backward
divides the summed cotangent by the same count. Kept as they are, the microbatch program
would divide sums over n examples by the count of N. So the divisions found here, and only
these, get their count divided by B:

- the dividend is computed from sums over the batch (through ops that do not read
  per-example values), all reducing the same number c of elements;
- the divisor is the constant c (or the op multiplies by the constant 1/c);
- the quotient is used per example (it reaches an op that reads per-example values without
  passing through one): a statistic, not a loss or a metric, whose global mean the
  microbatches' sums add up to.

Pure functions over the `FuncGraph` of the whole step and the split's value kinds; the
pass (`split_microbatches`) rewrites the constants.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.ir.graph import FuncGraph, reaches

__all__ = ["mean_divisions", "reduced_count", "rescale_mean", "splat_value"]

# Ops a splat constant passes through unchanged in value.
_SPLAT_THROUGH = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert"})


def splat_value(value: ir.Value) -> float | None:
    """The number of a splat constant (possibly broadcast, reshaped or converted), else None."""
    while isinstance(value, ir.OpResult):
        op = value.owner
        if op.name in _SPLAT_THROUGH:
            value = op.operands[0]
            continue
        if op.name != "stablehlo.constant":
            return None
        attr = ir.DenseElementsAttr(op.attributes["value"])
        if not attr.is_splat:
            return None
        splat = attr.get_splat_value()
        if isinstance(splat, ir.FloatAttr):
            return ir.FloatAttr(splat).value
        if isinstance(splat, ir.IntegerAttr):
            return float(ir.IntegerAttr(splat).value)
        return None
    return None


def reduced_count(graph: FuncGraph, op: int) -> int | None:
    """How many elements each result element of a top-level reduction sums (None: not a
    plain reduce or dot)."""
    node = graph.ops[op]
    mlir_op = node.mlir_op
    if node.name == "stablehlo.reduce" and len(mlir_op.results) == 1:
        shape = graph.values[node.operands[0]].shape
        return math.prod(shape[d] for d in ir.DenseI64ArrayAttr(mlir_op.attributes["dimensions"]))
    if node.name == "stablehlo.dot_general":
        numbers = stablehlo.DotDimensionNumbers(mlir_op.attributes["dot_dimension_numbers"])
        shape = graph.values[node.operands[0]].shape
        return math.prod(shape[d] for d in numbers.lhs_contracting_dimensions)
    return None


def mean_divisions(
    graph: FuncGraph,
    kinds: Mapping[int, str | None],
    per_example: Collection[int],
    reductions: Mapping[int, int | None],
) -> list[int]:
    """The top-level divisions that take a mean over the batch used per example (module
    docstring). `kinds`: value -> kind ("sum"/"step": computed from sums over the batch);
    `per_example`: the ops that read or carry per-example values; `reductions`: those of
    them that sum over the batch, with `reduced_count`."""
    found = []
    for i, node in enumerate(graph.ops):
        if i in per_example or node.name not in ("stablehlo.divide", "stablehlo.multiply"):
            continue
        operands = list(node.operands)
        if node.name == "stablehlo.divide":
            dividend, divisor, inverse = operands[0], operands[1], False
        else:
            computed = [v for v in operands if kinds.get(v) is not None]
            if len(computed) != 1:
                continue
            dividend = computed[0]
            divisor = next(v for v in operands if v != dividend)
            inverse = True
        if kinds.get(dividend) not in ("sum", "step") or kinds.get(divisor) is not None:
            continue
        constant = splat_value(node.mlir_op.operands[operands.index(divisor)])
        counts = _counts(graph, dividend, per_example, reductions)
        if constant is None or len(counts) != 1 or None in counts:
            continue
        count = next(iter(counts))
        expected = 1.0 / count if inverse else float(count)
        if np.isclose(constant, expected, rtol=1e-6, atol=0.0) and reaches(graph.successors, i, per_example):
            found.append(i)
    return found


def rescale_mean(op: ir.Operation, microbatches: int, inverse: bool) -> None:
    """Divides the count of a mean found by `mean_divisions` by B (a new constant: the old one
    may be shared with a loss's mean, whose count stays global)."""
    position = 1 if not inverse else next(k for k in range(2) if splat_value(op.operands[k]) is not None)
    old = op.operands[position]
    tensor = ir.RankedTensorType(old.type)
    value = splat_value(old)
    with ir.InsertionPoint(op), op.location:
        attr = ir.FloatAttr.get(tensor.element_type, value * microbatches if inverse else value / microbatches)
        constant = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(tensor, attr))
    op.operands[position] = constant.result


def _counts(
    graph: FuncGraph, value: int, per_example: Collection[int], reductions: Mapping[int, int | None]
) -> set[int | None]:
    """The element counts of the batch reductions `value` is computed from, through ops that
    read no per-example value."""
    counts: set[int | None] = set()
    stack, seen = [value], {value}
    while stack:
        producer = graph.values[stack.pop()].producer
        if producer is None:
            continue
        if producer in reductions:
            counts.add(reductions[producer])
            continue
        if producer in per_example:
            counts.add(None)  # a loop or branch over the batch
            continue
        for v in graph.reads(producer):
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return counts
