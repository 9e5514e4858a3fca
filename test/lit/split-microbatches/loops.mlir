// Sums over the batch inside a loop, as the backward of a scanned layer stack makes them:
// each iteration writes a sum over the batch into a stacked carry that starts at zeros
// (dynamic_update_slice at the layer index) and adds another to a carried accumulator.
// Those carries are sums: they leave the loop, which runs per microbatch, through a reshape
// of kind sum, and are accumulated over microbatches like top-level gradients.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2})' | FileCheck %s --check-prefix=B2
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 functions=true})' | FileCheck %s --check-prefix=FN

// B2-LABEL: func.func public @main
// B2-SAME:    (%arg0: tensor<3x4x4xf32>, %arg1: tensor<4xf32>, %arg2: tensor<4x4xf32>)
// B2:         %[[ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<3x4x4xf32>
// B2:         %[[LOOP:.*]]:4 = stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %arg2, %{{.*}} = %[[ZEROS]], %{{.*}} = %{{.*}}) : tensor<i32>, tensor<4x4xf32>, tensor<3x4x4xf32>, tensor<4xf32> attributes {hlopar.microbatch = "batch"}
// B2:           stablehlo.dot_general {{.*}} contracting_dims = [0] x [0]{{.*}}: (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
// B2:           stablehlo.dynamic_update_slice
// B2:           stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
// B2:         %[[STACKED:.*]] = stablehlo.reshape %[[LOOP]]#2 {hlopar.microbatch = "sum"} : (tensor<3x4x4xf32>) -> tensor<3x4x4xf32>
// B2-NEXT:    %[[BIAS:.*]] = stablehlo.reshape %[[LOOP]]#3 {hlopar.microbatch = "sum"} : (tensor<4xf32>) -> tensor<4xf32>
// B2:         stablehlo.reduce(%[[LOOP]]#1 init: {{.*}} {hlopar.microbatch = "sum"} : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
// B2:         %[[DW:.*]] = stablehlo.multiply %{{.*}}, %[[STACKED]] {hlopar.microbatch = "sum"} : tensor<3x4x4xf32>
// B2-NEXT:    stablehlo.subtract %arg0, %[[DW]] {hlopar.microbatch = "step"} : tensor<3x4x4xf32>
// B2:         %[[DB:.*]] = stablehlo.multiply %{{.*}}, %[[BIAS]] {hlopar.microbatch = "sum"} : tensor<4xf32>
// B2-NEXT:    stablehlo.subtract %arg1, %[[DB]] {hlopar.microbatch = "step"} : tensor<4xf32>

// The whole step: each microbatch's loop makes its stacked sums, added up before the update.
// FN-LABEL: func.func public @main
// FN-SAME:    (%arg0: tensor<3x4x4xf32>, %arg1: tensor<4xf32>, %arg2: tensor<8x4xf32>)
// FN:         %[[A:.*]]:3 = call @microbatch_step(%{{.*}}) : (tensor<4x4xf32>) -> (tensor<3x4x4xf32>, tensor<4xf32>, tensor<f32>)
// FN:         %[[B:.*]]:3 = call @microbatch_step(%{{.*}}) : (tensor<4x4xf32>) -> (tensor<3x4x4xf32>, tensor<4xf32>, tensor<f32>)
// FN-NEXT:    stablehlo.add %[[A]]#0, %[[B]]#0 : tensor<3x4x4xf32>
// FN-NEXT:    stablehlo.add %[[A]]#1, %[[B]]#1 : tensor<4xf32>
// FN-NEXT:    stablehlo.add %[[A]]#2, %[[B]]#2 : tensor<f32>
// FN:         func.func private @microbatch_step
// FN:         stablehlo.while
// FN:         func.func private @apply_update
func.func public @main(%w: tensor<3x4x4xf32>, %b: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<3x4x4xf32>, tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %lr = stablehlo.constant dense<0.1> : tensor<f32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %zeros = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<3x4x4xf32>
  %acc0 = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<4xf32>
  %loop:4 = stablehlo.while(%i = %c0, %h = %x, %stack = %zeros, %acc = %acc0) : tensor<i32>, tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<4xf32>
    cond {
      %three = stablehlo.constant dense<3> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %three : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %z = stablehlo.constant dense<0> : tensor<i32>
      %g = stablehlo.dot_general %h, %h, contracting_dims = [0] x [0] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %g3 = stablehlo.reshape %g : (tensor<4x4xf32>) -> tensor<1x4x4xf32>
      %stack2 = stablehlo.dynamic_update_slice %stack, %g3, %i, %z, %z : (tensor<3x4x4xf32>, tensor<1x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x4xf32>
      %s = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
      %acc2 = stablehlo.add %acc, %s : tensor<4xf32>
      %h2 = stablehlo.tanh %h : tensor<8x4xf32>
      %next = stablehlo.add %i, %one : tensor<i32>
      stablehlo.return %next, %h2, %stack2, %acc2 : tensor<i32>, tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<4xf32>
    }
  %loss = stablehlo.reduce(%loop#1 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %lrw = stablehlo.broadcast_in_dim %lr, dims = [] : (tensor<f32>) -> tensor<3x4x4xf32>
  %dw = stablehlo.multiply %lrw, %loop#2 : tensor<3x4x4xf32>
  %w2 = stablehlo.subtract %w, %dw : tensor<3x4x4xf32>
  %lrb = stablehlo.broadcast_in_dim %lr, dims = [] : (tensor<f32>) -> tensor<4xf32>
  %db = stablehlo.multiply %lrb, %loop#3 : tensor<4xf32>
  %b2 = stablehlo.subtract %b, %db : tensor<4xf32>
  return %w2, %b2, %loss : tensor<3x4x4xf32>, tensor<4xf32>, tensor<f32>
}

// -----

// A branch (`jax.lax.cond`) that runs per microbatch: one branch sums over the batch, the
// other returns zeros; either way its result is a sum over the batch (the branch taken does
// not depend on it), used as such by the update.
// B2-LABEL: func.func public @main
// B2-SAME:    (%arg0: tensor<4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<i32>)
// B2:         %[[CASE:.*]] = "stablehlo.case"(%arg2)
// B2:           stablehlo.reduce(%arg1 init: {{.*}}) applies stablehlo.add across dimensions = [0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
// B2:         {hlopar.microbatch = "sum"} : (tensor<i32>) -> tensor<4xf32>
// B2:         %[[DW:.*]] = stablehlo.multiply %{{.*}}, %[[CASE]] {hlopar.microbatch = "sum"} : tensor<4xf32>
// B2-NEXT:    stablehlo.subtract %arg0, %[[DW]] {hlopar.microbatch = "step"} : tensor<4xf32>
func.func public @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>, %k: tensor<i32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %g = "stablehlo.case"(%k) ({
    %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
    stablehlo.return %s : tensor<4xf32>
  }, {
    %zeros = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<4xf32>
    stablehlo.return %zeros : tensor<4xf32>
  }) : (tensor<i32>) -> tensor<4xf32>
  %loss = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %lr = stablehlo.constant dense<0.1> : tensor<4xf32>
  %dw = stablehlo.multiply %lr, %g : tensor<4xf32>
  %w2 = stablehlo.subtract %w, %dw : tensor<4xf32>
  return %w2, %loss : tensor<4xf32>, tensor<f32>
}
