// A loss normalized over the whole batch (issue 27, item 3): sum(e * m) / sum(m), m the batch's weights (a padding
// mask). Its backward reads 1 / sum(m) per example; that scale depends on the batch only, so the microbatches compute
// with 1 in its place and the gradient's sum is multiplied by it once, after the sums (its numerator and denominator
// accumulated separately): the whole batch's gradient. The loss is the quotient of the two sums, computed once.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1,2 loss-result=1})' 2>&1 | FileCheck %s

// CHECK-LABEL: func.func @main(%arg0: tensor<3xf32>, %arg1: tensor<2x3xf32>, %arg2: tensor<2xf32>)
// CHECK: %[[NUM:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0] {hlopar.microbatch = "sum"} : (tensor<2xf32>, tensor<f32>) -> tensor<f32>
// CHECK: %[[DEN:.*]] = stablehlo.reduce(%arg2 init: %{{.*}}) applies stablehlo.add across dimensions = [0] {hlopar.microbatch = "sum"} : (tensor<2xf32>, tensor<f32>) -> tensor<f32>
// CHECK: %[[LOSS:.*]] = stablehlo.divide %[[NUM]], %[[DEN]] {hlopar.microbatch = "step"} : tensor<f32>
// CHECK: %[[SCALE:.*]] = stablehlo.divide %{{.*}}, %[[DEN]] {hlopar.microbatch = "step"} : tensor<f32>
// CHECK: %[[ONE:.*]] = stablehlo.constant dense<1.000000e+00> : tensor<f32>
// CHECK: stablehlo.broadcast_in_dim %[[ONE]], dims = [] {hlopar.microbatch = "batch"} : (tensor<f32>) -> tensor<2xf32>
// CHECK: %[[SUM:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0] {hlopar.microbatch = "sum"} : (tensor<2x3xf32>, tensor<f32>) -> tensor<3xf32>
// CHECK-NEXT: %[[SPREAD:.*]] = stablehlo.broadcast_in_dim %[[SCALE]], dims = [] {hlopar.microbatch = "step"} : (tensor<f32>) -> tensor<3xf32>
// CHECK-NEXT: %[[GRAD:.*]] = stablehlo.multiply %[[SUM]], %[[SPREAD]] {hlopar.microbatch = "step"} : tensor<3xf32>
// CHECK: stablehlo.multiply %{{.*}}, %[[GRAD]] {hlopar.microbatch = "step"}
// CHECK: return %{{.*}}, %[[LOSS]]
func.func @main(%w: tensor<3xf32>, %x: tensor<8x3xf32>, %m: tensor<8xf32>) -> (tensor<3xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %one = stablehlo.constant dense<1.000000e+00> : tensor<f32>
  %lr = stablehlo.constant dense<1.000000e-01> : tensor<3xf32>
  %wb = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<3xf32>) -> tensor<8x3xf32>
  %h = stablehlo.multiply %x, %wb : tensor<8x3xf32>
  %e = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x3xf32>, tensor<f32>) -> tensor<8xf32>
  %em = stablehlo.multiply %e, %m : tensor<8xf32>
  %num = stablehlo.reduce(%em init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  %den = stablehlo.reduce(%m init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  %loss = stablehlo.divide %num, %den : tensor<f32>
  %c = stablehlo.divide %one, %den : tensor<f32>
  %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<8xf32>
  %ge = stablehlo.multiply %cb, %m : tensor<8xf32>
  %gh = stablehlo.broadcast_in_dim %ge, dims = [0] : (tensor<8xf32>) -> tensor<8x3xf32>
  %gwe = stablehlo.multiply %gh, %x : tensor<8x3xf32>
  %gw = stablehlo.reduce(%gwe init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x3xf32>, tensor<f32>) -> tensor<3xf32>
  %step = stablehlo.multiply %lr, %gw : tensor<3xf32>
  %new = stablehlo.subtract %w, %step : tensor<3xf32>
  return %new, %loss : tensor<3xf32>, tensor<f32>
}
