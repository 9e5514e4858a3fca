// A scan over a stack of two layers (JAX's lowering of `lax.scan`, calls inlined by
// hlopar-import): the loop is unrolled, the stacked weights split into one argument per layer
// (read where the layer ran), the stacked per-layer outputs written as pieces, the elementwise
// update of the stack run per piece; `hlopar.layer_pieces` says what each argument and result
// is a piece of. Each copy of a body op is tagged with its loop, iteration, body op and layer.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-import,hlopar-unstack-layer-scans{report=%t.json})' | FileCheck %s
// RUN: FileCheck %s --check-prefix=REPORT < %t.json
// REPORT: "trips": 2
// REPORT: "split_arguments": 1
// REPORT: "split_results": 2

// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%arg0: tensor<3x4xf32>, %arg1: tensor<1x4x4xf32>, %arg2: tensor<1x4x4xf32>)
// CHECK-SAME:    -> (tensor<1x4x4xf32> {jax.result_info = "result[0][0]"}, tensor<1x4x4xf32> {jax.result_info = "result[0][1]"}, tensor<1xf32> {jax.result_info = "result[1][0]"}, tensor<1xf32> {jax.result_info = "result[1][1]"}, tensor<3x4xf32> {jax.result_info = "result[2]"})
// CHECK-SAME:    hlopar.layer_pieces = {arg_origin = array<i64: 1, 0, 0>, arg_piece = array<i64: -1, 0, 1>, arg_rows = array<i64: 1, 1, 1>, result_origin = array<i64: 0, 0, 1, 1, 2>, result_piece = array<i64: 0, 1, 0, 1, -1>, result_rows = array<i64: 1, 1, 1, 1, 1>}
// CHECK-NOT:     stablehlo.while
// CHECK:         %[[W0:.*]] = stablehlo.reshape %arg1 {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
// CHECK:         %[[H1:.*]] = stablehlo.dot_general %arg0, %[[W0]]
// CHECK:         %[[T1:.*]] = stablehlo.tanh %[[H1]]
// CHECK:         %[[Y0:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] {hlopar.layer_iteration = array<i64: 0, {{[01]}}, 5, {{[01]}}>} : (tensor<f32>) -> tensor<1xf32>
// CHECK:         %[[W1:.*]] = stablehlo.reshape %arg2 {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
// CHECK:         %[[H2:.*]] = stablehlo.dot_general %[[T1]], %[[W1]]
// CHECK:         %[[T2:.*]] = stablehlo.tanh %[[H2]]
// CHECK:         %[[Y1:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] {hlopar.layer_iteration = array<i64: 0, {{[01]}}, 5, {{[01]}}>} : (tensor<f32>) -> tensor<1xf32>
// One broadcast per layer (a shared one would tie the layers' stages together), each made
// where it is read, as values made from constants alone are.
// CHECK:         %[[HALF0:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<1x4x4xf32>
// CHECK-NEXT:    %[[U0:.*]] = stablehlo.multiply %arg1, %[[HALF0]] : tensor<1x4x4xf32>
// CHECK-NEXT:    %[[HALF1:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<1x4x4xf32>
// CHECK-NEXT:    %[[U1:.*]] = stablehlo.multiply %arg2, %[[HALF1]] : tensor<1x4x4xf32>
// CHECK:         return %[[U0]], %[[U1]], %[[Y0]], %[[Y1]], %[[T2]]
// CHECK-NOT:     stablehlo.dynamic_slice
// CHECK-NOT:     stablehlo.dynamic_update_slice
module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<2x4x4xf32>, %arg1: tensor<3x4xf32>) -> (tensor<2x4x4xf32> {jax.result_info = "result[0]"}, tensor<2xf32> {jax.result_info = "result[1]"}, tensor<3x4xf32> {jax.result_info = "result[2]"}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %1:4 = stablehlo.while(%iterArg = %arg0, %iterArg_1 = %c, %iterArg_2 = %arg1, %iterArg_3 = %0) : tensor<2x4x4xf32>, tensor<i32>, tensor<3x4xf32>, tensor<2xf32>
    cond {
      %c_4 = stablehlo.constant dense<2> : tensor<i32>
      %4 = stablehlo.compare LT, %iterArg_1, %c_4, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %4 : tensor<i1>
    } do {
      %4 = func.call @dynamic_index_in_dim(%iterArg, %iterArg_1) : (tensor<2x4x4xf32>, tensor<i32>) -> tensor<4x4xf32>
      %5:2 = func.call @closed_call(%iterArg_2, %4) : (tensor<3x4xf32>, tensor<4x4xf32>) -> (tensor<3x4xf32>, tensor<f32>)
      %6 = func.call @dynamic_update_index_in_dim(%iterArg_3, %5#1, %iterArg_1) : (tensor<2xf32>, tensor<f32>, tensor<i32>) -> tensor<2xf32>
      %c_4 = stablehlo.constant dense<1> : tensor<i32>
      %7 = stablehlo.add %iterArg_1, %c_4 : tensor<i32>
      stablehlo.return %iterArg, %7, %5#0, %6 : tensor<2x4x4xf32>, tensor<i32>, tensor<3x4xf32>, tensor<2xf32>
    }
    %cst_0 = stablehlo.constant dense<5.000000e-01> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<2x4x4xf32>
    %3 = stablehlo.multiply %arg0, %2 : tensor<2x4x4xf32>
    return %3, %1#3, %1#2 : tensor<2x4x4xf32>, tensor<2xf32>, tensor<3x4xf32>
  }
  func.func private @dynamic_index_in_dim(%arg0: tensor<2x4x4xf32>, %arg1: tensor<i32>) -> tensor<4x4xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 4, 4] : (tensor<2x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    return %1 : tensor<4x4xf32>
  }
  func.func private @closed_call(%arg0: tensor<3x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<3x4xf32>, tensor<f32>) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<3x4xf32>, tensor<4x4xf32>) -> tensor<3x4xf32>
    %1 = stablehlo.tanh %0 : tensor<3x4xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %2 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<3x4xf32>, tensor<f32>) -> tensor<f32>
    return %1, %2 : tensor<3x4xf32>, tensor<f32>
  }
  func.func private @dynamic_update_index_in_dim(%arg0: tensor<2xf32>, %arg1: tensor<f32>, %arg2: tensor<i32>) -> tensor<2xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [] : (tensor<f32>) -> tensor<1xf32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2 : (tensor<2xf32>, tensor<1xf32>, tensor<i32>) -> tensor<2xf32>
    return %1 : tensor<2xf32>
  }
}

