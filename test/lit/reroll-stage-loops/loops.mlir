// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-reroll-stage-loops)' | FileCheck %s
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-reroll-stage-loops)' 2>&1 >/dev/null | FileCheck %s --check-prefix=WARN
// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-reroll-stage-loops{reroll=never})' | FileCheck %s --check-prefix=NEVER
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-reroll-stage-loops{min-trips=0})' 2>&1 | FileCheck %s --check-prefix=ERR

// Three identical iterations of an unrolled scan (hlopar-unstack-layer-scans' copies, tagged
// [loop, iteration, body op, layer]) in one forward fragment: one while over the range. The
// layers' weight pieces are packed in iteration order and sliced by the counter, the hidden
// state is carried, and the residuals each iteration hands out are written into a stacked
// buffer and read back per iteration after the loop.

// CHECK-LABEL: func.func @main
// CHECK:         mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%[[X:.*]]: tensor<8x4xf32>, %[[W0:.*]]: tensor<1x4x4xf32>, %[[W1:.*]]: tensor<1x4x4xf32>, %[[W2:.*]]: tensor<1x4x4xf32>)
// CHECK:           %[[R0:.*]] = stablehlo.reshape %[[W0]] : (tensor<1x4x4xf32>) -> tensor<1x1x4x4xf32>
// CHECK:           %[[R1:.*]] = stablehlo.reshape %[[W1]]
// CHECK:           %[[R2:.*]] = stablehlo.reshape %[[W2]]
// CHECK:           %[[PACK:.*]] = stablehlo.concatenate %[[R0]], %[[R1]], %[[R2]], dim = 0 : (tensor<1x1x4x4xf32>, tensor<1x1x4x4xf32>, tensor<1x1x4x4xf32>) -> tensor<3x1x4x4xf32>
// CHECK:           %[[ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<3x8x4xf32>
// CHECK:           %[[LOOP:.*]]:4 = stablehlo.while(%[[I:.*]] = %{{.*}}, %[[WS:.*]] = %[[PACK]], %[[H:.*]] = %[[X]], %[[RES:.*]] = %[[ZEROS]]) : tensor<i32>, tensor<3x1x4x4xf32>, tensor<8x4xf32>, tensor<3x8x4xf32>
// CHECK-SAME:        attributes {hlopar.layer_loop = array<i64: 0, 0, 3>, hlopar.microbatch = "batch"}
// CHECK:             stablehlo.compare LT, %[[I]], %{{.*}}, SIGNED
// CHECK:           } do {
// CHECK:             %[[ROW:.*]] = stablehlo.dynamic_slice %[[WS]], %[[I]], %{{.*}}, sizes = [1, 1, 4, 4]
// CHECK:             %[[W:.*]] = stablehlo.reshape %[[ROW]] : (tensor<1x1x4x4xf32>) -> tensor<1x4x4xf32>
// CHECK:             %[[WM:.*]] = stablehlo.reshape %[[W]] {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
// CHECK:             %[[D:.*]] = stablehlo.dot_general %[[H]], %[[WM]]
// CHECK:             %[[T:.*]] = stablehlo.tanh %[[D]]
// CHECK:             %[[NEXT:.*]] = stablehlo.add %[[I]]
// CHECK:             %[[DROW:.*]] = stablehlo.reshape %[[D]] : (tensor<8x4xf32>) -> tensor<1x8x4xf32>
// CHECK:             %[[STASH:.*]] = stablehlo.dynamic_update_slice %[[RES]], %[[DROW]], %[[I]], %{{.*}}, %{{.*}} : (tensor<3x8x4xf32>, tensor<1x8x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x8x4xf32>
// CHECK:             stablehlo.return %[[NEXT]], %[[WS]], %[[T]], %[[STASH]]
// CHECK:           }
// CHECK-NOT:       stablehlo.dot_general
// CHECK:           stablehlo.slice %[[LOOP]]#3 [0:1, 0:8, 0:4]
// CHECK:           %[[D0:.*]] = stablehlo.reshape %{{.*}} {hlopar.microbatch = "batch"} : (tensor<1x8x4xf32>) -> tensor<8x4xf32>
// CHECK:           stablehlo.slice %[[LOOP]]#3 [1:2, 0:8, 0:4]
// CHECK:           stablehlo.slice %[[LOOP]]#3 [2:3, 0:8, 0:4]
// The last hidden state leaves the stage: the loop's carry, not a stacked copy.
// CHECK:           mpmd.return %[[LOOP]]#2, %[[D0]], %{{.*}}, %{{.*}} : tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
// NEVER-LABEL: func.func @main
// NEVER-NOT:     stablehlo.while
// NEVER-COUNT-3: stablehlo.dot_general
// ERR: error: option 'min-trips' of pass 'hlopar-reroll-stage-loops': invalid value '0': expected a positive integer, got 0
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0:4 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%x: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>) {
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d0 = stablehlo.dot_general %x, %r0, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h0 = stablehlo.tanh %d0 {hlopar.layer_iteration = array<i64: 0, 0, 2, 0>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 0, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d1 = stablehlo.dot_general %h0, %r1, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h1 = stablehlo.tanh %d1 {hlopar.layer_iteration = array<i64: 0, 1, 2, 1>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 0, 2, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d2 = stablehlo.dot_general %h1, %r2, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 2, 1, 2>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.tanh %d2 {hlopar.layer_iteration = array<i64: 0, 2, 2, 2>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      mpmd.return %h2, %d0, %d1, %d2 : tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>)
    return %0#0, %0#1, %0#2, %0#3 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
  }
}

// -----

// Iterations that differ (layer 1 runs another activation): no run of two identical ones,
// each stays as it is, nothing to warn about (one iteration is cheaper unrolled).

// CHECK-LABEL: func.func @main
// CHECK-NOT:     stablehlo.while
// CHECK:         stablehlo.logistic
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>> attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%x: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>) {
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d0 = stablehlo.dot_general %x, %r0, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h0 = stablehlo.tanh %d0 {hlopar.layer_iteration = array<i64: 0, 0, 2, 0>} : tensor<8x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 0, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d1 = stablehlo.dot_general %h0, %r1, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h1 = stablehlo.logistic %d1 {hlopar.layer_iteration = array<i64: 0, 1, 2, 1>} : tensor<8x4xf32>
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 0, 2, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d2 = stablehlo.dot_general %h1, %r2, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 2, 1, 2>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.tanh %d2 {hlopar.layer_iteration = array<i64: 0, 2, 2, 2>} : tensor<8x4xf32>
      mpmd.return %h2 : tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
    return %0 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
  }
}

