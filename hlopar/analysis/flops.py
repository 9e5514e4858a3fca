"""Floating-point operations of each op, read from the IR alone.

Operator clustering (Alpa Eq. 6) balances layers by FLOPs and stage construction turns
FLOPs into compute time, so every top-level op needs a count. It comes from shapes and the
decoded attributes (`hlopar.ir.op_attrs`), never from Shardy's rules, so any function with
static shapes can be counted. One multiply-add is two FLOPs, as in the papers.

What is counted:

- `dot_general` / `dot`: 2 × batch × lhs free × rhs free × contracting sizes.
- `convolution`: 2 × output batch × output features × input features per group × the
  kernel taps that land on real input elements (taps on padding or on the holes of an
  lhs dilation are skipped, as XLA's cost analysis does: the data gradient of a strided
  convolution is an lhs-dilated convolution, and counting its holes would double or
  quadruple its cost).
- `reduce`: the elements of the reduced inputs; `reduce_window`: output elements × window
  size per input; `select_and_scatter`: source elements × window size.
- `sort`: elements × log2 of the sorted dimension's size (comparisons of a merge sort).
- `scatter`: update elements (the combiner runs once per update element).
- `while`: (body + condition) × the trip count when the loop counts from a constant to a
  constant (`trip_count`), else once.
- `case` / `if`: the most expensive branch. A branch is picked at run time; planning for
  the costliest keeps a stage's estimate an upper bound instead of a guess at the mix.
- Data movement and shape-only ops (reshape, broadcast, transpose, slices, pads,
  concatenation, gather, iota, constants, copies, custom calls we cannot see into): 0.
  They cost bytes, not arithmetic; the cost model charges bytes separately.
- Everything else (elementwise math, compare, select, convert, rng, ...): one FLOP per
  result element.

Tensors with dynamic or unknown shapes count as empty.
"""

from __future__ import annotations

import math

from hlopar.analysis.loops import trip_count
from hlopar.ir.graph import FuncGraph, OpNode
from hlopar.ir.op_attrs import ConvDims, DotGeneralDims, ReduceWindowAttrs, SelectAndScatterAttrs, SortAttrs

# Ops that only move, reinterpret or create data: no arithmetic.
ZERO_FLOP_OPS = frozenset(
    {
        "stablehlo.reshape",
        "stablehlo.dynamic_reshape",
        "stablehlo.broadcast_in_dim",
        "stablehlo.dynamic_broadcast_in_dim",
        "stablehlo.broadcast",
        "stablehlo.transpose",
        "stablehlo.slice",
        "stablehlo.dynamic_slice",
        "stablehlo.dynamic_update_slice",
        "stablehlo.pad",
        "stablehlo.dynamic_pad",
        "stablehlo.concatenate",
        "stablehlo.reverse",
        "stablehlo.gather",
        "stablehlo.dynamic_gather",
        "stablehlo.iota",
        "stablehlo.dynamic_iota",
        "stablehlo.constant",
        "stablehlo.bitcast_convert",
        "stablehlo.get_tuple_element",
        "stablehlo.tuple",
        "stablehlo.optimization_barrier",
        "stablehlo.custom_call",
        "stablehlo.get_dimension_size",
        "stablehlo.set_dimension_size",
        "stablehlo.return",
        "stablehlo.after_all",
        "stablehlo.create_token",
        "stablehlo.partition_id",
        "stablehlo.replica_id",
        "stablehlo.infeed",
        "stablehlo.outfeed",
        "stablehlo.send",
        "stablehlo.recv",
        "stablehlo.composite",
        "func.call",
        "func.return",
        "sdy.sharding_constraint",
        "sdy.reshard",
    }
)

_BRANCHING_OPS = frozenset({"stablehlo.case", "stablehlo.if"})


def function_flops(graph: FuncGraph) -> list[float]:
    """FLOPs of every top-level op, by op index (regions included in their op's count)."""
    return [op_flops(graph, op) for op in graph.ops]


