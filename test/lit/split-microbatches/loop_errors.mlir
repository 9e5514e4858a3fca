// Inside a loop that runs per microbatch, only accumulating sums over the batch splits: what
// else uses a sum there is refused, located at the op, naming why. With one microbatch
// nothing is split and every case runs as written.
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{batch-args=1 loss-result=1})' | FileCheck %s --check-prefix=B1
// CHECK-NOT: Traceback
// B1-COUNT-4: hlopar.microbatches = 1

// A sum over the batch used per example inside the loop (normalizing by the batch's mean
// in each layer: a batch statistic inside a scanned stack).
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %loop:2 = stablehlo.while(%i = %c0, %h = %x) : tensor<i32>, tensor<8x4xf32>
    cond {
      %three = stablehlo.constant dense<3> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %three : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %s = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
      // CHECK: loop_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.broadcast_in_dim' uses a sum over the batch (at 'stablehlo.reduce' ({{.*}}loop_errors.mlir:[[# @LINE - 1]]:{{[0-9]+}})) per example inside a loop or branch: a statistic of the batch used inside a loop cannot be split into microbatches
      %sb = stablehlo.broadcast_in_dim %s, dims = [1] : (tensor<4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.subtract %h, %sb : tensor<8x4xf32>
      %next = stablehlo.add %i, %one : tensor<i32>
      stablehlo.return %next, %h2 : tensor<i32>, tensor<8x4xf32>
    }
  %loss = stablehlo.reduce(%loop#1 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %loss : tensor<4xf32>, tensor<f32>
}

// -----

// A function of a sum that is not linear in it (a layer's update, a norm) inside the loop.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %acc0 = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<4xf32>
  %loop:3 = stablehlo.while(%i = %c0, %h = %x, %acc = %acc0) : tensor<i32>, tensor<8x4xf32>, tensor<4xf32>
    cond {
      %three = stablehlo.constant dense<3> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %three : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %s = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
      // CHECK: loop_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.sqrt' is not linear in the sums over the batch it reads, inside a loop or branch that runs once per microbatch
      %n = stablehlo.sqrt %s : tensor<4xf32>
      %acc2 = stablehlo.add %acc, %n : tensor<4xf32>
      %h2 = stablehlo.tanh %h : tensor<8x4xf32>
      %next = stablehlo.add %i, %one : tensor<i32>
      stablehlo.return %next, %h2, %acc2 : tensor<i32>, tensor<8x4xf32>, tensor<4xf32>
    }
  %s = stablehlo.reduce(%loop#1 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %s2 = stablehlo.reduce(%loop#2 init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<4xf32>, tensor<f32>) -> tensor<f32>
  %loss = stablehlo.add %s, %s2 : tensor<f32>
  return %w, %loss : tensor<4xf32>, tensor<f32>
}

// -----

// Sums added to a carry that starts at a parameter: each microbatch would add its own copy
// of the parameter.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %loop:3 = stablehlo.while(%i = %c0, %h = %x, %acc = %w) : tensor<i32>, tensor<8x4xf32>, tensor<4xf32>
    cond {
      %three = stablehlo.constant dense<3> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %three : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %s = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
      // CHECK: loop_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.add' is not linear in the sums over the batch it reads, inside a loop or branch that runs once per microbatch: only sums can be accumulated over microbatches (a sum added to or written into a value that is not zero
      %acc2 = stablehlo.add %acc, %s : tensor<4xf32>
      %h2 = stablehlo.tanh %h : tensor<8x4xf32>
      %next = stablehlo.add %i, %one : tensor<i32>
      stablehlo.return %next, %h2, %acc2 : tensor<i32>, tensor<8x4xf32>, tensor<4xf32>
    }
  %loss = stablehlo.reduce(%loop#1 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %loop#2, %loss : tensor<4xf32>, tensor<f32>
}

// -----

// A loop whose trip count is chosen from a sum over the batch.
func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: loop_errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-split-microbatches: 'stablehlo.while' runs a number of iterations chosen from sums over the batch
  %loop:2 = stablehlo.while(%t = %zero, %h = %x) : tensor<f32>, tensor<8x4xf32>
    cond {
      %limit = stablehlo.constant dense<3.0> : tensor<f32>
      %lt = stablehlo.compare LT, %t, %limit : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %s = stablehlo.reduce(%h init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
      %t2 = stablehlo.add %t, %s : tensor<f32>
      %h2 = stablehlo.tanh %h : tensor<8x4xf32>
      stablehlo.return %t2, %h2 : tensor<f32>, tensor<8x4xf32>
    }
  %loss = stablehlo.reduce(%loop#1 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  return %w, %loss : tensor<4xf32>, tensor<f32>
}
