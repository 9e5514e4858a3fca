// Generators of the whole shape at once (stablehlo.rng, rng_bit_generator) cannot give a microbatch the batch's
// rows: refused, naming the option; with rng=per-microbatch, a warning.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1 loss-result=1 rng=per-microbatch})' 2>&1 | FileCheck %s --check-prefix=ACCEPT
// CHECK-NOT: Traceback

// A generator of the whole shape at once cannot give a microbatch the batch's rows: refused, naming the option.
// ACCEPT: rng_errors.mlir:[[# @LINE + 5]]:{{[0-9]+}}: warning: hlopar-split-microbatches: 'stablehlo.rng' draws random numbers per microbatch (rng=per-microbatch): other numbers than the whole batch's
// CHECK: rng_errors.mlir:[[# @LINE + 4]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.rng' draws random numbers for the whole batch at once: a microbatch cannot draw its rows of them; rng=per-microbatch accepts other random numbers per microbatch
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>, %a: tensor<f32>, %b: tensor<f32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %shape = stablehlo.constant dense<[8, 4]> : tensor<2xi64>
  %r = stablehlo.rng %a, %b, %shape, distribution = UNIFORM : (tensor<f32>, tensor<f32>, tensor<2xi64>) -> tensor<8x4xf32>
  %y = stablehlo.multiply %x, %r : tensor<8x4xf32>
  %s = stablehlo.reduce(%y init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %s : tensor<4xf32>, tensor<f32>
}
