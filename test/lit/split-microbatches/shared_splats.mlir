// `cse` merges equal splats whatever their dims mean: with a batch of 8 and 8 features, the
// zeros of a causal mask over a parameter (features x features) and the zeros of a ReLU on
// the activations (batch x features) become one value. The split gives each use its own copy
// first, so the batch is divided in the ReLU's zeros only.
// RUN: hlopar-opt %s -p 'builtin.module(cse,hlopar-split-microbatches{microbatches=2 batch-args=1 loss-result=1})' | FileCheck %s

// CHECK-LABEL: func.func @main
// CHECK-SAME:    (%arg0: tensor<8x8xf32>, %arg1: tensor<4x8xf32>)
// CHECK-DAG:     %[[BATCH_ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] {hlopar.microbatch = "batch"} : (tensor<f32>) -> tensor<4x8xf32>
// CHECK-DAG:     %[[MASK_ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
// CHECK:         stablehlo.select %{{.*}}, %arg0, %[[MASK_ZEROS]] : tensor<8x8xi1>, tensor<8x8xf32>
// CHECK:         stablehlo.maximum %{{.*}}, %[[BATCH_ZEROS]] {hlopar.microbatch = "batch"} : tensor<4x8xf32>
func.func @main(%w: tensor<8x8xf32>, %x: tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %mask_zeros = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
  %i = stablehlo.iota dim = 0 : tensor<8x8xi32>
  %j = stablehlo.iota dim = 1 : tensor<8x8xi32>
  %m = stablehlo.compare GE, %i, %j : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi1>
  %wm = stablehlo.select %m, %w, %mask_zeros : tensor<8x8xi1>, tensor<8x8xf32>
  %h = stablehlo.dot_general %x, %wm, contracting_dims = [1] x [0] : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
  %relu_zeros = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
  %r = stablehlo.maximum %h, %relu_zeros : tensor<8x8xf32>
  %s = stablehlo.reduce(%r init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x8xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<8x8xf32>, tensor<f32>
}
