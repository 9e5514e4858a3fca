"""Backward weight delaying's cut of a backward into B and W: the slicing over plain data, and
the two modules cut out of a hand-written backward, which compute what it computes."""

from __future__ import annotations

import jax
import numpy as np

from hlopar.codegen.executables import compile_executable
from hlopar.codegen.weight_split import OpSplit, split_module, split_ops
from hlopar.ir.module import parse_module, print_module

# A layer's backward: args dy (0), w (1), x (2).
#   op0: c  = constant              -> 3
#   op1: g  = dy * c                -> 4   the gradient both halves need
#   op2: dx = g . w                 -> 5   sent to the earlier stage: B
#   op3: dw = x . g                 -> 6   W
#   op4: db = sum(g) + c            -> 7   W
READS = [(), (0, 3), (4, 1), (2, 4), (4, 3)]
DEFINES = [(3,), (4,), (5,), (6,), (7,)]


def test_input_gradient_and_what_it_needs_go_to_b():
    split = split_ops(READS, DEFINES, input_results=[5], weight_results=[6, 7])
    # g is needed by both: B computes it and hands it over; the constant is computed again.
    assert split == OpSplit(
        input_ops=(0, 1, 2), weight_ops=(0, 3, 4), input_args=(0, 1), weight_args=(2,), carried=(4,)
    )


def test_values_b_makes_that_w_returns_are_carried():
    # W returns g itself and x: g is handed over once, x is an argument of W.
    split = split_ops(READS, DEFINES, input_results=[5], weight_results=[6, 7, 4, 2])
    assert split.weight_ops == (0, 3, 4) and split.carried == (4,) and split.weight_args == (2,)


def test_ops_defining_nothing_stay_in_b():
    reads = READS + [(6,)]  # e.g. a side-effecting op reading dw: it pulls dw's op into B
    split = split_ops(reads, DEFINES + [()], input_results=[5], weight_results=[6, 7])
    assert split.input_ops == (0, 1, 2, 3, 5) and split.weight_ops == (0, 4)
    assert split.carried == (4, 6)  # dw is made in B now: W returns it


def test_no_input_results_leaves_b_empty():
    split = split_ops(READS, DEFINES, input_results=[], weight_results=[5, 6, 7])
    assert split.input_ops == () and split.weight_ops == (0, 1, 2, 3, 4) and split.carried == ()
    assert split.weight_args == (0, 1, 2)


BACKWARD = """
module {
  sdy.mesh @m = <["x"=2]>
  func.func @main(%dy: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@m, [{"x"}, {}]>},
                  %w: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {}]>},
                  %x: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@m, [{"x"}, {}]>})
      -> (tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@m, [{"x"}, {}]>},
          tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {}]>},
          tensor<8xf32> {sdy.sharding = #sdy.sharding<@m, [{}]>}) {
    %c = stablehlo.constant dense<2.0> : tensor<f32>
    %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %g = stablehlo.multiply %dy, %cb {sdy.sharding = #sdy.sharding_per_value<[<@m, [{"x"}, {}]>]>} : tensor<4x8xf32>
    %dx = stablehlo.dot_general %g, %w, contracting_dims = [1] x [1] : (tensor<4x8xf32>, tensor<16x8xf32>) -> tensor<4x16xf32>
    %dw = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<4x16xf32>, tensor<4x8xf32>) -> tensor<16x8xf32>
    %db = stablehlo.reduce(%g init: %c) applies stablehlo.add across dimensions = [0] : (tensor<4x8xf32>, tensor<f32>) -> tensor<8xf32>
    return %dx, %dw, %db : tensor<4x16xf32>, tensor<16x8xf32>, tensor<8xf32>
  }
}
"""


def _signature(module) -> str:
    return next(line.strip() for line in print_module(module).splitlines() if "func.func @main" in line)


def test_split_module_cuts_a_backward_into_two_modules_that_compute_it():
    module = parse_module(BACKWARD)
    halves = split_module(module, weight_results=[1, 2])
    assert (halves.input_args, halves.weight_args) == ((0, 1), (2,))
    assert (halves.input_results, halves.weight_results) == ((0,), (1, 2))
    assert halves.carried_from == (1,) and halves.carried_bytes == (4 * 8 * 4,)
    b, w = print_module(halves.input), print_module(halves.weight)
    assert "stablehlo.multiply" in b and "stablehlo.multiply" not in w
    assert "dot_general" in b and b.count("dot_general") == 1 and w.count("dot_general") == 1
    assert "stablehlo.constant" in w  # the constant is computed again, not handed over
    carried = '{sdy.sharding = #sdy.sharding<@m, [{"x"}, {}]>}'
    # B returns dx, then g; W takes x, then g: both laid out as the multiply states.
    assert _signature(halves.input).endswith(
        f'-> (tensor<4x16xf32> {{sdy.sharding = #sdy.sharding<@m, [{{"x"}}, {{}}]>}}, tensor<4x8xf32> {carried}) {{'
    )
    assert f"%arg1: tensor<4x8xf32> {carried})" in _signature(halves.weight)

    devices = jax.devices()[:2]
    rng = np.random.default_rng(0)
    dy, wt, x = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (16, 8), (4, 16)))
    dx, dw, db = compile_executable(module, devices)(dy, wt, x)
    b_dx, g = compile_executable(halves.input, devices)(dy, wt)
    w_dw, w_db = compile_executable(halves.weight, devices)(x, g)
    for actual, expected in ((b_dx, dx), (w_dw, dw), (w_db, db)):
        np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_a_half_with_no_result_leaves_the_whole_module_to_the_other():
    module = parse_module(BACKWARD)
    only_b = split_module(module, weight_results=[])
    assert only_b.input is module and only_b.weight is None and only_b.input_results == (0, 1, 2)
    only_w = split_module(module, weight_results=[0, 1, 2])
    assert only_w.input is None and only_w.weight is module and only_w.weight_args == (0, 1, 2)
