// RUN: hlopar-opt %s | hlopar-opt | FileCheck %s

// hlopar's transfer ops (generic form, unregistered `hlopar` dialect) parse, verify and
// print back unchanged, attributes included.

// CHECK:       module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 4, 5>}}
// CHECK-LABEL: func.func @main
// CHECK:         %[[T:.*]] = "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 4 : i64, limit = array<i64: 4, 16>, receivers = array<i64: 4, 5>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>} : () -> ()
// CHECK-NEXT:      "hlopar.send_recv"() {limit = array<i64: 8, 8>, receivers = array<i64: 4, 5>, sender = 2 : i64, slot = 1 : i64, start = array<i64: 4, 0>} : () -> ()
// CHECK-NEXT:      "hlopar.scatter_allgather"() {limit = array<i64: 8, 16>, receivers = array<i64: 4, 5>, sender = 3 : i64, slot = 2 : i64, split_dim = 0 : i64, start = array<i64: 4, 8>} : () -> ()
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 1.000000e-03 : f64, predicted_time = 1.500000e-03 : f64, strategy = "broadcast"}
// CHECK-SAME:    : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@mesh, [{"x"}, {}]>>) -> !mpmd.mesh_tensor<"m2", tensor<8x16xf32>>
// CHECK-NEXT:    return %[[T]]

module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 4, 5>}} {
  func.func @main(%arg0: !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@mesh, [{"x"}, {}]>>)
      -> !mpmd.mesh_tensor<"m2", tensor<8x16xf32>>
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=2]>>, <"m2" : <["z"=2]>>>} {
    %0 = "hlopar.cross_mesh_transfer"(%arg0) ({
      "hlopar.broadcast"() {sender = 0 : i64, receivers = array<i64: 4, 5>, start = array<i64: 0, 0>, limit = array<i64: 4, 16>, chunks = 4 : i64, slot = 0 : i64} : () -> ()
      "hlopar.send_recv"() {sender = 2 : i64, receivers = array<i64: 4, 5>, start = array<i64: 4, 0>, limit = array<i64: 8, 8>, slot = 1 : i64} : () -> ()
      "hlopar.scatter_allgather"() {sender = 3 : i64, receivers = array<i64: 4, 5>, start = array<i64: 4, 8>, limit = array<i64: 8, 16>, split_dim = 0 : i64, slot = 2 : i64} : () -> ()
    }) {strategy = "broadcast", algorithm = "ensemble", predicted_time = 1.5e-3 : f64, lower_bound = 1.0e-3 : f64}
      : (!mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@mesh, [{"x"}, {}]>>) -> !mpmd.mesh_tensor<"m2", tensor<8x16xf32>>
    return %0 : !mpmd.mesh_tensor<"m2", tensor<8x16xf32>>
  }
}
