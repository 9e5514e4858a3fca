// RUN: hlopar-opt %s -p 'builtin.module(hlopar-rematerialize{all=true})' | FileCheck %s

// A stage whose backward reads nothing its forward computed (a linear layer's weight
// gradient x^T g needs only the stage's input x and the received gradient g): there is
// nothing to recompute, and every fragment stays as it was, the forward's results included;
// with all=true the backward is not marked either.

// CHECK-LABEL: func.func @main
// CHECK:         %[[F:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%{{.*}}: tensor<4x4xf32>, %{{.*}}: tensor<8x4xf32>) {
// CHECK-NEXT:      stablehlo.dot_general
// CHECK-NEXT:      mpmd.return
// CHECK-NEXT:    } : (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
// CHECK-NEXT:    %[[B:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg1, %arg2) (%[[X:.*]]: tensor<8x4xf32>, %[[G:.*]]: tensor<8x4xf32>) {
// CHECK-NEXT:      %[[GW:.*]] = stablehlo.dot_general %[[X]], %[[G]], contracting_dims = [0] x [0]
// CHECK-NEXT:      mpmd.return %[[GW]]
// CHECK-NEXT:    }
// CHECK-NEXT:    return %[[F]], %[[B]]
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%w: tensor<4x4xf32>, %x: tensor<8x4xf32>) {
      %h = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      mpmd.return %h : tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
    %1 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg1, %arg2) (%x: tensor<8x4xf32>, %g: tensor<8x4xf32>) {
      %gw = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      mpmd.return %gw : tensor<4x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
    return %0, %1 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
  }
}
