// Plans an expert would pick, on the zoo's MLP training steps (4 dense layers, Adam), with
// the bandwidths of Alpa's testbed (p3.16xlarge: 8 V100 over NVLink).

// Large batch, small hidden size: data parallelism. Weights replicated, the batch split,
// and the only large collectives are the 4 weight-gradient all-reduces.
// RUN: %python %S/../../../tools/export_model.py mlp large-batch -o %t.batch.mlir
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge report=%t.batch.json})' | FileCheck %s --check-prefix=DP
// RUN: FileCheck %s --check-prefix=DP-REPORT < %t.batch.json
// DP:     sdy.mesh @mesh = <["x"=8]>
// DP:     %arg1: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// DP-SAME: %arg3: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// DP-SAME: %arg5: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// DP-SAME: %arg7: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// DP-SAME: tensor<16384x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// DP-REPORT: "status": "OPTIMAL"
// DP-REPORT-COUNT-4: "all-reduce(4.0 MiB, x)"
// DP-REPORT-NOT: MiB, x)

// Small batch, large hidden size: Megatron-LM. Weights split by column, then by row,
// alternately; an all-reduce (1 MiB of activations) after each row-split matmul, and no
// weight-gradient all-reduce.
// RUN: %python %S/../../../tools/export_model.py mlp large-hidden -o %t.hidden.mlir
// RUN: hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge report=%t.hidden.json})' | FileCheck %s --check-prefix=MEGATRON
// RUN: FileCheck %s --check-prefix=MEGATRON-REPORT < %t.hidden.json
// RUN: grep -c '"all-' %t.hidden.json | FileCheck %s --check-prefix=MEGATRON-COLLECTIVES
// MEGATRON:      %arg1: tensor<4096x16384xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>}
// MEGATRON-SAME: %arg3: tensor<16384x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// MEGATRON-SAME: %arg5: tensor<4096x16384xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>}
// MEGATRON-SAME: %arg7: tensor<16384x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// MEGATRON-REPORT-COUNT-3: "all-reduce(1.0 MiB, x)"
// MEGATRON-COLLECTIVES: {{^}}3{{$}}

// Both large, on a 2x4 mesh: the two combine along the two axes, the batch over "x" and the
// weights (Megatron-style) over "y".
// RUN: %python %S/../../../tools/export_model.py mlp large-both -o %t.both.mlir
// RUN: hlopar-opt %t.both.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 preset=v100-p3.16xlarge})' | FileCheck %s --check-prefix=MIXED
// MIXED:      %arg1: tensor<4096x16384xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"y"}]>}
// MIXED-SAME: %arg3: tensor<16384x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"y"}, {}]>}
// MIXED-SAME: tensor<8192x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}

// Memory pressure: with less memory per device, weights and Adam moments (12 tensors of
// 1024x1024) that data parallelism keeps replicated become sharded, more of them as the
// budget shrinks.
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge})' | grep -o 'tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, \[{}, {}\]>}' | wc -l | FileCheck %s --check-prefix=REPLICATED-NO-LIMIT
// REPLICATED-NO-LIMIT: {{^ *}}12{{$}}
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge memory-budget=110MiB})' | grep -o 'tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, \[{}, {}\]>}' | wc -l | FileCheck %s --check-prefix=REPLICATED-110
// REPLICATED-110: {{^ *}}9{{$}}
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge memory-budget=80MiB})' | grep -o 'tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, \[{}, {}\]>}' | wc -l | FileCheck %s --check-prefix=REPLICATED-80
// REPLICATED-80: {{^ *}}1{{$}}
// RUN: not hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 memory-budget=60MiB})' 2>&1 | FileCheck %s --check-prefix=TOO-SMALL
// TOO-SMALL: error: hlopar-auto-sharding: no sharding plan fits (INFEASIBLE): {{.*}} over the memory budget

// Weight-update sharding, enforced (weight-update-sharding, ZeRO-like): the training state
// (weights and Adam moments) stays split over the data-parallel axis; each weight gradient
// is reduce-scattered instead of all-reduced, and weights are all-gathered where used.
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge weight-update-sharding report=%t.zero.json})' | grep -o -E 'tensor<1024x1024xf32> \{sdy.sharding = #sdy.sharding<@mesh, \[(\{"x"\}, \{\}|\{\}, \{"x"\})\]>\}' | wc -l | FileCheck %s --check-prefix=ZERO-SPLIT
// ZERO-SPLIT: {{^ *}}12{{$}}
// RUN: FileCheck %s --check-prefix=ZERO < %t.zero.json
// ZERO-COUNT-4: "reduce-scatter(4.0 MiB, x)"
// ZERO-NOT: "all-reduce({{.*}} MiB

// prefer-reduce-scatter is the same as a priced preference: the state is split wherever
// that costs less than sending the bytes it saves once. Adam's 8 moments are split and the 4
// gradients reduce-scattered (no all-reduce of MiB), but a weight the backward reads too
// (every layer's but the first, whose input has no gradient) stays whole: split, it would be
// all-gathered twice, in the forward and in the backward, where whole it is all-gathered once
// after its update (ZeRO-2 for those, ZeRO-3 for the first).
// RUN: hlopar-opt %t.batch.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=8 preset=v100-p3.16xlarge prefer-reduce-scatter report=%t.prefer.json})' | FileCheck %s --check-prefix=PREFER
// PREFER: func.func public @main(
// PREFER-SAME: %arg1: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>}
// PREFER-SAME: %arg3: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// PREFER-SAME: %arg5: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// PREFER-SAME: %arg7: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// PREFER-SAME: %arg10: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>}
// PREFER-SAME: %arg24: tensor<1024x1024xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>}
// RUN: FileCheck %s --check-prefix=PREFER-COLL < %t.prefer.json
// PREFER-COLL-COUNT-4: "reduce-scatter(4.0 MiB, x)"
// PREFER-COLL-NOT: "all-reduce({{.*}} MiB