// -----

// An op outside the iterations that reads one and is read by the next (untagged): there is
// no place for one loop; the range stays unrolled, with a warning saying why.

// WARN: warning: hlopar-reroll-stage-loops: layers 0..2 of loop 0 stay unrolled in stage0: 'stablehlo.negate' outside the run both reads it and is read by it
// CHECK-LABEL: func.func @main
// CHECK-NOT:     stablehlo.while
// CHECK:         stablehlo.negate
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>> attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%x: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>) {
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d0 = stablehlo.dot_general %x, %r0, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h0 = stablehlo.tanh %d0 {hlopar.layer_iteration = array<i64: 0, 0, 2, 0>} : tensor<8x4xf32>
      %n0 = stablehlo.negate %h0 : tensor<8x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 0, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d1 = stablehlo.dot_general %n0, %r1, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h1 = stablehlo.tanh %d1 {hlopar.layer_iteration = array<i64: 0, 1, 2, 1>} : tensor<8x4xf32>
      %n1 = stablehlo.negate %h1 : tensor<8x4xf32>
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 0, 2, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d2 = stablehlo.dot_general %n1, %r2, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 2, 1, 2>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.tanh %d2 {hlopar.layer_iteration = array<i64: 0, 2, 2, 2>} : tensor<8x4xf32>
      mpmd.return %h2 : tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
    return %0 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
  }
}

// -----

// Layer 2 reads layer 0's output (two iterations back): not a loop body's wiring.

// WARN: warning: hlopar-reroll-stage-loops: layers 0..2 of loop 0 stay unrolled in stage0: operand 0 of 'stablehlo.dot_general' reads values of other iterations than the loop's own or its previous one
// CHECK-LABEL: func.func @main
// CHECK-NOT:     stablehlo.while
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>> attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%x: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>) {
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d0 = stablehlo.dot_general %x, %r0, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h0 = stablehlo.tanh %d0 {hlopar.layer_iteration = array<i64: 0, 0, 2, 0>} : tensor<8x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 0, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d1 = stablehlo.dot_general %h0, %r1, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h1 = stablehlo.tanh %d1 {hlopar.layer_iteration = array<i64: 0, 1, 2, 1>} : tensor<8x4xf32>
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 0, 2, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d2 = stablehlo.dot_general %h0, %r2, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 2, 1, 2>} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.tanh %d2 {hlopar.layer_iteration = array<i64: 0, 2, 2, 2>} : tensor<8x4xf32>
      mpmd.return %h2 : tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
    return %0 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>
  }
}

// -----

// A whole stage of a scan over 3 layers (hlopar.layer_pieces on @main: argument 1 and result 1
// are the stacked weight, one piece per layer): the forward loops over layers 0..2, the
// backward over 2..0, the update runs per piece. The weight's pieces become ONE argument and
// ONE result of rows 0:3, which the loops read by their counter (the backward's row 2 - i) and
// the update computes on the whole range; the forward hands its stashed residuals to the
// backward, and the backward its gradients to the update, as one stacked value each. No
// concatenate packs or joins pieces any more.

