// Windowed reductions over dims other than the batch split like elementwise ops (issue 27, item 1): max pooling
// (reduce_window max), a cumulative sum (reduce_window add, padded along its own dim) and max pooling's gradient
// (select_and_scatter) keep their windows and get the microbatch's batch; ops with a region are not loops or
// branches (window_errors.mlir: windows along the batch).
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1 loss-result=1})' 2>&1 | FileCheck %s

// CHECK-LABEL: func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2x4x4x2xf32>)
// CHECK: %[[POOL:.*]] = "stablehlo.reduce_window"({{.*}}window_dimensions = array<i64: 1, 2, 2, 1>, window_strides = array<i64: 1, 2, 2, 1>}>
// CHECK: }) {hlopar.microbatch = "batch"} : (tensor<2x4x4x2xf32>, tensor<f32>) -> tensor<2x2x2x2xf32>
// CHECK: %[[CUMSUM:.*]] = "stablehlo.reduce_window"(%[[POOL]], {{.*}}padding = dense<{{\[\[}}0, 0], [1, 0], [0, 0], [0, 0]]>
// CHECK: }) {hlopar.microbatch = "batch"} : (tensor<2x2x2x2xf32>, tensor<f32>) -> tensor<2x2x2x2xf32>
// CHECK: %[[LOSS:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0, 1, 2, 3] {hlopar.microbatch = "sum"} : (tensor<2x2x2x2xf32>, tensor<f32>) -> tensor<f32>
// CHECK: "stablehlo.select_and_scatter"
// CHECK: }) {hlopar.microbatch = "batch"} : (tensor<2x4x4x2xf32>, tensor<2x2x2x2xf32>, tensor<f32>) -> tensor<2x4x4x2xf32>
// CHECK: %[[GRAD:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0, 1, 2] {hlopar.microbatch = "sum"} : (tensor<2x4x4x2xf32>, tensor<f32>) -> tensor<2xf32>
// CHECK: %[[NEW:.*]] = stablehlo.subtract %arg0, %{{.*}} {hlopar.microbatch = "step"}
// CHECK: return %[[NEW]], %[[LOSS]]
func.func @main(%w: tensor<2xf32>, %x: tensor<8x4x4x2xf32>) -> (tensor<2xf32>, tensor<f32>) {
  %lr = stablehlo.constant dense<1.000000e-01> : tensor<2xf32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %low = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %wb = stablehlo.broadcast_in_dim %w, dims = [3] : (tensor<2xf32>) -> tensor<8x4x4x2xf32>
  %h = stablehlo.multiply %x, %wb : tensor<8x4x4x2xf32>
  %pool = "stablehlo.reduce_window"(%h, %low) <{window_dimensions = array<i64: 1, 2, 2, 1>, window_strides = array<i64: 1, 2, 2, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %m = stablehlo.maximum %a, %b : tensor<f32>
    stablehlo.return %m : tensor<f32>
  }) : (tensor<8x4x4x2xf32>, tensor<f32>) -> tensor<8x2x2x2xf32>
  %cumsum = "stablehlo.reduce_window"(%pool, %zero) <{padding = dense<[[0, 0], [1, 0], [0, 0], [0, 0]]> : tensor<4x2xi64>, window_dimensions = array<i64: 1, 2, 1, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x2x2x2xf32>, tensor<f32>) -> tensor<8x2x2x2xf32>
  %loss = stablehlo.reduce(%cumsum init: %zero) applies stablehlo.add across dimensions = [0, 1, 2, 3] : (tensor<8x2x2x2xf32>, tensor<f32>) -> tensor<f32>
  %ones = stablehlo.constant dense<1.000000e+00> : tensor<8x2x2x2xf32>
  %dpool = "stablehlo.reduce_window"(%ones, %zero) <{padding = dense<[[0, 0], [0, 1], [0, 0], [0, 0]]> : tensor<4x2xi64>, window_dimensions = array<i64: 1, 2, 1, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x2x2x2xf32>, tensor<f32>) -> tensor<8x2x2x2xf32>
  %dh = "stablehlo.select_and_scatter"(%h, %dpool, %zero) <{window_dimensions = array<i64: 1, 2, 2, 1>, window_strides = array<i64: 1, 2, 2, 1>}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %ge = stablehlo.compare GE, %a, %b, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>
    stablehlo.return %ge : tensor<i1>
  }, {
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x4x4x2xf32>, tensor<8x2x2x2xf32>, tensor<f32>) -> tensor<8x4x4x2xf32>
  %dw = stablehlo.multiply %x, %dh : tensor<8x4x4x2xf32>
  %grad = stablehlo.reduce(%dw init: %zero) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<8x4x4x2xf32>, tensor<f32>) -> tensor<2xf32>
  %step = stablehlo.multiply %lr, %grad : tensor<2xf32>
  %new = stablehlo.subtract %w, %step : tensor<2xf32>
  return %new, %loss : tensor<2xf32>, tensor<f32>
}
