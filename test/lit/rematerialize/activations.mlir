// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-rematerialize)' | FileCheck %s
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-rematerialize,hlopar-rematerialize{all=true})' | FileCheck %s

// A stage whose backward (marked hlopar.remat) reads two forward activations, h = x w and
// t = tanh(h): the backward recomputes both from the stage's inputs (the parameter w and the
// microbatch x, taken as new operands after its own), cloning the forward's ops with their
// shardings; the forward then returns only the loss, the one result someone else reads,
// and the ops that only fed the dropped results are gone. Running the pass again (all=true)
// changes nothing.

// CHECK-LABEL: func.func @main
// CHECK:         %[[F:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%[[W:.*]]: tensor<4x4xf32>, %[[X:.*]]: tensor<8x4xf32>) {
// CHECK-NEXT:      %[[H:.*]] = stablehlo.dot_general %[[X]], %[[W]]
// CHECK-NEXT:      %[[T:.*]] = stablehlo.tanh %[[H]]
// CHECK-NEXT:      %[[ZERO:.*]] = stablehlo.constant
// CHECK-NEXT:      %[[L:.*]] = stablehlo.reduce(%[[T]] init: %[[ZERO]])
// CHECK-NEXT:      mpmd.return %[[L]] : tensor<f32>
// CHECK-NEXT:    } : (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>, sharding=<@m0, [{"x"}, {}]>>) -> !mpmd.mesh_tensor<"m0", tensor<f32>>
// CHECK-NEXT:    %[[B:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg2, %arg0, %arg1) {hlopar.remat} (%[[G:.*]]: tensor<8x4xf32>, %[[W2:.*]]: tensor<4x4xf32>, %[[X2:.*]]: tensor<8x4xf32>) {
// CHECK-NEXT:      %[[H2:.*]] = stablehlo.dot_general %[[X2]], %[[W2]], contracting_dims = [1] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{"x"}, {}]>]>}
// CHECK-NEXT:      %[[T2:.*]] = stablehlo.tanh %[[H2]] {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{"x"}, {}]>]>}
// CHECK-NEXT:      stablehlo.constant
// CHECK-NEXT:      stablehlo.multiply %[[T2]], %[[T2]]
// CHECK:           stablehlo.dot_general %[[H2]], %{{.*}}, contracting_dims = [0] x [0]
// CHECK:           mpmd.return
// CHECK-NEXT:    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>, sharding=<@m0, [{"x"}, {}]>>) -> !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
// CHECK-NEXT:    return %[[F]], %[[B]]
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>, sharding=<@m0, [{"x"}, {}]>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0:3 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%w: tensor<4x4xf32>, %x: tensor<8x4xf32>) {
      %h = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{"x"}, {}]>]>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %t = stablehlo.tanh %h {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{"x"}, {}]>]>} : tensor<8x4xf32>
      %zero = stablehlo.constant dense<0.0> : tensor<f32>
      %l = stablehlo.reduce(%t init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
      %e = stablehlo.exponential %h : tensor<8x4xf32>
      mpmd.return %l, %h, %t : tensor<f32>, tensor<8x4xf32>, tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>, sharding=<@m0, [{"x"}, {}]>>) -> (!mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>)
    %1 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%0#1, %0#2, %arg2) {hlopar.remat} (%h: tensor<8x4xf32>, %t: tensor<8x4xf32>, %g: tensor<8x4xf32>) {
      %one = stablehlo.constant dense<1.0> : tensor<8x4xf32>
      %t2 = stablehlo.multiply %t, %t : tensor<8x4xf32>
      %d = stablehlo.subtract %one, %t2 : tensor<8x4xf32>
      %gd = stablehlo.multiply %g, %d : tensor<8x4xf32>
      %gw = stablehlo.dot_general %h, %gd, contracting_dims = [0] x [0] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      mpmd.return %gw : tensor<4x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
    return %0#0, %1 : !mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
  }
}
