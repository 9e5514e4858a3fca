// A window along the batch (a cumulative sum over examples, pooling over them) is refused, saying so (issue 27, item 1).
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s
// CHECK-NOT: Traceback


// A cumulative sum over the batch (jnp.cumsum(x, axis=0)).
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: window_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.reduce_window' slides a window along the batch (dim 0: size 8, padding 7, 0): its windows would hold examples of several microbatches (pooling or a cumulative sum over the batch?); only windows over the other dims split
  %c = "stablehlo.reduce_window"(%x, %zero) <{padding = dense<[[7, 0], [0, 0]]> : tensor<2x2xi64>, window_dimensions = array<i64: 8, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x4xf32>, tensor<f32>) -> tensor<8x4xf32>
  %s = stablehlo.reduce(%c init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// Pooling pairs of examples: a window of size 2 and stride 2 along the batch.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: window_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.reduce_window' slides a window along the batch (dim 0: size 2, stride 2): its windows
  %c = "stablehlo.reduce_window"(%x, %zero) <{window_dimensions = array<i64: 2, 1>, window_strides = array<i64: 2, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.maximum %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x4xf32>, tensor<f32>) -> tensor<4x4xf32>
  %s = stablehlo.reduce(%c init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}
