// An iota along the batch (threefry's counters) counts the whole batch's rows in every microbatch: the split
// @main takes the microbatch index k as a last batch argument (row k of arange(B)) and adds k * (the
// microbatch's size) to the iota. The stride (a constant of the whole batch's shape) is kept.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s

// CHECK-LABEL: func.func @main
// CHECK-SAME: (%[[W:.*]]: tensor<4xf32>, %[[X:.*]]: tensor<2x3x4xf32>, %[[K:.*]]: tensor<1xi32>)
// CHECK-SAME: hlopar.batch_args = array<i64: 1, 2>, hlopar.microbatch_index_arg = 2 : i64, hlopar.microbatches = 4 : i64
func.func @main(%w: tensor<4xf32>, %x: tensor<8x3x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %xt = stablehlo.transpose %x, dims = [1, 0, 2] : (tensor<8x3x4xf32>) -> tensor<3x8x4xf32>
  // CHECK: %[[K0:.*]] = stablehlo.reshape %[[K]] {hlopar.microbatch = "batch"} : (tensor<1xi32>) -> tensor<i32>
  // CHECK-NEXT: %[[KU:.*]] = stablehlo.convert %[[K0]] {hlopar.microbatch = "batch"} : (tensor<i32>) -> tensor<ui64>
  // CHECK-NEXT: %[[SIZE:.*]] = stablehlo.constant dense<2> : tensor<ui64>
  // CHECK-NEXT: %[[OFFSET:.*]] = stablehlo.multiply %[[KU]], %[[SIZE]] {hlopar.microbatch = "batch"} : tensor<ui64>
  // CHECK-NEXT: %[[SPREAD:.*]] = stablehlo.broadcast_in_dim %[[OFFSET]], dims = [] {{.*}} -> tensor<3x2x4xui64>
  // CHECK-NEXT: %[[LOCAL:.*]] = stablehlo.iota dim = 1 {hlopar.microbatch = "batch"} : tensor<3x2x4xui64>
  // CHECK-NEXT: %[[GLOBAL:.*]] = stablehlo.add %[[LOCAL]], %[[SPREAD]] {hlopar.microbatch = "batch"} : tensor<3x2x4xui64>
  // CHECK-NEXT: %[[STRIDE:.*]] = stablehlo.constant {hlopar.microbatch = "batch"} dense<4> : tensor<3x2x4xui64>
  // CHECK-NEXT: stablehlo.multiply %[[GLOBAL]], %[[STRIDE]]
  %i = stablehlo.iota dim = 1 : tensor<3x8x4xui64>
  %stride = stablehlo.constant dense<4> : tensor<3x8x4xui64>
  %c = stablehlo.multiply %i, %stride : tensor<3x8x4xui64>
  %f = stablehlo.convert %c : (tensor<3x8x4xui64>) -> tensor<3x8x4xf32>
  %y = stablehlo.multiply %xt, %f : tensor<3x8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<3x8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// An iota along another dim than the batch is only resized.
// CHECK-LABEL: func.func @main
// CHECK-NOT: hlopar.microbatch_index_arg
// CHECK: stablehlo.iota dim = 1 {hlopar.microbatch = "batch"} : tensor<2x4xf32>
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %i = stablehlo.iota dim = 1 : tensor<8x4xf32>
  %y = stablehlo.multiply %x, %i : tensor<8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}
