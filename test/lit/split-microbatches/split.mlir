// A training step becomes the program for one of B microbatches: the batch arguments and
// every value computed from them have their batch dim divided by B; the 1/N of the mean
// stays the global N; each top-level op says whether it carries the batch, makes a sum over
// it, or must run once on the sums (the optimizer).
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2 report=%t.json})' | FileCheck %s --check-prefix=B2
// RUN: FileCheck %s --check-prefix=REPORT < %t.json
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=4})' | FileCheck %s --check-prefix=B4
// One microbatch: nothing is resized, the kinds are written all the same.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches)' | FileCheck %s --check-prefix=B1
// The output parses back, and is not split again.
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2})' | hlopar-opt - --split-input-file | FileCheck %s --check-prefix=B2
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2})' | not hlopar-opt - --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=2})' 2>&1 | FileCheck %s --check-prefix=TWICE
// TWICE: error: hlopar-split-microbatches: @main is already split into microbatches
// Batches of 8 and 4 do not split in 3; no microbatch at all is no split either.
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=3})' 2>&1 | FileCheck %s --check-prefix=DIVIDE
// DIVIDE: split.mlir:[[# @LINE + 29]]:{{[0-9]+}}: error: hlopar-split-microbatches: batch argument 1 has leading dim 8, not divisible by 3 microbatches
// DIVIDE: error: hlopar-split-microbatches: batch argument 1 has leading dim 8, not divisible by 3 microbatches
// DIVIDE: error: hlopar-split-microbatches: batch argument 1 has leading dim 4, not divisible by 3 microbatches
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-split-microbatches{microbatches=0})' 2>&1 | FileCheck %s --check-prefix=ZERO
// ZERO: error: option 'microbatches' of pass 'hlopar-split-microbatches': invalid value '0': expected a positive integer, got 0

// Linear regression, mean squared error, one SGD step. The batch: %x and %y (not state).
// B2-LABEL: func.func @main
// B2-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x2xf32>) -> (tensor<4x2xf32>, tensor<f32>)
// B2-SAME:    attributes {hlopar.batch_args = array<i64: 1, 2>, hlopar.microbatches = 2 : i64}
// B2:         %[[N:.*]] = stablehlo.constant dense<1.600000e+01> : tensor<f32>
// B2:         %[[TWO:.*]] = stablehlo.constant {hlopar.microbatch = "batch"} dense<2.000000e+00> : tensor<4x2xf32>
// B2:         %[[PRED:.*]] = stablehlo.dot_general %arg1, %arg0, {{.*}} {hlopar.microbatch = "batch"} : (tensor<4x4xf32>, tensor<4x2xf32>) -> tensor<4x2xf32>
// B2:         %[[SUM:.*]] = stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [0, 1] {hlopar.microbatch = "sum"} : (tensor<4x2xf32>, tensor<f32>) -> tensor<f32>
// B2-NEXT:    %[[LOSS:.*]] = stablehlo.divide %[[SUM]], %[[N]] {hlopar.microbatch = "sum"} : tensor<f32>
// B2:         %[[G:.*]] = stablehlo.dot_general %arg1, {{.*}} {hlopar.microbatch = "sum"} : (tensor<4x4xf32>, tensor<4x2xf32>) -> tensor<4x2xf32>
// B2-NEXT:    %[[STEP:.*]] = stablehlo.multiply %{{.*}}, %[[G]] {hlopar.microbatch = "sum"} : tensor<4x2xf32>
// B2-NEXT:    %[[NEW:.*]] = stablehlo.subtract %arg0, %[[STEP]] {hlopar.microbatch = "step"} : tensor<4x2xf32>
// B2-NEXT:    return %[[NEW]], %[[LOSS]]

// B4-LABEL: func.func @main
// B4-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<2x4xf32>, %arg2: tensor<2x2xf32>)

// B1-LABEL: func.func @main
// B1-SAME:    (%arg0: tensor<4x2xf32>, %arg1: tensor<8x4xf32>, %arg2: tensor<8x2xf32>)
// B1-SAME:    hlopar.microbatches = 1 : i64
// B1:         stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [0, 1] {hlopar.microbatch = "sum"} : (tensor<8x2xf32>, tensor<f32>) -> tensor<f32>
// B4:         stablehlo.constant {hlopar.microbatch = "batch"} dense<2.000000e+00> : tensor<2x2xf32>

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

// -----

// Shardings already in the input are the user's: kept as they are, the batch dims resized
// under them (a sharding constraint passes the batch through).
// B2-LABEL: func.func @main
// B2-SAME:    (%arg0: tensor<4x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"y"}]>}, %arg1: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>})
// B2:         sdy.sharding_constraint %{{.*}} <@mesh, [{"x"}, {"y"}]> {hlopar.microbatch = "batch"} : tensor<4x2xf32>
// B4-LABEL: func.func @main
// B4-SAME:    %arg1: tensor<2x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
sdy.mesh @mesh = <["x"=2, "y"=2]>
func.func @main(%w: tensor<4x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"y"}]>}, %x: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) -> (tensor<4x2xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %pred = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x2xf32>) -> tensor<8x2xf32>
  %c = sdy.sharding_constraint %pred <@mesh, [{"x"}, {"y"}]> : tensor<8x2xf32>
  %sq = stablehlo.multiply %c, %c : tensor<8x2xf32>
  %sum = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x2xf32>, tensor<f32>) -> tensor<f32>
  %g = stablehlo.dot_general %x, %c, contracting_dims = [0] x [0] : (tensor<8x4xf32>, tensor<8x2xf32>) -> tensor<4x2xf32>
  %new = stablehlo.subtract %w, %g : tensor<4x2xf32>
  return %new, %sum : tensor<4x2xf32>, tensor<f32>
}

