"""Normalizers of the whole batch that do not depend on the parameters, factored out of the
microbatches.

A loss normalized over the whole batch, `sum(loss * weights) / sum(weights)` (the
padding-aware language-model loss: weights are the mask of real tokens), reads a statistic of
the whole batch per example: its backward multiplies each example's cotangent by
`1 / sum(weights)`. A microbatch sees only its own weights. But that scale s depends on the
batch only (not on the parameters), so the step is linear in it where it reads it per
example: every per-example value computed from it is s times the same value computed with
1, and so is every sum over the batch taken of them. The split therefore computes the
microbatches with 1 in its place and multiplies those sums by s after the microbatches' sums
(when s, computed from the summed weights, is the whole batch's): the full-batch step's
values, to rounding. The loss itself, `numerator / denominator` computed once on the two
sums, is the whole batch's.

Refused (the general refusal of a batch statistic used per example): a scale computed from
the parameters or the step's state (a normalizer the gradient flows through), one that is not
a float scalar, and a use that is not linear in it (the scale squared, inside a loop, two scales
added).

Pure over the `FuncGraph` and the split's kinds (`scale_uses`); `factor_scales` rewrites the
IR.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.dialect.attributes import SUM
from hlopar.ir.extract import value_of
from hlopar.ir.graph import FuncGraph
from hlopar.passes.microbatching.common import CONTROL_FLOW_OPS, linear_in_sums

__all__ = ["ScaleUses", "batch_only_values", "factor_scales", "scale_uses"]


@dataclass(frozen=True)
class ScaleUses:
    """Where scales are read per example (op, value) and the sums over the batch made from
    them (op -> the scale value it is proportional to)."""

    readers: tuple[tuple[int, int], ...]
    sums: dict[int, int]


def batch_only_values(graph: FuncGraph, batch_args: Collection[int]) -> set[int]:
    """The values computed from the batch arguments and constants only."""
    found = {a for i, a in enumerate(graph.args) if i in batch_args}
    for i in range(len(graph.ops)):
        if all(v in found for v in graph.reads(i)):
            found.update(graph.ops[i].results)
    return found


def scale_uses(
    graph: FuncGraph,
    statistics: Sequence[tuple[int, int]],
    batch_only: Collection[int],
    carries_batch: Callable[[int], bool],
) -> ScaleUses | str:
    """The uses of `statistics` ((op, value) pairs: a value computed from sums over the batch,
    read by an op that reads or carries examples) as scales (module docstring), or why they
    are not: the values must be batch-only scalars, and what is computed from them per
    example linear in them, up to the sums over the batch (ops whose results do not carry the
    batch), which are the ones to multiply by the scale."""
    for _, v in statistics:
        if v not in batch_only:
            return "it depends on the parameters or the step's state"
        if graph.values[v].shape != () or not graph.values[v].dtype.startswith(("f", "bf")):
            return "it is not a float scalar"
    readers = tuple(dict.fromkeys(statistics))
    scaled: dict[int, int] = {}  # value -> the scale it is proportional to
    sums: dict[int, int] = {}
    for i, node in enumerate(graph.ops):
        scales = [scaled.get(v, v if (i, v) in readers else None) for v in node.operands]
        found = {s for s in scales if s is not None}
        if not found:
            continue
        if len(found) > 1:
            return f"'{node.name}' combines two of them"
        if node.name in CONTROL_FLOW_OPS:
            return f"a loop or branch ('{node.name}') reads a value computed from it"
        if not linear_in_sums(node.name, node.mlir_op, [SUM if s is not None else None for s in scales]):
            return f"'{node.name}' is not linear in it"
        scale = found.pop()
        for r in node.results:
            if carries_batch(r):
                scaled[r] = scale
            else:
                sums[i] = scale
    return ScaleUses(readers, sums)


def factor_scales(graph: FuncGraph, uses: ScaleUses) -> None:
    """Rewrites the IR: the readers read 1 in place of the scale; each sum made from it is
    multiplied by it afterwards (its other users read the product)."""
    for i, v in uses.readers:
        op = graph.ops[i].mlir_op
        scale = value_of(graph, v)
        with ir.InsertionPoint(op), op.location:
            one = stablehlo.ConstantOp(_splat(scale.type, 1.0)).result
        for k, operand in enumerate(op.operands):
            if operand == scale:
                op.operands[k] = one
    for i, v in uses.sums.items():
        op = graph.ops[i].mlir_op
        scale = value_of(graph, v)
        last = op
        for result in op.results:
            users = list(result.uses)
            with ir.InsertionPoint.after(last), op.location:
                spread = stablehlo.BroadcastInDimOp(result.type, scale, ir.DenseI64ArrayAttr.get([]))
                product = stablehlo.MulOp(result, spread.result)
            last = product.operation
            for use in users:
                use.owner.operands[use.operand_number] = product.result


def _splat(type_: ir.Type, number: float) -> ir.DenseElementsAttr:
    tensor = ir.RankedTensorType(type_)
    return ir.DenseElementsAttr.get_splat(tensor, ir.FloatAttr.get(tensor.element_type, number))
