// Determinism: the same input gives the same output, byte for byte (the zoo's GPT, 2x4 mesh).
// RUN: %python %S/../../../tools/export_model.py gpt tiny -o %t.gpt.mlir
// RUN: hlopar-opt %t.gpt.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 latency=0,0})' -o %t.first.mlir
// RUN: hlopar-opt %t.gpt.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 latency=0,0})' -o %t.second.mlir
// RUN: diff %t.first.mlir %t.second.mlir

// force-batch-dim: on the Megatron-shaped MLP, data parallelism is forced onto "x": the batch
// (leading dim 64 of the inputs and activations) is split over x.
// RUN: %python %S/../../../tools/export_model.py mlp large-hidden -o %t.hidden.mlir
// RUN: hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 preset=v100-p3.16xlarge force-batch-dim=x})' | FileCheck %s --check-prefix=BATCH
// BATCH: %arg25: tensor<64x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// BATCH-SAME: %arg26: tensor<64x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// BATCH: stablehlo.dot_general {{.*}}sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{"x"{{.*}}}, {{.*}}]>]>{{.*}}-> tensor<64x16384xf32>

// data-parallel: the batch split over every axis (x major), every weight replicated.
// RUN: hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 preset=v100-p3.16xlarge data-parallel=true})' | FileCheck %s --check-prefix=DP
// DP: func.func public @main(%arg0: tensor<16384xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}
// DP-SAME: %arg24: tensor<16384x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// DP-SAME: %arg25: tensor<64x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}]>}
// DP-SAME: %arg26: tensor<64x4096xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}]>}

// A size-1 axis splits nothing: said, not silently done.
// RUN: hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=1x8 force-batch-dim=x})' -o /dev/null 2>&1 | FileCheck %s --check-prefix=SIZE1
// SIZE1: warning: hlopar-auto-sharding: force-batch-dim=x: the axis has size 1, so it splits nothing

// Bad options are reported before any work.
// RUN: not hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4 force-batch-dim=q})' 2>&1 | FileCheck %s --check-prefix=NO-AXIS
// NO-AXIS: error: hlopar-auto-sharding: force-batch-dim: no mesh axis 'q'
// RUN: not hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4 preset=tpu})' 2>&1 | FileCheck %s --check-prefix=PRESET
// PRESET: error: hlopar-auto-sharding: {{.*}}preset{{.*}}tpu
// RUN: not hlopar-opt %t.hidden.mlir -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4 memory-budget=lots})' 2>&1 | FileCheck %s --check-prefix=BUDGET
// BUDGET: error: option 'memory-budget' of pass 'hlopar-auto-sharding': invalid value 'lots'