// -----

// Shapes spelled out in attributes follow the batch: a gather by token id (its slice sizes
// do not touch the batch), a reshape merging the batch with the sequence and back, a slice
// keeping the whole batch (its limit follows), a loop carrying a batch value (its block
// arguments follow), and the embedding gradient, a scatter-add of per-token rows into
// zeros: a sum over the batch.
// B2-LABEL: func.func @main
// B2-SAME:    (%arg0: tensor<16x8xf32>, %arg1: tensor<2x6xi32>, %arg2: tensor<2x6x8xf32>)
// B2:         "stablehlo.gather"(%arg0, %{{.*}}) {{.*}} slice_sizes = array<i64: 1, 8>}> {hlopar.microbatch = "batch"} : (tensor<16x8xf32>, tensor<2x6x1xi32>) -> tensor<2x6x8xf32>
// B2:         stablehlo.reshape {{.*}} : (tensor<2x6x8xf32>) -> tensor<12x8xf32>
// B2-NEXT:    stablehlo.slice %{{.*}} [0:12, 0:4] {hlopar.microbatch = "batch"} : (tensor<12x8xf32>) -> tensor<12x4xf32>
// B2-NEXT:    stablehlo.reshape {{.*}} : (tensor<12x4xf32>) -> tensor<2x6x4xf32>
// B2:         stablehlo.while(%{{.*}} = %{{.*}}, %[[ACC:.*]] = %{{.*}}) : tensor<i32>, tensor<2x6x8xf32> attributes {hlopar.microbatch = "batch"}
// B2:         stablehlo.add %[[ACC]], %[[ACC]] : tensor<2x6x8xf32>
// B2:         %[[EMB:.*]] = "stablehlo.scatter"
// B2:         {hlopar.microbatch = "sum"} : (tensor<16x8xf32>, tensor<2x6x1xi32>, tensor<2x6x8xf32>) -> tensor<16x8xf32>
// B2-NEXT:    stablehlo.sqrt %[[EMB]] {hlopar.microbatch = "step"}

// The report is the last case's: the batch arguments, the loss, 13 values resized (the two
// arguments, five ops before the loop, the loop's result and its two block arguments, the
// add in the loop, two ops after it), and the ops of each kind.
// REPORT:      "pass": "hlopar-split-microbatches",
// REPORT:      "microbatches": 2,
// REPORT:      "batch_args": [
// REPORT-NEXT:   1,
// REPORT-NEXT:   2
// REPORT:      "loss_result": 1,
// REPORT-NEXT: "resized_values": 13,
// REPORT-NEXT: "ops": {
// REPORT-NEXT:  "batch": 8,
// REPORT-NEXT:  "sum": 5,
// REPORT-NEXT:  "step": 2,
// REPORT-NEXT:  "independent": 4

// B4-LABEL: func.func @main
// B4-SAME:    (%arg0: tensor<16x8xf32>, %arg1: tensor<1x6xi32>, %arg2: tensor<1x6x8xf32>)
// B4:         stablehlo.slice %{{.*}} [0:6, 0:4] {hlopar.microbatch = "batch"} : (tensor<6x8xf32>) -> tensor<6x4xf32>
func.func @main(%e: tensor<16x8xf32>, %tok: tensor<4x6xi32>, %t: tensor<4x6x8xf32>) -> (tensor<16x8xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %scale = stablehlo.constant dense<0.5> : tensor<f32>
  %idx = stablehlo.reshape %tok : (tensor<4x6xi32>) -> tensor<4x6x1xi32>
  %h = "stablehlo.gather"(%e, %idx) <{dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, indices_are_sorted = false, slice_sizes = array<i64: 1, 8>}> : (tensor<16x8xf32>, tensor<4x6x1xi32>) -> tensor<4x6x8xf32>
  %flat = stablehlo.reshape %h : (tensor<4x6x8xf32>) -> tensor<24x8xf32>
  %part = stablehlo.slice %flat [0:24, 0:4] : (tensor<24x8xf32>) -> tensor<24x4xf32>
  %back = stablehlo.reshape %part : (tensor<24x4xf32>) -> tensor<4x6x4xf32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %loop:2 = stablehlo.while(%i = %c0, %acc = %h) : tensor<i32>, tensor<4x6x8xf32>
    cond {
      %three = stablehlo.constant dense<3> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %three : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %next = stablehlo.add %i, %one : tensor<i32>
      %twice = stablehlo.add %acc, %acc : tensor<4x6x8xf32>
      stablehlo.return %next, %twice : tensor<i32>, tensor<4x6x8xf32>
    }
  %d = stablehlo.subtract %loop#1, %t : tensor<4x6x8xf32>
  %sq = stablehlo.multiply %d, %d : tensor<4x6x8xf32>
  %s1 = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<4x6x8xf32>, tensor<f32>) -> tensor<f32>
  %s2 = stablehlo.reduce(%back init: %zero) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<4x6x4xf32>, tensor<f32>) -> tensor<f32>
  %s = stablehlo.add %s1, %s2 : tensor<f32>
  %loss = stablehlo.multiply %s, %scale : tensor<f32>
  %zeros = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<16x8xf32>
  %g = "stablehlo.scatter"(%zeros, %idx, %d) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %sum = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<16x8xf32>, tensor<4x6x1xi32>, tensor<4x6x8xf32>) -> tensor<16x8xf32>
  %sqrt = stablehlo.sqrt %g : tensor<16x8xf32>
  %new = stablehlo.subtract %e, %sqrt : tensor<16x8xf32>
  return %new, %loss : tensor<16x8xf32>, tensor<f32>
}