// CHECK-LABEL: func.func @main
// CHECK-SAME:    (%[[X:.*]]: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %[[W:.*]]: !mpmd.mesh_tensor<"m0", tensor<3x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<3x4x4xf32>>)
// CHECK-SAME:    hlopar.layer_pieces = {arg_origin = array<i64: 0, 1>, arg_piece = array<i64: -1, 0>, arg_rows = array<i64: 1, 3>, result_origin = array<i64: 0, 1>, result_piece = array<i64: -1, 0>, result_rows = array<i64: 1, 3>}
// CHECK-NOT:     stablehlo.concatenate
// CHECK:         %[[FWD:.*]]:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%[[X]], %[[W]]) (%{{.*}}: tensor<8x4xf32>, %[[WF:.*]]: tensor<3x4x4xf32>)
// CHECK:           stablehlo.while(%[[I:[^ ]*]] = %{{.*}}, %[[WS:[^ ]*]] = %[[WF]],
// CHECK:             stablehlo.dynamic_slice %[[WS]], %[[I]], %{{.*}}, %{{.*}}, sizes = [1, 4, 4]
// CHECK:           mpmd.return %{{.*}}, %{{.*}} : tensor<8x4xf32>, tensor<3x8x4xf32>
// CHECK:         } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<3x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<3x8x4xf32>>)
// CHECK:         %[[BWD:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%[[FWD]]#0, %[[W]], %[[FWD]]#1) (%{{.*}}: tensor<8x4xf32>, %[[WB:.*]]: tensor<3x4x4xf32>, %[[STASH:.*]]: tensor<3x8x4xf32>)
// CHECK:           stablehlo.while(%[[J:[^ ]*]] = %{{.*}}, %[[WSB:[^ ]*]] = %[[WB]], %{{.*}} = %{{.*}}, %[[ST:[^ ]*]] = %[[STASH]],
// CHECK:             %[[NEG:.*]] = stablehlo.multiply %[[J]], %{{.*}} : tensor<i32>
// CHECK:             %[[ROW:.*]] = stablehlo.add %[[NEG]], %{{.*}} : tensor<i32>
// CHECK:             stablehlo.dynamic_slice %[[WSB]], %[[ROW]], %{{.*}}, %{{.*}}, sizes = [1, 4, 4]
// CHECK:             stablehlo.dynamic_slice %[[ST]], %{{.*}}, %{{.*}}, %{{.*}}, sizes = [1, 8, 4]
// CHECK-NOT:         stablehlo.dynamic_slice %[[ST]]
// CHECK:           mpmd.return %{{.*}} : tensor<3x1x4x4xf32>
// The update runs once on the whole range (its layers' gradients in the backward's order, reversed).
// CHECK:         %[[UPD:.*]] = mpmd.fragment<mesh="m0", origin=["stage0_update"]> (%[[W]], %[[BWD]]) (%[[WU:.*]]: tensor<3x4x4xf32>, %[[G:.*]]: tensor<3x1x4x4xf32>)
// CHECK-NEXT:      %[[REV:.*]] = stablehlo.reverse %[[G]], dims = [0] : tensor<3x1x4x4xf32>
// CHECK-NEXT:      %[[GW:.*]] = stablehlo.reshape %[[REV]] : (tensor<3x1x4x4xf32>) -> tensor<3x4x4xf32>
// CHECK-NEXT:      %[[NEW:.*]] = stablehlo.subtract %[[WU]], %[[GW]] : tensor<3x4x4xf32>
// CHECK-NEXT:      mpmd.return %[[NEW]] : tensor<3x4x4xf32>
// CHECK:         return %[[FWD]]#0, %[[UPD]]
// NEVER-LABEL: func.func @main
// NEVER-NOT:     stablehlo.while
// NEVER:         %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>
module attributes {hlopar.devices = {m0 = array<i64: 0, 1>}} {
  sdy.mesh @m0 = <["x"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, %arg3: !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=2]>>>, hlopar.layer_pieces = {arg_origin = array<i64: 0, 1, 1, 1>, arg_piece = array<i64: -1, 0, 1, 2>, result_origin = array<i64: 0, 1, 1, 1>, result_piece = array<i64: -1, 0, 1, 2>}} {
    %0:4 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1, %arg2, %arg3) (%x: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>) {
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 0, 0, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d0 = stablehlo.dot_general %x, %r0, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 0, 1, 0>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h0 = stablehlo.tanh %d0 {hlopar.layer_iteration = array<i64: 0, 0, 2, 0>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 0, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d1 = stablehlo.dot_general %h0, %r1, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 1, 1, 1>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h1 = stablehlo.tanh %d1 {hlopar.layer_iteration = array<i64: 0, 1, 2, 1>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 0, 2, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %d2 = stablehlo.dot_general %h1, %r2, contracting_dims = [1] x [0] {hlopar.layer_iteration = array<i64: 0, 2, 1, 2>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %h2 = stablehlo.tanh %d2 {hlopar.layer_iteration = array<i64: 0, 2, 2, 2>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      mpmd.return %h2, %d0, %d1, %d2 : tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>)
    %1:3 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%0#0, %arg1, %arg2, %arg3, %0#1, %0#2, %0#3) (%c: tensor<8x4xf32>, %w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>, %d0: tensor<8x4xf32>, %d1: tensor<8x4xf32>, %d2: tensor<8x4xf32>) {
      %r2 = stablehlo.reshape %w2 {hlopar.layer_iteration = array<i64: 1, 0, 0, 2>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %m2 = stablehlo.multiply %c, %d2 {hlopar.layer_iteration = array<i64: 1, 0, 1, 2>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %c2 = stablehlo.dot_general %m2, %r2, contracting_dims = [1] x [1] {hlopar.layer_iteration = array<i64: 1, 0, 2, 2>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %g2 = stablehlo.dot_general %d2, %m2, contracting_dims = [0] x [0] {hlopar.layer_iteration = array<i64: 1, 0, 3, 2>, hlopar.microbatch = "sum"} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %u2 = stablehlo.reshape %g2 {hlopar.layer_iteration = array<i64: 1, 0, 4, 2>, hlopar.microbatch = "sum"} : (tensor<4x4xf32>) -> tensor<1x4x4xf32>
      %r1 = stablehlo.reshape %w1 {hlopar.layer_iteration = array<i64: 1, 1, 0, 1>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %m1 = stablehlo.multiply %c2, %d1 {hlopar.layer_iteration = array<i64: 1, 1, 1, 1>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %c1 = stablehlo.dot_general %m1, %r1, contracting_dims = [1] x [1] {hlopar.layer_iteration = array<i64: 1, 1, 2, 1>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %g1 = stablehlo.dot_general %d1, %m1, contracting_dims = [0] x [0] {hlopar.layer_iteration = array<i64: 1, 1, 3, 1>, hlopar.microbatch = "sum"} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %u1 = stablehlo.reshape %g1 {hlopar.layer_iteration = array<i64: 1, 1, 4, 1>, hlopar.microbatch = "sum"} : (tensor<4x4xf32>) -> tensor<1x4x4xf32>
      %r0 = stablehlo.reshape %w0 {hlopar.layer_iteration = array<i64: 1, 2, 0, 0>} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
      %m0 = stablehlo.multiply %c1, %d0 {hlopar.layer_iteration = array<i64: 1, 2, 1, 0>, hlopar.microbatch = "batch"} : tensor<8x4xf32>
      %c0 = stablehlo.dot_general %m0, %r0, contracting_dims = [1] x [1] {hlopar.layer_iteration = array<i64: 1, 2, 2, 0>, hlopar.microbatch = "batch"} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
      %g0 = stablehlo.dot_general %d0, %m0, contracting_dims = [0] x [0] {hlopar.layer_iteration = array<i64: 1, 2, 3, 0>, hlopar.microbatch = "sum"} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
      %u0 = stablehlo.reshape %g0 {hlopar.layer_iteration = array<i64: 1, 2, 4, 0>, hlopar.microbatch = "sum"} : (tensor<4x4xf32>) -> tensor<1x4x4xf32>
      mpmd.return %u0, %u1, %u2 : tensor<1x4x4xf32>, tensor<1x4x4xf32>, tensor<1x4x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>)
    %2:3 = mpmd.fragment<mesh="m0", origin=["stage0_update"]> (%arg1, %arg2, %arg3, %1#0, %1#1, %1#2) (%w0: tensor<1x4x4xf32>, %w1: tensor<1x4x4xf32>, %w2: tensor<1x4x4xf32>, %g0: tensor<1x4x4xf32>, %g1: tensor<1x4x4xf32>, %g2: tensor<1x4x4xf32>) {
      %n0 = stablehlo.subtract %w0, %g0 : tensor<1x4x4xf32>
      %n1 = stablehlo.subtract %w1, %g1 : tensor<1x4x4xf32>
      %n2 = stablehlo.subtract %w2, %g2 : tensor<1x4x4xf32>
      mpmd.return %n0, %n1, %n2 : tensor<1x4x4xf32>, tensor<1x4x4xf32>, tensor<1x4x4xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>)
    return %0#0, %2#0, %2#1, %2#2 : !mpmd.mesh_tensor<"m0", tensor<8x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>, !mpmd.mesh_tensor<"m0", tensor<1x4x4xf32>>
  }
}
