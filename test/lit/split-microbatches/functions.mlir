// functions=true: the split written as functions. @microbatch_step computes one
// microbatch's sums (the loss's sum of squares and the gradient); @apply_update runs once on
// the sums (the mean's division by the GLOBAL N, the SGD step); @main takes the original
// arguments, slices the batch, calls @microbatch_step per slice, adds the results in
// microbatch order and returns @apply_update's results: the whole step again.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=2 functions=true})' | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=2 functions=true})' | hlopar-opt - | FileCheck %s

// CHECK-LABEL: func.func @main
// CHECK-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<8x4xf32>, %arg2: tensor<8x2xf32>) -> (tensor<4x2xf32>, tensor<f32>)
// CHECK-NEXT:    %[[X0:.*]] = stablehlo.slice %arg1 [0:4, 0:4]
// CHECK-NEXT:    %[[Y0:.*]] = stablehlo.slice %arg2 [0:4, 0:2]
// CHECK-NEXT:    %[[M0:.*]]:2 = call @microbatch_step(%arg0, %[[X0]], %[[Y0]])
// CHECK-NEXT:    %[[X1:.*]] = stablehlo.slice %arg1 [4:8, 0:4]
// CHECK-NEXT:    %[[Y1:.*]] = stablehlo.slice %arg2 [4:8, 0:2]
// CHECK-NEXT:    %[[M1:.*]]:2 = call @microbatch_step(%arg0, %[[X1]], %[[Y1]])
// CHECK-NEXT:    %[[S0:.*]] = stablehlo.add %[[M0]]#0, %[[M1]]#0 : tensor<f32>
// CHECK-NEXT:    %[[S1:.*]] = stablehlo.add %[[M0]]#1, %[[M1]]#1 : tensor<4x2xf32>
// CHECK-NEXT:    %[[U:.*]]:2 = call @apply_update(%arg0, %[[S0]], %[[S1]])
// CHECK-NEXT:    return %[[U]]#0, %[[U]]#1

// CHECK-LABEL: func.func private @microbatch_step
// CHECK-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x2xf32>) -> (tensor<f32>, tensor<4x2xf32>)
// CHECK-SAME:    attributes {hlopar.main_args = array<i64: 0, 1, 2>}
// CHECK-NOT:     hlopar.microbatch =
// CHECK:         %[[SUM:.*]] = stablehlo.reduce
// CHECK:         %[[G:.*]] = stablehlo.dot_general %arg1, {{.*}} -> tensor<4x2xf32>
// CHECK-NEXT:    return %[[SUM]], %[[G]]

// CHECK-LABEL: func.func private @apply_update
// CHECK-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<f32>, %arg2: tensor<4x2xf32>) -> (tensor<4x2xf32>, tensor<f32>)
// CHECK-SAME:    attributes {hlopar.main_args = array<i64: 0>}
// CHECK-DAG:     %[[N:.*]] = stablehlo.constant dense<1.600000e+01> : tensor<f32>
// CHECK-DAG:     %[[LR:.*]] = stablehlo.constant dense<1.000000e-01> : tensor<4x2xf32>
// CHECK:         %[[LOSS:.*]] = stablehlo.divide %arg1, %[[N]]
// CHECK-NEXT:    %[[STEP:.*]] = stablehlo.multiply %[[LR]], %arg2
// CHECK-NEXT:    %[[NEW:.*]] = stablehlo.subtract %arg0, %[[STEP]]
// CHECK-NEXT:    return %[[NEW]], %[[LOSS]]
func.func @main(%w: tensor<4x2xf32>, %x: tensor<8x4xf32>, %y: tensor<8x2xf32>) -> (tensor<4x2xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %n = stablehlo.constant dense<16.0> : tensor<f32>
  %lr = stablehlo.constant dense<0.1> : tensor<4x2xf32>
  %two = stablehlo.constant dense<2.0> : tensor<8x2xf32>
  %pred = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x2xf32>) -> tensor<8x2xf32>
  %diff = stablehlo.subtract %pred, %y : tensor<8x2xf32>
  %sq = stablehlo.multiply %diff, %diff : tensor<8x2xf32>
  %sum = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x2xf32>, tensor<f32>) -> tensor<f32>
  %loss = stablehlo.divide %sum, %n : tensor<f32>
  %nb = stablehlo.broadcast_in_dim %n, dims = [] : (tensor<f32>) -> tensor<8x2xf32>
  %scaled = stablehlo.multiply %two, %diff : tensor<8x2xf32>
  %dpred = stablehlo.divide %scaled, %nb : tensor<8x2xf32>
  %g = stablehlo.dot_general %x, %dpred, contracting_dims = [0] x [0] : (tensor<8x4xf32>, tensor<8x2xf32>) -> tensor<4x2xf32>
  %step = stablehlo.multiply %lr, %g : tensor<4x2xf32>
  %new = stablehlo.subtract %w, %step : tensor<4x2xf32>
  return %new, %loss : tensor<4x2xf32>, tensor<f32>
}
