// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s

// GSPMD strings on arguments and results become sdy shardings, all on one mesh whose axes
// refine every string's tiling (2x4 and 4x2 tilings of 8 devices: axes 2x2x2); a
// replicated value goes on that same mesh; @Sharding custom calls become constraints.

// CHECK:       sdy.mesh @mesh = <["axis_0"=2, "axis_1"=2, "axis_2"=2]>
// CHECK-NOT:   sdy.mesh
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    %arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"axis_0"}, {"axis_1", "axis_2"}]>}
// CHECK-SAME:    %arg1: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}
// CHECK-SAME:    -> (tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"axis_0"}, {}]>})
// CHECK-NOT:     mhlo.sharding
// CHECK:         %[[C:.*]] = sdy.sharding_constraint %{{.*}} <@mesh, [{}, {"axis_0", "axis_1"}]> : tensor<8x16xf32>
// CHECK:         return %[[C]]
func.func public @main(%arg0: tensor<8x16xf32> {mhlo.sharding = "{devices=[2,4]<=[8]}"},
                       %arg1: tensor<16xf32> {mhlo.sharding = "{replicated}"})
    -> (tensor<8x16xf32> {mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"}) {
  %0 = stablehlo.broadcast_in_dim %arg1, dims = [1] : (tensor<16xf32>) -> tensor<8x16xf32>
  %1 = stablehlo.add %arg0, %0 : tensor<8x16xf32>
  %2 = stablehlo.custom_call @Sharding(%1) {mhlo.sharding = "{devices=[1,4,2]<=[8] last_tile_dim_replicate}"} : (tensor<8x16xf32>) -> tensor<8x16xf32>
  return %2 : tensor<8x16xf32>
}

// -----

// A transposed iota device list: the mesh axes are factored so that device ids stay iota.

// CHECK:       sdy.mesh @[[MESH:.*]] = <["axis_0"=2, "axis_1"=4]>
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    sdy.sharding = #sdy.sharding<@[[MESH]], [{"axis_1"}, {"axis_0"}]>
func.func public @main(%arg0: tensor<8x16xf32> {mhlo.sharding = "{devices=[4,2]<=[2,4]T(1,0)}"}) -> tensor<8x16xf32> {
  return %arg0 : tensor<8x16xf32>
}

// -----

// An explicit, non-iota device list keeps its order through device_ids.

// CHECK:       sdy.mesh @mesh = <["axis_0"=4], device_ids=[3, 1, 2, 0]>
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    sdy.sharding = #sdy.sharding<@mesh, [{"axis_0"}]>
func.func public @main(%arg0: tensor<8xf32> {mhlo.sharding = "{devices=[4]3,1,2,0}"}) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

// Maximal and manual shardings have no sdy tensor form: the GSPMD strings stay, as XLA reads them.

// CHECK-LABEL: func.func public @main
// CHECK-SAME:    mhlo.sharding = "{maximal device=1}"
// CHECK:         stablehlo.custom_call @Sharding(%{{.*}}) {mhlo.sharding = "{manual}"}
func.func public @main(%arg0: tensor<8xf32> {mhlo.sharding = "{maximal device=1}"}) -> tensor<8xf32> {
  %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{manual}"} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

// Shardy's round-trip form (what jax.export writes): meshes and shardings in frontend
// attributes, results marked by @xla.sdy.FuncResultSharding, constraints by @xla.sdy.Sharding.

// CHECK:       sdy.mesh @mesh = <["a"=2, "b"=2]>
// CHECK-NOT:   sdy.mesh
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    %arg0: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"a"}, {}]>}
// CHECK-SAME:    -> (tensor<4x4xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{}, {"b"}]>})
// CHECK-NOT:     xla.sdy
// CHECK-NOT:     mhlo.sharding
// CHECK:         %[[C:.*]] = sdy.sharding_constraint %{{.*}} <@mesh, [{"b"}, {"a"}]>
// CHECK-NEXT:    return %[[C]]
module @jit_f attributes {mhlo.frontend_attributes = {xla.sdy.meshes = "{mesh = #sdy.mesh<[\22a\22=2, \22b\22=2]>}"}} {
  func.func public @main(%arg0: tensor<4x4xf32> {mhlo.frontend_attributes = {xla.sdy.sharding = "#sdy.sharding<@mesh, [{\22a\22}, {}]>"}, mhlo.sharding = "{devices=[2,1,2]<=[4] last_tile_dim_replicate}"})
      -> (tensor<4x4xf32> {jax.result_info = "result", mhlo.sharding = "{devices=[1,2,2]<=[2,2]T(1,0) last_tile_dim_replicate}"}) {
    %0 = stablehlo.negate %arg0 : tensor<4x4xf32>
    %1 = stablehlo.custom_call @xla.sdy.Sharding(%0) {mhlo.frontend_attributes = {xla.sdy.sharding = "#sdy.sharding_per_value<[<@mesh, [{\22b\22}, {\22a\22}]>]>"}} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.custom_call @xla.sdy.FuncResultSharding(%1) {has_side_effect = true, mhlo.frontend_attributes = {xla.sdy.sharding = "#sdy.sharding_per_value<[<@mesh, [{}, {\22b\22}]>]>"}} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    return %2 : tensor<4x4xf32>
  }
}

// -----

// sdy already in the input is kept as it is, and wins over a redundant GSPMD string.

// CHECK:       sdy.mesh @mesh = <["x"=2]>
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    {sdy.sharding = #sdy.sharding<@mesh, [{"x", ?}p1]>}
// CHECK-NOT:     mhlo.sharding
// CHECK:         sdy.sharding_constraint %arg0 <@mesh, [{}]>
sdy.mesh @mesh = <["x"=2]>
func.func public @main(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x", ?}p1]>, mhlo.sharding = "{devices=[2]<=[2]}"}) -> tensor<8xf32> {
  %0 = sdy.sharding_constraint %arg0 <@mesh, [{}]> : tensor<8xf32>
  return %0 : tensor<8xf32>
}
