"""Which ops leave sums pending and which carry them (`pending_sums.pending_sums_of`)."""

from __future__ import annotations

from hlopar.analysis.auto_sharding.pending_sums import pending_sums_of
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions

PROGRAM = """
func.func @main(%a: tensor<8x4xf32>, %b: tensor<4x4xf32>, %i: tensor<3x1xi32>, %u: tensor<3x4xf32>) -> tensor<4xf32> {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %dot = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
  %sum = stablehlo.reduce(%dot init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
  %max = stablehlo.reduce(%dot init: %zero) applies stablehlo.maximum across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
  %add = stablehlo.add %sum, %max : tensor<4xf32>
  %mul = stablehlo.multiply %add, %max : tensor<4xf32>
  %div = stablehlo.divide %mul, %max : tensor<4xf32>
  %neg = stablehlo.negate %div : tensor<4xf32>
  %cvt = stablehlo.convert %neg : (tensor<4xf32>) -> tensor<4xf16>
  %exp = stablehlo.exponential %neg : tensor<4xf32>
  %table = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
  %sc = "stablehlo.scatter"(%table, %i, %u) ({
  ^bb0(%x: tensor<f32>, %y: tensor<f32>):
    %s = stablehlo.add %x, %y : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) {scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>} : (tensor<8x4xf32>, tensor<3x1xi32>, tensor<3x4xf32>) -> tensor<8x4xf32>
  return %exp : tensor<4xf32>
}
"""


def test_ops_that_leave_or_carry_pending_sums():
    module = parse_module(PROGRAM)
    graph = FuncGraph.from_func(planned_functions(module)[0])
    found = {}
    for op in graph.ops:
        found.setdefault(op.name, []).append(pending_sums_of(op))
    assert found["stablehlo.dot_general"] == [(True, ())]
    # a sum reduction leaves its sums pending and is linear in its input and initial value;
    # a maximum does neither
    assert found["stablehlo.reduce"] == [(True, ((0, 1),)), (False, ())]
    assert found["stablehlo.scatter"] == [(True, ((0, 2),))]
    assert found["stablehlo.add"] == [(False, ((0, 1),))]
    assert found["stablehlo.multiply"] == [(False, ((0,), (1,)))]
    assert (
        found["stablehlo.divide"]
        == found["stablehlo.negate"]
        == found["stablehlo.broadcast_in_dim"]
        == [(False, ((0,),))]
    )
    # rounding each addend is not rounding the sum; a nonlinear op reads it whole
    assert found["stablehlo.convert"] == found["stablehlo.exponential"] == found["stablehlo.constant"] == [(False, ())]
