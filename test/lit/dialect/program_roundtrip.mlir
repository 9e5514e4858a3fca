// RUN: hlopar-opt %s | hlopar-opt | FileCheck %s

// The form `write_mpmd_program` (hlopar/passes/mpmd_program.py) gives a pipelined program
// parses, verifies and prints back unchanged: physical devices in `hlopar.devices`, one
// sdy mesh per stage mesh named like it, mesh tensors carrying each stage's layouts, one
// fragment per (stage, role) with origin and stage (none for updates), a transfer for
// every value crossing meshes. Here stage 0's forward is split in two because op %3 of
// stage 0 reads stage 1's output, which reads stage 0's first op; the constant is copied
// into each fragment that reads it; the case op reads %arg7 only inside a branch.

// CHECK:       module attributes {hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}}
// CHECK-NEXT:    sdy.mesh @m0 = <["x"=4]>
// CHECK-NEXT:    sdy.mesh @m1 = <["x"=2, "y"=2]>
// CHECK-NEXT:    func.func @main
// CHECK-SAME:      attributes {topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=2, "y"=2]>>>}
// CHECK:         %[[F0:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1)
// CHECK:         %[[T0:.*]] = mpmd.transfer %[[F0]] : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>
// CHECK:         %[[F1:.*]]:2 = mpmd.fragment<mesh="m1", origin=["stage1"], stage=1> (%[[T0]], %arg2)
// CHECK:         %[[T1:.*]] = mpmd.transfer %[[F1]]#1
// CHECK:         %[[F2:.*]]:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%[[T1]], %[[F0]])
// CHECK-NEXT:      stablehlo.constant
// CHECK:         mpmd.transfer %[[F2]]#0
// CHECK-NEXT:    mpmd.transfer %arg0
// CHECK-NEXT:    %[[B1:.*]]:2 = mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1>
// CHECK-NEXT:      stablehlo.constant
// CHECK:           stablehlo.case
// CHECK:         mpmd.transfer %[[B1]]#1
// CHECK-NEXT:    %[[B0:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg0,
// CHECK:         %[[U0:.*]] = mpmd.fragment<mesh="m0", origin=["stage0_update"]> (%arg1, %[[B0]])
// CHECK:         return %[[U0]], %[[B1]]#0, %[[F2]]#1

