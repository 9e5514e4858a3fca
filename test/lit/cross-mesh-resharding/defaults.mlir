// RUN: hlopar-opt %s --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2})' | FileCheck %s

// Without hlopar.devices, meshes get consecutive device ids in topology order, and the pass
// records them. Layouts missing from the mesh tensor types come from the argument's
// `sdy.sharding` (source) and the transfer's own `sdy.sharding` (destination), read on the
// axes of the topology mesh the type names (here x of m1 and y of m2). A transfer
// within one mesh is a reshard, not a cross-mesh transfer, and stays as it is.

// CHECK:       module attributes {hlopar.devices = {m1 = array<i64: 0, 1>, m2 = array<i64: 2, 3>}}
// CHECK-LABEL: func.func @main
// CHECK:         %[[T:.*]] = "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 4>, receivers = array<i64: 2>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 4>, receivers = array<i64: 2>, sender = 1 : i64, slot = 1 : i64, start = array<i64: 4, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 8>, receivers = array<i64: 3>, sender = 0 : i64, slot = 2 : i64, start = array<i64: 0, 4>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 8>, receivers = array<i64: 3>, sender = 1 : i64, slot = 3 : i64, start = array<i64: 4, 4>}
// CHECK-NEXT:    })
// CHECK:         %[[R:.*]] = mpmd.transfer %[[T]]
// CHECK-SAME:      -> !mpmd.mesh_tensor<"m2", tensor<8x8xf32>, sharding=<@mesh, [{"y"}, {}]>>
// CHECK-NEXT:    return %[[R]]

module {
  sdy.mesh @mesh = <["x"=2, "y"=2]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m1", tensor<8x8xf32>> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>})
      -> !mpmd.mesh_tensor<"m2", tensor<8x8xf32>, sharding=<@mesh, [{"y"}, {}]>>
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["y"=2]>>>} {
    %0 = mpmd.transfer {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"y"}]>]>} %arg0
        : (!mpmd.mesh_tensor<"m1", tensor<8x8xf32>>) -> !mpmd.mesh_tensor<"m2", tensor<8x8xf32>>
    %1 = mpmd.transfer %0 : (!mpmd.mesh_tensor<"m2", tensor<8x8xf32>>) -> !mpmd.mesh_tensor<"m2", tensor<8x8xf32>, sharding=<@mesh, [{"y"}, {}]>>
    return %1 : !mpmd.mesh_tensor<"m2", tensor<8x8xf32>, sharding=<@mesh, [{"y"}, {}]>>
  }
}
