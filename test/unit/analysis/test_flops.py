"""FLOPs per op from the IR (`hlopar.analysis.flops`), against hand-computed counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxlib.mlir import ir

from hlopar.analysis.flops import _valid_taps, function_flops, op_flops
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

# A graph reads the live IR (constants for trip counts): its module must outlive it.
_modules: list[ir.Operation] = []


def graph_of(body: str, signature: str) -> FuncGraph:
    """The graph of `@main(signature)` whose body ends with `return %... : types`."""
    results = body.rstrip().rsplit(" : ", 1)[1]
    module = parse_module(f"func.func @main({signature}) -> ({results}) {{\n{body}\n}}")
    _modules.append(module)
    return FuncGraph.from_module(module)


def imported(text: str) -> FuncGraph:
    """The graph of jax output after `hlopar-import` (calls inlined, chlo legalized)."""
    module = parse_module(text)
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    _modules.append(module)
    return FuncGraph.from_module(module)


def flops_by_name(graph: FuncGraph) -> dict[str, float]:
    counts = function_flops(graph)
    return {op.name.removeprefix("stablehlo."): counts[op.index] for op in graph.ops}


def test_dot_general_counts_batch_free_and_contracting_dimensions():
    graph = graph_of(
        """
  %0 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2, 3] x [1, 2]
       : (tensor<2x3x4x5xf32>, tensor<2x4x5x7xf32>) -> tensor<2x3x7xf32>
  return %0 : tensor<2x3x7xf32>""",
        "%a: tensor<2x3x4x5xf32>, %b: tensor<2x4x5x7xf32>",
    )
    # 2 × batch 2 × lhs free 3 × rhs free 7 × contracting 4·5
    assert function_flops(graph) == [2 * 2 * 3 * 7 * 20]


def test_legacy_dot_is_a_matrix_product():
    graph = graph_of(
        """
  %0 = stablehlo.dot %a, %b : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>""",
        "%a: tensor<8x16xf32>, %b: tensor<16x4xf32>",
    )
    assert function_flops(graph) == [2 * 8 * 16 * 4]


def test_convolution_counts_kernel_taps_and_input_features_per_group():
    graph = graph_of(
        """
  %0 = stablehlo.convolution(%x, %w) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f],
       window = {stride = [1, 1], pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
       : (tensor<2x8x8x3xf32>, tensor<3x3x3x16xf32>) -> tensor<2x8x8x16xf32>
  %1 = stablehlo.convolution(%x, %v) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f],
       window = {stride = [2, 2]} {batch_group_count = 1 : i64, feature_group_count = 3 : i64}
       : (tensor<2x8x8x3xf32>, tensor<2x2x1x6xf32>) -> tensor<2x4x4x6xf32>
  return %0, %1 : tensor<2x8x8x16xf32>, tensor<2x4x4x6xf32>""",
        "%x: tensor<2x8x8x3xf32>, %w: tensor<3x3x3x16xf32>, %v: tensor<2x2x1x6xf32>",
    )
    same_padded, grouped = function_flops(graph)
    # Same padding: per spatial dimension, of the 8 × 3 (output, tap) pairs the 2 that
    # fall on the padding are skipped: 22 taps, 22² in 2-D.
    assert same_padded == 2 * (2 * 16) * 3 * 22 * 22
    # Grouped, stride 2, no padding: every tap reads the input; 1 input feature per group.
    assert grouped == 2 * (2 * 4 * 4 * 6) * 1 * (2 * 2)


def test_lhs_dilated_convolution_skips_the_holes():
    # The data gradient of a stride-2 convolution: the input is dilated by 2, so half the
    # taps of a 2-wide kernel read a hole.
    graph = graph_of(
        """
  %0 = stablehlo.convolution(%x, %w) dim_numbers = [b, 0, f]x[0, i, o]->[b, 0, f],
       window = {pad = [[1, 1]], lhs_dilate = [2]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
       : (tensor<1x4x1xf32>, tensor<2x1x1xf32>) -> tensor<1x8x1xf32>
  return %0 : tensor<1x8x1xf32>""",
        "%x: tensor<1x4x1xf32>, %w: tensor<2x1x1xf32>",
    )
    # Dilated input x0 _ x1 _ x2 _ x3 (7 positions) padded by one each side: each of the 8
    # outputs reads positions (o-1, o); exactly one of each pair is a real element except
    # at o = 0 (pad, x0) and o = 7 (x3, pad), which still hit one element each: 8 taps.
    assert function_flops(graph) == [2 * 8]
    assert (
        _valid_taps(input_size=4, kernel_size=2, output_size=8, stride=1, padding_low=1, lhs_dilation=2, rhs_dilation=1)
        == 8
    )


def test_reductions_count_their_inputs_or_windows():
    graph = graph_of(
        """
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %0 = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [1]
       : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  %1 = "stablehlo.reduce_window"(%x, %zero) <{window_dimensions = array<i64: 2, 3>, window_strides = array<i64: 2, 1>}> ({
  ^bb0(%p: tensor<f32>, %q: tensor<f32>):
    %m = stablehlo.maximum %p, %q : tensor<f32>
    stablehlo.return %m : tensor<f32>
  }) : (tensor<6x10xf32>, tensor<f32>) -> tensor<3x8xf32>
  return %0, %1 : tensor<6xf32>, tensor<3x8xf32>""",
        "%x: tensor<6x10xf32>",
    )
    assert flops_by_name(graph) == {"constant": 0, "reduce": 60, "reduce_window": 3 * 8 * 6}


def test_elementwise_ops_count_result_elements_and_data_movement_counts_nothing():
    graph = graph_of(
        """
  %0 = stablehlo.exponential %x : tensor<4x5xf32>
  %1 = stablehlo.add %0, %x : tensor<4x5xf32>
  %2 = stablehlo.transpose %1, dims = [1, 0] : (tensor<4x5xf32>) -> tensor<5x4xf32>
  %3 = stablehlo.reshape %2 : (tensor<5x4xf32>) -> tensor<20xf32>
  %4 = stablehlo.broadcast_in_dim %3, dims = [1] : (tensor<20xf32>) -> tensor<3x20xf32>
  %5 = stablehlo.slice %4 [0:2, 0:20] : (tensor<3x20xf32>) -> tensor<2x20xf32>
  %6 = stablehlo.convert %5 : (tensor<2x20xf32>) -> tensor<2x20xbf16>
  return %6 : tensor<2x20xbf16>""",
        "%x: tensor<4x5xf32>",
    )
    assert flops_by_name(graph) == {
        "exponential": 20,
        "add": 20,
        "transpose": 0,
        "reshape": 0,
        "broadcast_in_dim": 0,
        "slice": 0,
        "convert": 40,
    }


def test_while_loop_multiplies_its_body_by_the_trip_count():
    def looped(x, w):
        return jax.lax.fori_loop(0, 6, lambda _, h: jnp.tanh(h @ w), x)

    spec = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    weights = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    graph = imported(jax.jit(looped).lower(spec, weights).as_text())
    (loop,) = [op for op in graph.ops if op.name == "stablehlo.while"]
    body_per_iteration = 2 * 8 * 16 * 16 + 8 * 16 + 1  # dot, tanh, counter increment
    condition_per_iteration = 1  # compare
    assert op_flops(graph, loop) == 6 * (body_per_iteration + condition_per_iteration)


def test_case_counts_its_most_expensive_branch():
    def switched(index, x, w):
        return jax.lax.switch(index, [lambda h: h @ w, lambda h: h * 2.0], x)

    spec = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    weights = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    graph = imported(jax.jit(switched).lower(jnp.int32(0), spec, weights).as_text())
    (case,) = [op for op in graph.walk() if op.name == "stablehlo.case"]
    assert op_flops(graph, case) == 2 * 8 * 16 * 16


def test_sort_and_scatter():
    graph = graph_of(
        """
  %0 = "stablehlo.sort"(%x) <{dimension = 1 : i64, is_stable = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %c = stablehlo.compare GT, %a, %b, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>
    stablehlo.return %c : tensor<i1>
  }) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %1 = "stablehlo.scatter"(%x, %i, %u) <{scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<4x8xf32>, tensor<3x1xi32>, tensor<3x8xf32>) -> tensor<4x8xf32>
  return %0, %1 : tensor<4x8xf32>, tensor<4x8xf32>""",
        "%x: tensor<4x8xf32>, %i: tensor<3x1xi32>, %u: tensor<3x8xf32>",
    )
    assert flops_by_name(graph) == {"sort": 32 * 3, "scatter": 24}


def test_mlp_training_step_matmuls_are_three_times_the_forward():
    """Forward, data gradient and weight gradient: one matmul each per dense layer."""
    from hlopar.models import get_train_step

    step = get_train_step("mlp", "tiny")
    config = step.config
    graph = imported(step.lower())
    counts = function_flops(graph)
    matmul = sum(counts[op.index] for op in graph.ops if op.name == "stablehlo.dot_general")
    dims = config.dims
    forward = sum(2 * config.batch_size * d_in * d_out for d_in, d_out in zip(dims[:-1], dims[1:]))
    # The first layer's data gradient (with respect to the batch) is not computed.
    assert matmul == 3 * forward - 2 * config.batch_size * dims[0] * dims[1]
