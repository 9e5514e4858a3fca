// Normalizers of the whole batch that cannot be factored out of the microbatches (issue 27, item 3) are refused as
// batch statistics, saying why: one computed from the parameters, one used squared.
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1,2 loss-result=1})' 2>&1 | FileCheck %s
// CHECK-NOT: Traceback

// The normalizer depends on the parameters (w): the gradient flows through it.
func.func @main(%w: tensor<3xf32>, %x: tensor<8x3xf32>, %m: tensor<8xf32>) -> (tensor<3xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %wb = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<3xf32>) -> tensor<8x3xf32>
  %h = stablehlo.multiply %x, %wb : tensor<8x3xf32>
  %e = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<8xf32>
  %num = stablehlo.reduce(%e init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  %den = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<f32>
  %c = stablehlo.divide %num, %den : tensor<f32>
  // CHECK: scale_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.broadcast_in_dim' uses a value computed from the whole batch (at 'stablehlo.divide'{{.*}}) per example: {{.*}} (a float scalar of the batch only, used linearly: it depends on the parameters or the step's state) (with microbatches=1 the step runs as written)
  %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<8xf32>
  %ge = stablehlo.multiply %cb, %m : tensor<8xf32>
  %s = stablehlo.reduce(%ge init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<3xf32>, tensor<f32>
}

// -----

// The scale of the batch only, but squared per example.
func.func @main(%w: tensor<3xf32>, %x: tensor<8x3xf32>, %m: tensor<8xf32>) -> (tensor<3xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %one = stablehlo.constant dense<1.000000e+00> : tensor<f32>
  %wb = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<3xf32>) -> tensor<8x3xf32>
  %h = stablehlo.multiply %x, %wb : tensor<8x3xf32>
  %e = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<8xf32>
  %den = stablehlo.reduce(%m init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  %c = stablehlo.divide %one, %den : tensor<f32>
  // CHECK: scale_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.broadcast_in_dim' uses a value computed from the whole batch {{.*}} used linearly: 'stablehlo.multiply' is not linear in it)
  %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<8xf32>
  %c2 = stablehlo.multiply %cb, %cb : tensor<8xf32>
  %ge = stablehlo.multiply %c2, %e : tensor<8xf32>
  %s = stablehlo.reduce(%ge init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<3xf32>, tensor<f32>
}