module attributes {hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}} {
  sdy.mesh @m0 = <["x"=4]>
  sdy.mesh @m1 = <["x"=2, "y"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<16x16xf32>>, %arg2: !mpmd.mesh_tensor<"m1", tensor<16x16xf32>>, %arg3: !mpmd.mesh_tensor<"m1", tensor<i32>>) -> (!mpmd.mesh_tensor<"m0", tensor<16x16xf32>, sharding=<@m0, [{}, {"x"}]>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m0", tensor<f32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=2, "y"=2]>>>} {
    %0 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%arg4: tensor<8x16xf32>, %arg5: tensor<16x16xf32>) {
      %11 = stablehlo.dot_general %arg4, %arg5, contracting_dims = [1] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{}, {}]>]>} : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
      mpmd.return %11 : tensor<8x16xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>, !mpmd.mesh_tensor<"m0", tensor<16x16xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>
    %1 = mpmd.transfer %0 : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>
    %2:2 = mpmd.fragment<mesh="m1", origin=["stage1"], stage=1> (%1, %arg2) (%arg4: tensor<8x16xf32>, %arg5: tensor<16x16xf32>) {
      %11 = stablehlo.tanh %arg4 {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : tensor<8x16xf32>
      %12 = stablehlo.dot_general %11, %arg5, contracting_dims = [1] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
      mpmd.return %11, %12 : tensor<8x16xf32>, tensor<8x16xf32>
    } : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m1", tensor<16x16xf32>>) -> (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>)
    %3 = mpmd.transfer %2#1 : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>) -> !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>
    %4:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%3, %0) (%arg4: tensor<8x16xf32>, %arg5: tensor<8x16xf32>) {
      %cst = stablehlo.constant {sdy.sharding = #sdy.sharding_per_value<[<@m0, []>]>} dense<2.000000e+00> : tensor<f32>
      %11 = stablehlo.add %arg4, %arg5 {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{}, {}]>]>} : tensor<8x16xf32>
      %12 = stablehlo.reduce(%11 init: %cst) applies stablehlo.add across dimensions = [0, 1] {sdy.sharding = #sdy.sharding_per_value<[<@m0, []>]>} : (tensor<8x16xf32>, tensor<f32>) -> tensor<f32>
      mpmd.return %11, %12 : tensor<8x16xf32>, tensor<f32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>, !mpmd.mesh_tensor<"m0", tensor<f32>>)
    %5 = mpmd.transfer %4#0 : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>
    %6 = mpmd.transfer %arg0 : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>) -> !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>
    %7:2 = mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1> (%5, %6, %arg3, %2#0) (%arg4: tensor<8x16xf32>, %arg5: tensor<8x16xf32>, %arg6: tensor<i32>, %arg7: tensor<8x16xf32>) {
      %cst = stablehlo.constant {sdy.sharding = #sdy.sharding_per_value<[<@m1, []>]>} dense<2.000000e+00> : tensor<f32>
      %11 = stablehlo.broadcast_in_dim %cst, dims = [] {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : (tensor<f32>) -> tensor<8x16xf32>
      %12 = stablehlo.multiply %arg4, %11 {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : tensor<8x16xf32>
      %13 = stablehlo.add %12, %arg5 {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : tensor<8x16xf32>
      %14 = "stablehlo.case"(%arg6) ({
        stablehlo.return %13 : tensor<8x16xf32>
      }, {
        %15 = stablehlo.negate %arg7 {sdy.sharding = #sdy.sharding_per_value<[<@m1, [{"x", "y"}, {}]>]>} : tensor<8x16xf32>
        stablehlo.return %15 : tensor<8x16xf32>
      }) : (tensor<i32>) -> tensor<8x16xf32>
      mpmd.return %13, %14 : tensor<8x16xf32>, tensor<8x16xf32>
    } : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m1", tensor<i32>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>) -> (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>)
    %8 = mpmd.transfer %7#1 : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>) -> !mpmd.mesh_tensor<"m0", tensor<8x16xf32>, sharding=<@m0, [{}, {"x"}]>>
    %9 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg0, %8) (%arg4: tensor<8x16xf32>, %arg5: tensor<8x16xf32>) {
      %11 = stablehlo.dot_general %arg4, %arg5, contracting_dims = [0] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{}, {"x"}]>]>} : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
      mpmd.return %11 : tensor<16x16xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8x16xf32>>, !mpmd.mesh_tensor<"m0", tensor<8x16xf32>, sharding=<@m0, [{}, {"x"}]>>) -> !mpmd.mesh_tensor<"m0", tensor<16x16xf32>, sharding=<@m0, [{}, {"x"}]>>
    %10 = mpmd.fragment<mesh="m0", origin=["stage0_update"]> (%arg1, %9) (%arg4: tensor<16x16xf32>, %arg5: tensor<16x16xf32>) {
      %11 = stablehlo.subtract %arg4, %arg5 {sdy.sharding = #sdy.sharding_per_value<[<@m0, [{}, {"x"}]>]>} : tensor<16x16xf32>
      mpmd.return %11 : tensor<16x16xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<16x16xf32>>, !mpmd.mesh_tensor<"m0", tensor<16x16xf32>, sharding=<@m0, [{}, {"x"}]>>) -> !mpmd.mesh_tensor<"m0", tensor<16x16xf32>, sharding=<@m0, [{}, {"x"}]>>
    return %10, %7#0, %4#1 : !mpmd.mesh_tensor<"m0", tensor<16x16xf32>, sharding=<@m0, [{}, {"x"}]>>, !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"x", "y"}, {}]>>, !mpmd.mesh_tensor<"m0", tensor<f32>>
  }
}
