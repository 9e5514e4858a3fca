// What microbatches cannot compute is refused: a located error, exit status 1, no traceback.
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s
// CHECK-NOT: Traceback

// Taking part of the batch.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.slice' moves data along the batch dim (slices, pads, concatenates, sorts or reverses it): examples of different microbatches would mix
  %part = stablehlo.slice %x [0:4, 0:4] : (tensor<8x4xf32>) -> tensor<4x4xf32>
  %s = stablehlo.reduce(%part init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// Concatenating along the batch.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.concatenate' moves data along the batch dim
  %c = stablehlo.concatenate %x, %x, dim = 0 : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
  %s = stablehlo.reduce(%c init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<16x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// A maximum over the batch is not a sum of the microbatches' maxima.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.reduce' reduces over the batch but its body is not an addition: microbatches can only sum
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// A parameter indexed by example (the parameters are closed: nothing propagates into them).
func.func @main(%w: tensor<8x4xf32>, %x: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.add' combines values that carry the batch along a dim with values that do not (a parameter or constant indexed by example?)
  %y = stablehlo.add %x, %w : tensor<8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<8x4xf32>, tensor<f32>
}

// -----

// A constant with a row per example.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: a constant that is not a splat has the batch's shape: its rows would have to be cut per microbatch
  %k = stablehlo.constant dense<[[1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [7.0], [8.0]]> : tensor<8x1xf32>
  %kb = stablehlo.broadcast_in_dim %k, dims = [0, 1] : (tensor<8x1xf32>) -> tensor<8x4xf32>
  %y = stablehlo.multiply %x, %kb : tensor<8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// A custom call Shardy has no rule for.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.custom_call' has no sharding rule: hlopar cannot tell whether it mixes the examples of the batch
  %y = stablehlo.custom_call @foo(%x) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}

// -----

// A sum over the whole batch used per example (not a mean: GPipe's per-microbatch statistics do not apply).
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.broadcast_in_dim' uses a value computed from the whole batch (at 'stablehlo.reduce' ({{.*}}errors.mlir:{{[0-9]+}}:{{[0-9]+}})) per example: a batch statistic that is not a mean over the batch
  %mb = stablehlo.broadcast_in_dim %s, dims = [1] : (tensor<4xf32>) -> tensor<8x4xf32>
  %c = stablehlo.subtract %x, %mb : tensor<8x4xf32>
  %sq = stablehlo.multiply %c, %c : tensor<8x4xf32>
  %t = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %t : tensor<4xf32>, tensor<f32>
}

// -----

// A loss that is the log of a mean: the error names the op that is not linear (its backward, 1/mean times
// per-example values, would be refused too).
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %n = stablehlo.constant dense<32.0> : tensor<f32>
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %mean = stablehlo.divide %s, %n : tensor<f32>
  // CHECK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: the loss (result 1) is not a sum or a mean over the batch: 'stablehlo.log' is not linear in the sums over the batch it reads; between the batch reductions and the loss only add, subtract, negate, and multiplying or dividing by values independent of the batch may appear
  %loss = stablehlo.log %mean : tensor<f32>
  %inv = stablehlo.divide %n, %s : tensor<f32>
  %seed = stablehlo.broadcast_in_dim %inv, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
  %gx = stablehlo.multiply %seed, %x : tensor<8x4xf32>
  %g = stablehlo.reduce(%gx init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
  %new = stablehlo.subtract %w, %g : tensor<4xf32>
  return %new, %loss : tensor<4xf32>, tensor<f32>
}

