// RUN: hlopar-opt %s -p 'builtin.module(hlopar-rematerialize)' | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-rematerialize,hlopar-rematerialize{all=true})' | FileCheck %s

// Per-layer rematerialization (hlopar.remat = "layers"). A stage of three layers l = 0, 1, 2,
// each h = in w_l, a = tanh(h), out = h + a; its backward reads every layer's a (inner
// activations) and the layers' inputs x, o0, o1 (for the weight gradients). o0 and o1 are
// layer boundaries (read by the next layer's forward ops): they stay stashed, the forward
// returns them. Each a is recomputed by its own layer's ops, just before the backward ops of
// that layer: layer 2 at the top (no backward op ran yet: no barrier), layers 1 and 0 each
// behind an optimization_barrier over the cotangent arriving at the layer (%g1, %g0) and the
// values the recompute reads (its weight and its input), the recompute reading the barrier's
// results. Running the pass again changes nothing.

// CHECK-LABEL: func.func @main
// CHECK:         %[[F:.*]]:3 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0>
// CHECK:           %[[O0:.*]] = stablehlo.add {{.*}}hlopar.layer = 0
// CHECK:           %[[O1:.*]] = stablehlo.add {{.*}}hlopar.layer = 1
// CHECK:           %[[O2:.*]] = stablehlo.add {{.*}}hlopar.layer = 2
// CHECK-NEXT:      mpmd.return %[[O2]], %[[O0]], %[[O1]] :
// CHECK:         mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg4, %[[F]]#1, %[[F]]#2, %arg0, %arg1, %arg2, %arg3) {hlopar.remat = "layers"} (%[[G:.*]]: tensor<8x4xf32>, %[[SO0:.*]]: tensor<8x4xf32>, %[[SO1:.*]]: tensor<8x4xf32>, %[[W0:.*]]: tensor<4x4xf32>, %[[W1:.*]]: tensor<4x4xf32>, %[[W2:.*]]: tensor<4x4xf32>, %[[X:.*]]: tensor<8x4xf32>)
// CHECK-NEXT:      %[[TWO:.*]] = stablehlo.constant
// CHECK-NEXT:      %[[H2:.*]] = stablehlo.dot_general %[[SO1]], %[[W2]], contracting_dims = [1] x [0] {hlopar.layer = 2
// CHECK-NEXT:      %[[A2:.*]] = stablehlo.tanh %[[H2]]
// CHECK-NEXT:      stablehlo.multiply %[[A2]], %[[A2]]
// CHECK:           %[[G1:.*]] = stablehlo.dot_general %{{.*}}, %[[W2]], contracting_dims = [1] x [1]
// CHECK-NEXT:      %[[B1:.*]]:3 = stablehlo.optimization_barrier %[[G1]], %[[W1]], %[[SO0]]
// CHECK-NEXT:      %[[H1:.*]] = stablehlo.dot_general %[[B1]]#2, %[[B1]]#1, contracting_dims = [1] x [0] {hlopar.layer = 1
// CHECK-NEXT:      %[[A1:.*]] = stablehlo.tanh %[[H1]]
// CHECK-NEXT:      stablehlo.multiply %[[A1]], %[[A1]]
// CHECK-NEXT:      stablehlo.subtract %[[TWO]]
// CHECK-NEXT:      stablehlo.multiply %[[B1]]#0,
// CHECK:           %[[G0:.*]] = stablehlo.dot_general %{{.*}}, %[[W1]], contracting_dims = [1] x [1]
// CHECK-NEXT:      %[[B0:.*]]:3 = stablehlo.optimization_barrier %[[G0]], %[[W0]], %[[X]]
// CHECK-NEXT:      %[[H0:.*]] = stablehlo.dot_general %[[B0]]#2, %[[B0]]#1, contracting_dims = [1] x [0] {hlopar.layer = 0
// CHECK-NEXT:      %[[A0:.*]] = stablehlo.tanh %[[H0]]
// CHECK-NEXT:      stablehlo.multiply %[[A0]], %[[A0]]
// CHECK-NEXT:      stablehlo.subtract %[[TWO]]
// CHECK-NEXT:      stablehlo.multiply %[[B0]]#0,
// CHECK-NEXT:      stablehlo.dot_general %[[X]],
// CHECK-NEXT:      mpmd.return
module attributes {hlopar.devices = {m0 = array<i64: 0>}} {
  sdy.mesh @m0 = <["x"=1]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg4: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=1]>>>} {
    %0:6 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%w0: tensor<4x4xf32>, %w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %x: tensor<8x4xf32>) {
      %h0 = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] {hlopar.layer = 0 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %a0 = stablehlo.tanh %h0 {hlopar.layer = 0 : i64} : tensor<8x4xf32>
      %o0 = stablehlo.add %h0, %a0 {hlopar.layer = 0 : i64} : tensor<8x4xf32>
      %h1 = stablehlo.dot_general %o0, %w1, contracting_dims = [1] x [0] {hlopar.layer = 1 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %a1 = stablehlo.tanh %h1 {hlopar.layer = 1 : i64} : tensor<8x4xf32>
      %o1 = stablehlo.add %h1, %a1 {hlopar.layer = 1 : i64} : tensor<8x4xf32>
      %h2 = stablehlo.dot_general %o1, %w2, contracting_dims = [1] x [0] {hlopar.layer = 2 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %a2 = stablehlo.tanh %h2 {hlopar.layer = 2 : i64} : tensor<8x4xf32>
      %o2 = stablehlo.add %h2, %a2 {hlopar.layer = 2 : i64} : tensor<8x4xf32>
      mpmd.return %o2, %a0, %a1, %a2, %o0, %o1 : tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>)
    %1:3 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg4, %0#1, %0#2, %0#3, %0#4, %0#5, %arg0, %arg1, %arg2, %arg3) {hlopar.remat = "layers"} (%g: tensor<8x4xf32>, %a0: tensor<8x4xf32>, %a1: tensor<8x4xf32>, %a2: tensor<8x4xf32>, %o0: tensor<8x4xf32>, %o1: tensor<8x4xf32>, %w0: tensor<4x4xf32>, %w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %x: tensor<8x4xf32>) {
      %two = stablehlo.constant {hlopar.layer = 2 : i64} dense<2.0> : tensor<8x4xf32>
      %t2 = stablehlo.multiply %a2, %a2 {hlopar.layer = 2 : i64} : tensor<8x4xf32>
      %d2 = stablehlo.subtract %two, %t2 {hlopar.layer = 2 : i64} : tensor<8x4xf32>
      %e2 = stablehlo.multiply %g, %d2 {hlopar.layer = 2 : i64} : tensor<8x4xf32>
      %gw2 = stablehlo.dot_general %o1, %e2, contracting_dims = [0] x [0] {hlopar.layer = 2 : i64} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %g1 = stablehlo.dot_general %e2, %w2, contracting_dims = [1] x [1] {hlopar.layer = 2 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %t1 = stablehlo.multiply %a1, %a1 {hlopar.layer = 1 : i64} : tensor<8x4xf32>
      %d1 = stablehlo.subtract %two, %t1 {hlopar.layer = 1 : i64} : tensor<8x4xf32>
      %e1 = stablehlo.multiply %g1, %d1 {hlopar.layer = 1 : i64} : tensor<8x4xf32>
      %gw1 = stablehlo.dot_general %o0, %e1, contracting_dims = [0] x [0] {hlopar.layer = 1 : i64} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %g0 = stablehlo.dot_general %e1, %w1, contracting_dims = [1] x [1] {hlopar.layer = 1 : i64} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %t0 = stablehlo.multiply %a0, %a0 {hlopar.layer = 0 : i64} : tensor<8x4xf32>
      %d0 = stablehlo.subtract %two, %t0 {hlopar.layer = 0 : i64} : tensor<8x4xf32>
      %e0 = stablehlo.multiply %g0, %d0 {hlopar.layer = 0 : i64} : tensor<8x4xf32>
      %gw0 = stablehlo.dot_general %x, %e0, contracting_dims = [0] x [0] {hlopar.layer = 0 : i64} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      mpmd.return %gw0, %gw1, %gw2 : tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>)
    return %0#0, %1#0, %1#1, %1#2 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<4x4xf32>>
  }
}
