// RUN: hlopar-opt %s --pass-pipeline='builtin.module(hlopar-auto-sharding{mesh-shape=2x4})' | FileCheck %s

// Shardy's explicit collectives verify that their operand lives on their own mesh: a plan on
// another mesh leaves the values they read unannotated and unconstrained (found on the
// corpus' pad_for_divisibility test).

sdy.mesh @mesh_4_2 = <["x"=4, "y"=2]>

// CHECK-LABEL: func.func @sliced_then_planned
// CHECK-SAME: (%arg0: tensor<8x16xf32>, %arg1: tensor<16x8xf32> {sdy.sharding
// CHECK: sdy.all_slice [{"x"}, {}] %arg0 out_sharding=<@mesh_4_2, [{"x"}, {}]>
func.func @sliced_then_planned(%arg0: tensor<8x16xf32>, %arg1: tensor<16x8xf32>) -> tensor<8x8xf32> {
  %0 = sdy.all_slice [{"x"}, {}] %arg0 out_sharding=<@mesh_4_2, [{"x"}, {}]> : tensor<8x16xf32>
  %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x8xf32>) -> tensor<8x8xf32>
  return %1 : tensor<8x8xf32>
}