def op_flops(graph: FuncGraph, op: OpNode) -> float:
    """FLOPs of one op (top-level or nested); see the module docstring for the rules."""
    name = op.name
    if name in ZERO_FLOP_OPS:
        return 0.0
    attrs = op.attrs
    if isinstance(attrs, DotGeneralDims):
        return _dot_flops(graph, op, attrs)
    if isinstance(attrs, ConvDims):
        return _conv_flops(graph, op, attrs)
    if name == "stablehlo.reduce":
        inputs = op.operands[: len(op.operands) // 2]
        return float(sum(_elements(graph, v) for v in inputs))
    if isinstance(attrs, ReduceWindowAttrs):
        window = math.prod(attrs.window_dimensions)
        return float(sum(_elements(graph, v) for v in op.results) * window)
    if isinstance(attrs, SelectAndScatterAttrs):
        return float(_elements(graph, op.operands[1]) * math.prod(attrs.window_dimensions))
    if isinstance(attrs, SortAttrs):
        return _sort_flops(graph, op, attrs)
    if name == "stablehlo.scatter":
        updates = op.operands[(len(op.operands) + 1) // 2 :]
        return float(sum(_elements(graph, v) for v in updates))
    if name == "stablehlo.while":
        cond, body = op.regions
        return float(trip_count(graph, op)) * (_region_flops(graph, cond) + _region_flops(graph, body))
    if name in _BRANCHING_OPS:
        return max((_region_flops(graph, region) for region in op.regions), default=0.0)
    flops = float(sum(_elements(graph, v) for v in op.results))
    for region in op.regions:  # an unknown op with a body: count what the body does once
        flops += _region_flops(graph, region)
    return flops


def _region_flops(graph: FuncGraph, region) -> float:
    return sum(op_flops(graph, op) for block in region for op in block.ops)


def _elements(graph: FuncGraph, value: int) -> int:
    shape = graph.values[value].shape
    if shape is None or None in shape:
        return 0
    return math.prod(shape)


def _static_shape(graph: FuncGraph, value: int) -> tuple[int, ...] | None:
    shape = graph.values[value].shape
    return None if shape is None or None in shape else shape


def _dot_flops(graph: FuncGraph, op: OpNode, dims: DotGeneralDims) -> float:
    # Result elements already are batch × lhs free × rhs free; each sums over the
    # contracting dimensions.
    lhs = _static_shape(graph, op.operands[0])
    if lhs is None:
        return 0.0
    contracting = math.prod(lhs[d] for d in dims.lhs_contracting)
    return 2.0 * _elements(graph, op.results[0]) * contracting


def _conv_flops(graph: FuncGraph, op: OpNode, dims: ConvDims) -> float:
    lhs = _static_shape(graph, op.operands[0])
    rhs = _static_shape(graph, op.operands[1])
    out = _static_shape(graph, op.results[0])
    if lhs is None or rhs is None or out is None:
        return 0.0
    taps = 1
    for d in range(len(dims.input_spatial)):
        taps *= _valid_taps(
            input_size=lhs[dims.input_spatial[d]],
            kernel_size=rhs[dims.kernel_spatial[d]],
            output_size=out[dims.output_spatial[d]],
            stride=dims.window_strides[d],
            padding_low=dims.padding[d][0],
            lhs_dilation=dims.lhs_dilation[d],
            rhs_dilation=dims.rhs_dilation[d],
        )
    per_tap = out[dims.output_batch] * out[dims.output_feature] * rhs[dims.kernel_in]
    return 2.0 * per_tap * taps


def _valid_taps(
    *,
    input_size: int,
    kernel_size: int,
    output_size: int,
    stride: int,
    padding_low: int,
    lhs_dilation: int,
    rhs_dilation: int,
) -> int:
    """(output position, kernel position) pairs of one spatial dimension that read a real
    input element: inside the (dilated) input, and not in a hole that lhs dilation inserts.

    Counted per kernel position in closed form (an arithmetic progression of output
    positions), so that a weight gradient with a long "kernel" costs nothing to count.
    """
    dilated_input = (input_size - 1) * lhs_dilation + 1 if input_size else 0
    count = 0
    for k in range(kernel_size):
        offset = k * rhs_dilation - padding_low  # input position read by output 0
        lo = max(0, -(offset // stride))  # ceil(-offset / stride)
        hi = min(output_size - 1, (dilated_input - 1 - offset) // stride)
        if lo > hi:
            continue
        if lhs_dilation == 1:
            count += hi - lo + 1
            continue
        # Positions o·stride + offset that are multiples of lhs_dilation: o ≡ o0 (mod m).
        g = math.gcd(stride, lhs_dilation)
        if offset % g:
            continue
        m = lhs_dilation // g
        o0 = (-offset // g) * pow(stride // g, -1, m) % m if m > 1 else 0
        first = lo + (o0 - lo) % m
        if first <= hi:
            count += (hi - first) // m + 1
    return count


def _sort_flops(graph: FuncGraph, op: OpNode, attrs: SortAttrs) -> float:
    shape = _static_shape(graph, op.operands[0])
    if not shape:
        return 0.0
    size = shape[attrs.dimension]
    return float(math.prod(shape) * max(1.0, math.log2(size)) if size > 1 else 0.0)
