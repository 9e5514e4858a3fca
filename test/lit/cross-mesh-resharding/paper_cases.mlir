// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding)' | FileCheck %s

// The nine cases of Table 2 of the cross-mesh resharding paper on its cluster (the `paper`
// preset: 4 devices per host, 10 Gbps NICs). Meshes are laid out as in Alpa: a (n, m) mesh
// takes m devices on each of n hosts (hosts are device id / 4). Each op is one unit task:
// the box [start, limit) goes from `sender` down a chain through `receivers`, cut into
// `chunks` parts; `slot` is its place in the order. Every plan is within 5% of the bound.

// case1 of Table 2: S0RR on (2, 4) -> S0RR on (2, 4), 1024x1024x512 f16.
// Each source host holds one half and sends it to the destination host that needs it:
// two broadcasts at once, one per host pair.
// Predicted 0.4331 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case1
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 37 : i64, limit = array<i64: 512, 1024, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 37 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 4 : i64, slot = 1 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4331{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case1(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case2 of Table 2: RRR on (2, 4) -> S0RR on (2, 4), 1024x1024x512 f16.
// Both halves are on both source hosts: load balancing sends one half from each host
// (the naive plan sends both from host 0, twice as slow).
// Predicted 0.4331 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case2
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 37 : i64, limit = array<i64: 512, 1024, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 37 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 4 : i64, slot = 1 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4331{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case2(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case3 of Table 2: RS0R on (2, 4) -> S0RR on (2, 4), 1024x1024x512 f16.
// Four quarter boxes, one per (source host, destination host) pair: in each of two
// rounds the two source hosts send to different destination hosts, so no NIC idles.
// Predicted 0.4346 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case3
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 512, 1024, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 4 : i64, slot = 0 : i64, start = array<i64: 0, 512, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 512, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 0 : i64, slot = 1 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 512, 512, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 1 : i64, slot = 2 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 5 : i64, slot = 3 : i64, start = array<i64: 512, 512, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4346{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{}, {"x"}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case3(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case4 of Table 2: RS01R on (2, 4) -> S01RR on (2, 4), 1024x1024x512 f16.
// 64 single-device boxes (no replication anywhere, so no chunking): the order
// alternates destination hosts so that both source NICs and both destination NICs stay busy.
// Predicted 0.4311 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case4
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 128, 640, 512>, receivers = array<i64: 8>, sender = 4 : i64, slot = 0 : i64, start = array<i64: 0, 512, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 640, 128, 512>, receivers = array<i64: 12>, sender = 0 : i64, slot = 1 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 128, 768, 512>, receivers = array<i64: 8>, sender = 5 : i64, slot = 2 : i64, start = array<i64: 0, 640, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 1 : i64, limit = array<i64: 640, 256, 512>, receivers = array<i64: 12>, sender = 1 : i64, slot = 3 : i64, start = array<i64: 512, 128, 0>}
// CHECK-COUNT-60: "hlopar.broadcast"()
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4310{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{}, {"x", "y"}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x", "y"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case4(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case5 of Table 2: S1RR on (2, 4) -> S0RR on (2, 4), 1024x1024x512 f16.
// Quarters replicated on both source hosts: source host 1 sends the two quarters of
// destination host 2 while source host 0 sends the two of destination host 3.
// Predicted 0.4346 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case5
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 256, 1024, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 4 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 768, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 2 : i64, slot = 1 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 512, 1024, 512>, receivers = array<i64: 8, 9, 10, 11>, sender = 5 : i64, slot = 2 : i64, start = array<i64: 256, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 3 : i64, slot = 3 : i64, start = array<i64: 768, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4346{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"y"}, {}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case5(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case6 of Table 2: S0RR on (2, 4) -> S0RR on (3, 4), 3072x1024x170 f16.
// Halves to thirds (3072 rows: 1536 per source host, 1024 per destination host): the
// middle third (host 3) needs a sixth from each source host; host 0 sends its sixth first
// and host 1 last, so host 3 never receives from both at once and all finish at half.
// Predicted 0.4328 s, lower bound 0.4279 s.

// CHECK-LABEL: func.func @case6
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 20 : i64, limit = array<i64: 1536, 1024, 170>, receivers = array<i64: 12, 13, 14, 15>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 1024, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 30 : i64, limit = array<i64: 3072, 1024, 170>, receivers = array<i64: 16, 17, 18, 19>, sender = 4 : i64, slot = 1 : i64, start = array<i64: 2048, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 30 : i64, limit = array<i64: 1024, 1024, 170>, receivers = array<i64: 8, 9, 10, 11>, sender = 1 : i64, slot = 2 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 20 : i64, limit = array<i64: 2048, 1024, 170>, receivers = array<i64: 12, 13, 14, 15>, sender = 5 : i64, slot = 3 : i64, start = array<i64: 1536, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4278{{[0-9]*}} : f64, predicted_time = 0.4328{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<3072x1024x170xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<3072x1024x170xf16>, sharding=<@mesh, [{"x"}, {}, {}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19>}} {
  func.func @case6(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=3, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case7 of Table 2: S1RR on (1, 4) -> RRR on (2, 4), 1024x1024x512 f16.
// One source host, two destination hosts that need everything: each quarter is
// broadcast down one chain through both hosts, pipelined in chunks.
// Predicted 0.8892 s, lower bound 0.8590 s.

// CHECK-LABEL: func.func @case7
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 72 : i64, limit = array<i64: 256, 1024, 512>, receivers = array<i64: 4, 5, 6, 7, 8, 9, 10, 11>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 72 : i64, limit = array<i64: 512, 1024, 512>, receivers = array<i64: 4, 5, 6, 7, 8, 9, 10, 11>, sender = 1 : i64, slot = 1 : i64, start = array<i64: 256, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 72 : i64, limit = array<i64: 768, 1024, 512>, receivers = array<i64: 4, 5, 6, 7, 8, 9, 10, 11>, sender = 2 : i64, slot = 2 : i64, start = array<i64: 512, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 72 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 4, 5, 6, 7, 8, 9, 10, 11>, sender = 3 : i64, slot = 3 : i64, start = array<i64: 768, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.8590{{[0-9]*}} : f64, predicted_time = 0.8892{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{"y"}, {}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 4, 5, 6, 7, 8, 9, 10, 11>}} {
  func.func @case7(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=1, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case8 of Table 2: RRR on (2, 3) -> RRR on (3, 2), 1024x1024x512 f16.
// A single unit task (everything replicated): one broadcast chained through the three
// destination hosts (2 devices each), sent from the first device of source host 0.
// Predicted 0.8784 s, lower bound 0.8590 s.

// CHECK-LABEL: func.func @case8
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 182 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 8, 9, 12, 13, 16, 17>, sender = 0 : i64, slot = 0 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.8590{{[0-9]*}} : f64, predicted_time = 0.8783{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 4, 5, 6>, m2 = array<i64: 8, 9, 12, 13, 16, 17>}} {
  func.func @case8(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=3]>>, <"m2" : <["x"=3, "y"=2]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}

// -----

// case9 of Table 2: RS0R on (2, 4) -> RRS0 on (2, 4), 1024x1024x512 f16.
// Like case 3, along the last dimension.
// Predicted 0.4346 s, lower bound 0.4295 s.

// CHECK-LABEL: func.func @case9
// CHECK:         "hlopar.cross_mesh_transfer"(%arg0) ({
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 1024, 256>, receivers = array<i64: 8, 9, 10, 11>, sender = 4 : i64, slot = 0 : i64, start = array<i64: 0, 512, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 512, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 0 : i64, slot = 1 : i64, start = array<i64: 0, 0, 256>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 512, 256>, receivers = array<i64: 8, 9, 10, 11>, sender = 1 : i64, slot = 2 : i64, start = array<i64: 0, 0, 0>}
// CHECK-NEXT:      "hlopar.broadcast"() {chunks = 24 : i64, limit = array<i64: 1024, 1024, 512>, receivers = array<i64: 12, 13, 14, 15>, sender = 5 : i64, slot = 3 : i64, start = array<i64: 0, 512, 256>}
// CHECK-NEXT:    }) {algorithm = "ensemble", lower_bound = 0.4295{{[0-9]*}} : f64, predicted_time = 0.4346{{[0-9]*}} : f64, strategy = "broadcast"}
!src = !mpmd.mesh_tensor<"m1", tensor<1024x1024x512xf16>, sharding=<@mesh, [{}, {"x"}, {}]>>
!dst = !mpmd.mesh_tensor<"m2", tensor<1024x1024x512xf16>, sharding=<@mesh, [{}, {}, {"x"}]>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1, 2, 3, 4, 5, 6, 7>, m2 = array<i64: 8, 9, 10, 11, 12, 13, 14, 15>}} {
  func.func @case9(%arg0: !src) -> !dst
      attributes {topology = #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=2, "y"=4]>>>} {
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }
}
