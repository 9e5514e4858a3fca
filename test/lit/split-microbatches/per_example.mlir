// Per-example results under several microbatches: each keeps the whole batch's type and
// becomes a sum over microbatches, its microbatch's rows placed in zeros at k * rows along its
// batch dim (k: the microbatch index, an argument the split adds), marked with that dim for
// codegen. A result with the batch folded into two dims is refused, named.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 batch-args=1 loss-result=1 report=%t.json})' | FileCheck %s
// RUN: FileCheck %s --check-prefix=REPORT < %t.json
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s --check-prefix=FOLDED
// REPORT: "per_example_results": 1

// The examples returned as they are, and transposed (the batch in dim 1), beside the loss.
// CHECK-LABEL: func.func @main
// CHECK-SAME:    (%arg0: tensor<4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<1xi32>) -> (tensor<8x4xf32>, tensor<f32>, tensor<4x8xf32>)
// CHECK-SAME:    hlopar.batch_args = array<i64: 1, 2>, hlopar.microbatch_index_arg = 2 : i64, hlopar.microbatches = 2 : i64
// CHECK:         %[[T:.*]] = stablehlo.transpose %arg1, dims = [1, 0] {hlopar.microbatch = "batch"} : (tensor<4x4xf32>) -> tensor<4x4xf32>
// CHECK:         %[[K:.*]] = stablehlo.reshape %arg2 {hlopar.microbatch = "batch"} : (tensor<1xi32>) -> tensor<i32>
// CHECK:         %[[ROWS:.*]] = stablehlo.constant dense<4> : tensor<i32>
// CHECK:         %[[FIRST:.*]] = stablehlo.multiply %{{.*}}, %[[ROWS]] {hlopar.microbatch = "batch"} : tensor<i32>
// CHECK:         %[[ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] {hlopar.microbatch = "batch"} : (tensor<f32>) -> tensor<8x4xf32>
// CHECK:         %[[X:.*]] = stablehlo.dynamic_update_slice %[[ZEROS]], %arg1, %[[FIRST]], %[[ZERO:[^ ]*]] {hlopar.microbatch = "sum", hlopar.per_example_dim = 0 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<i32>) -> tensor<8x4xf32>
// CHECK:         %[[ZEROS_T:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] {hlopar.microbatch = "batch"} : (tensor<f32>) -> tensor<4x8xf32>
// CHECK:         %[[XT:.*]] = stablehlo.dynamic_update_slice %[[ZEROS_T]], %[[T]], %[[ZERO]], %[[FIRST]] {hlopar.microbatch = "sum", hlopar.per_example_dim = 1 : i64} : (tensor<4x8xf32>, tensor<4x4xf32>, tensor<i32>, tensor<i32>) -> tensor<4x8xf32>
// CHECK:         return %[[X]], %{{.*}}, %[[XT]] : tensor<8x4xf32>, tensor<f32>, tensor<4x8xf32>
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<f32>, tensor<4x8xf32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %t = stablehlo.transpose %x, dims = [1, 0] : (tensor<8x4xf32>) -> tensor<4x8xf32>
  return %x, %s, %t : tensor<8x4xf32>, tensor<f32>, tensor<4x8xf32>
}

// -----

// The batch folded into two dims: with 2 microbatches dim 0 holds them whole (block k of it is
// microbatch k's rows): concatenated; with 4 a microbatch's rows are a quarter of a row: refused.
// CHECK-LABEL: func.func @main
// CHECK:         stablehlo.dynamic_update_slice {{.*}} {hlopar.microbatch = "sum", hlopar.per_example_dim = 0 : i64} : (tensor<2x16xf32>, tensor<1x16xf32>, tensor<i32>, tensor<i32>) -> tensor<2x16xf32>
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>, tensor<2x16xf32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %folded = stablehlo.reshape %x : (tensor<8x4xf32>) -> tensor<2x16xf32>
  // FOLDED: per_example.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: result 2 of @main carries the batch spread over several dims (2, 2): the 4 microbatches' values cannot be concatenated along one
  return %w, %s, %folded : tensor<4xf32>, tensor<f32>, tensor<2x16xf32>
}
