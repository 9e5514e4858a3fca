// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2})' | FileCheck %s
// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2 strategy=send-recv})' | FileCheck %s --check-prefix=SR
// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2 strategy=alpa-local-allgather})' | FileCheck %s --check-prefix=ALPA
// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2 algorithm=naive})' | FileCheck %s --check-prefix=NAIVE
// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding{devices-per-host=2 chunks=8})' | FileCheck %s --check-prefix=CHUNKS

// The strategies and algorithms on one small transfer (hosts of 2 devices: m1 on hosts 0
// and 1, m2 on hosts 2 and 3). RS0R -> S0RR: four quarter boxes, each held by the two
// devices of one source host and needed by the two devices of one destination host.

// The ensemble: both source hosts send at once, to different destination hosts; within a
// host the sending device alternates.
// CHECK-LABEL: func.func @rs0r_to_s0rr
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 8, 4>, receivers = array<i64: 4, 5>, sender = 2 : i64, slot = 0 : i64, start = array<i64: 0, 4, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 4, 4>, receivers = array<i64: 6, 7>, sender = 0 : i64, slot = 1 : i64, start = array<i64: 4, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 4, 4>, receivers = array<i64: 4, 5>, sender = 1 : i64, slot = 2 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 8, 4>, receivers = array<i64: 6, 7>, sender = 3 : i64, slot = 3 : i64, start = array<i64: 4, 4, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = {{.*}}, predicted_time = {{.*}}, strategy = "broadcast"}

// Send/recv: the same boxes, each sent whole to every receiver in turn (no chunks).
// SR-LABEL: func.func @rs0r_to_s0rr
// SR-COUNT-4: "hlopar.send_recv"() {limit = {{.*}}, receivers = {{.*}}, sender = {{.*}}, slot = {{.*}}, start = {{.*}}}
// SR:         strategy = "send-recv"

// Alpa: one part per receiver along dimension 0, then an all-gather.
// ALPA-LABEL: func.func @rs0r_to_s0rr
// ALPA:         "hlopar.scatter_allgather"() {limit = array<i64: 4, 8, 4>, receivers = array<i64: 4, 5>, sender = 2 : i64, slot = 0 : i64, split_dim = 0 : i64, start = array<i64: 0, 4, 0>}
// ALPA-COUNT-3: "hlopar.scatter_allgather"() {{.*}} split_dim = 0 : i64
// ALPA:         strategy = "alpa-local-allgather"

// Naive: the lowest-indexed holder sends, in Alpa's order (destination box, then source
// box), so both source hosts first serve destination host 2 one after the other.
// NAIVE-LABEL: func.func @rs0r_to_s0rr
// NAIVE:         "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 4, 4>, receivers = array<i64: 4, 5>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// NAIVE-NEXT:    "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 8, 4>, receivers = array<i64: 4, 5>, sender = 2 : i64, slot = 1 : i64, start = array<i64: 0, 4, 0>}
// NAIVE-NEXT:    "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 4, 4>, receivers = array<i64: 6, 7>, sender = 0 : i64, slot = 2 : i64, start = array<i64: 4, 0, 0>}
// NAIVE-NEXT:    "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 8, 8, 4>, receivers = array<i64: 6, 7>, sender = 2 : i64, slot = 3 : i64, start = array<i64: 4, 4, 0>}
// NAIVE:         algorithm = "naive"

// A fixed chunk count.
// CHUNKS-LABEL: func.func @rs0r_to_s0rr
// CHUNKS-COUNT-4: "hlopar.broadcast"() {chunks = 8 : i64,

!src = !mpmd.mesh_tensor<"m1", tensor<8x8x4xf32>, sharding=<@mesh, [{}, {"x"}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<8x8x4xf32>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 4, 5, 6, 7>}} {
  func.func @rs0r_to_s0rr(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=2]>>, <"m2" : <["x"=2, "y"=2]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// One device to three (devices 2 and 3 on host 1, device 4 on host 2), fully replicated.
// Broadcast chains through all three; Alpa's local all-gather needs a dimension that 3
// divides: without one (4x8) it falls back to send/recv, as Alpa does (§5.1.1), with one
// (6x8) it scatters along it.

// CHECK-LABEL: func.func @one_to_three
// CHECK:         "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}
// CHECK:         "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 6, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}

// SR-LABEL: func.func @one_to_three
// SR-COUNT-2: "hlopar.send_recv"() {limit = {{.*}}, receivers = array<i64: 2, 3, 4>, sender = 0 : i64

// ALPA-LABEL: func.func @one_to_three
// ALPA:         "hlopar.send_recv"() {limit = array<i64: 4, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}
// ALPA:         "hlopar.scatter_allgather"() {limit = array<i64: 6, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, split_dim = 0 : i64, start = array<i64: 0, 0>}

// NAIVE-LABEL: func.func @one_to_three
// NAIVE:         "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 4, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}
// NAIVE:         algorithm = "naive"
// NAIVE:         "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 6, 8>, receivers = array<i64: 2, 3, 4>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0>}
// NAIVE:         algorithm = "naive"
// CHUNKS-LABEL: func.func @one_to_three
// CHUNKS-COUNT-2: "hlopar.broadcast"() {chunks = 8 : i64,

!one = !mpmd.mesh_tensor<"m1", tensor<4x8xf32>>
!three = !mpmd.mesh_tensor<"m2", tensor<4x8xf32>>
!one6 = !mpmd.mesh_tensor<"m1", tensor<6x8xf32>>
!three6 = !mpmd.mesh_tensor<"m2", tensor<6x8xf32>>
module attributes {hlopar.devices = {m1 = array<i64: 0>, m2 = array<i64: 2, 3, 4>}} {
  func.func @one_to_three(%arg0: !one, %arg1: !one6) -> (!three, !three6)
      attributes {topology = #mpmd.topology<<"m1" : <["x"=1]>>, <"m2" : <["x"=3]>>>} {
    %0 = mpmd.transfer %arg0 : (!one) -> !three
    %1 = mpmd.transfer %arg1 : (!one6) -> !three6
    return %0, %1 : !three, !three6
  }
}
