// RUN: hlopar-opt %s -p 'builtin.module(hlopar-rematerialize{all=true})' | FileCheck %s

// Stage 0 runs its forward as two fragments (`mpmd_program.form_fragments`: its second
// part reads stage 1's output, which reads its first part). Its backward reads a = tanh(x)
// from the first and c = a * y from the second (y is stage 1's output, received): both are
// recomputed from the stage's inputs x and y, across the two fragments (c's clone reads a's
// clone, not the first fragment's result). The first fragment still returns a (stage 1 and
// the second fragment read it); the second, left with nothing anyone reads, goes. Stage 1's
// backward reads only its inputs: unchanged.

// CHECK-LABEL: func.func @main
// CHECK:         %[[F0:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0)
// CHECK-NEXT:      stablehlo.tanh
// CHECK-NEXT:      mpmd.return
// CHECK:         %[[T0:.*]] = mpmd.transfer %[[F0]]
// CHECK:         %[[F1:.*]] = mpmd.fragment<mesh="m1", origin=["stage1"], stage=1> (%[[T0]])
// CHECK:         %[[T1:.*]] = mpmd.transfer %[[F1]]
// CHECK-NOT:     origin=["stage0"], stage=0
// CHECK:         %[[B1:.*]] = mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1> (%[[T0]], %arg1) (
// CHECK-NOT:       stablehlo.exponential
// CHECK:           mpmd.return
// CHECK:         %[[G:.*]] = mpmd.transfer %[[B1]]
// CHECK:         %[[B0:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%[[G]], %arg0, %[[T1]]) {hlopar.remat} (%[[GB:.*]]: tensor<4xf32>, %[[X:.*]]: tensor<4xf32>, %[[Y:.*]]: tensor<4xf32>) {
// CHECK-NEXT:      %[[A:.*]] = stablehlo.tanh %[[X]]
// CHECK-NEXT:      %[[C:.*]] = stablehlo.multiply %[[A]], %[[Y]]
// CHECK-NEXT:      %[[D:.*]] = stablehlo.multiply %[[GB]], %[[C]]
// CHECK-NEXT:      %[[E:.*]] = stablehlo.multiply %[[D]], %[[A]]
// CHECK-NEXT:      mpmd.return %[[E]]
module attributes {hlopar.devices = {m0 = array<i64: 0>, m1 = array<i64: 1>}} {
  sdy.mesh @m0 = <["x"=1]>
  sdy.mesh @m1 = <["x"=1]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<4xf32>>, %arg1: !mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<4xf32>>, !mpmd.mesh_tensor<"m1", tensor<4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=1]>>, <"m1" : <["x"=1]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0) (%x: tensor<4xf32>) {
      %a = stablehlo.tanh %x : tensor<4xf32>
      mpmd.return %a : tensor<4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4xf32>>
    %1 = mpmd.transfer %0 : (!mpmd.mesh_tensor<"m0", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<4xf32>>
    %2 = mpmd.fragment<mesh="m1", origin=["stage1"], stage=1> (%1) (%a: tensor<4xf32>) {
      %y = stablehlo.exponential %a : tensor<4xf32>
      mpmd.return %y : tensor<4xf32>
    } : (!mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<4xf32>>
    %3 = mpmd.transfer %2 : (!mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4xf32>>
    %4 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%3, %0) (%y: tensor<4xf32>, %a: tensor<4xf32>) {
      %c = stablehlo.multiply %a, %y : tensor<4xf32>
      mpmd.return %c : tensor<4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4xf32>>
    %5 = mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1> (%1, %arg1) (%a: tensor<4xf32>, %g: tensor<4xf32>) {
      %e = stablehlo.multiply %a, %g : tensor<4xf32>
      mpmd.return %e : tensor<4xf32>
    } : (!mpmd.mesh_tensor<"m1", tensor<4xf32>>, !mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<4xf32>>
    %6 = mpmd.transfer %5 : (!mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4xf32>>
    %7 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%6, %4, %0) (%g: tensor<4xf32>, %c: tensor<4xf32>, %a: tensor<4xf32>) {
      %d = stablehlo.multiply %g, %c : tensor<4xf32>
      %e = stablehlo.multiply %d, %a : tensor<4xf32>
      mpmd.return %e : tensor<4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<4xf32>>
    return %7, %5 : !mpmd.mesh_tensor<"m0", tensor<4xf32>>, !mpmd.mesh_tensor<"m1", tensor<4xf32>>
  }
}
