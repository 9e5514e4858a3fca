// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-rematerialize)' 2>&1 | FileCheck %s

// A backward marked "layers" whose stage's forward ops carry no hlopar.layer: refused, at the
// backward fragment (stage construction keeps the layers on the stages it marks so).

// CHECK: layers_errors.mlir:[[# @LINE + 8]]:{{[0-9]+}}: error: hlopar-rematerialize: stage 0's backward is marked hlopar.remat = "layers" but its forward ops carry no hlopar.layer
module attributes {hlopar.devices = {m0 = array<i64: 0>}} {
  sdy.mesh @m0 = <["x"=1]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8xf32>> attributes {topology = #mpmd.topology<<"m0" : <["x"=1]>>>} {
    %0:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0) (%x: tensor<8xf32>) {
      %t = stablehlo.tanh %x : tensor<8xf32>
      mpmd.return %t, %t : tensor<8xf32>, tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>)
    %1 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%0#1, %arg1) {hlopar.remat = "layers"} (%t: tensor<8xf32>, %g: tensor<8xf32>) {
      %gt = stablehlo.multiply %g, %t : tensor<8xf32>
      mpmd.return %gt : tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8xf32>>
    return %1 : !mpmd.mesh_tensor<"m0", tensor<8xf32>>
  }
}

// -----

// Another value of the mark: refused, naming the forms there are.

// CHECK: error: hlopar-rematerialize: hlopar.remat must be a unit attribute, "stage" or "layers", got "blocks"
module attributes {hlopar.devices = {m0 = array<i64: 0>}} {
  sdy.mesh @m0 = <["x"=1]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8xf32>> attributes {topology = #mpmd.topology<<"m0" : <["x"=1]>>>} {
    %0:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0) (%x: tensor<8xf32>) {
      %t = stablehlo.tanh %x : tensor<8xf32>
      mpmd.return %t, %t : tensor<8xf32>, tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>)
    %1 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%0#1, %arg1) {hlopar.remat = "blocks"} (%t: tensor<8xf32>, %g: tensor<8xf32>) {
      %gt = stablehlo.multiply %g, %t : tensor<8xf32>
      mpmd.return %gt : tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8xf32>>
    return %1 : !mpmd.mesh_tensor<"m0", tensor<8xf32>>
  }
}
