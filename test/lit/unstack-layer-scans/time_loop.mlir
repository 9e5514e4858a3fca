// RUN: hlopar-opt %s -p 'builtin.module(hlopar-import,hlopar-unstack-layer-scans)' | FileCheck %s
// A loop over time steps: its operands are not sliced per iteration, so it is no layer scan.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>)
// CHECK-NOT:     hlopar.layer_pieces
// CHECK:         stablehlo.while
func.func public @main(%w: tensor<4x4xf32>, %x: tensor<4x4xf32>) -> tensor<4x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %h = %x) : tensor<i32>, tensor<4x4xf32>
  cond {
    %n = stablehlo.constant dense<4> : tensor<i32>
    %p = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %d = stablehlo.dot_general %h, %w, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %t = stablehlo.tanh %d : tensor<4x4xf32>
    stablehlo.return %next, %t : tensor<i32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<4x4xf32>
}
