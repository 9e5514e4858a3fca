// Bad options and inputs: a located error, exit status 1, no traceback.

// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-stage-construction{num-hosts=0 devices-per-host=4})' 2>&1 | FileCheck %s --check-prefix=HOSTS
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=0})' 2>&1 | FileCheck %s --check-prefix=DEVICES
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-auto-parallel{num-hosts=1 devices-per-host=2})' 2>&1 | FileCheck %s --check-prefixes=ENTRY-UNSTACK,SIGNATURE
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-stage-construction{schedule=1f1b num-hosts=1 devices-per-host=4 memory-per-device=1B})' 2>&1 | FileCheck %s --check-prefixes=MEMORY,ENTRY
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-cluster-operators)' 2>&1 | FileCheck %s --check-prefix=ENTRY-CLUSTER

// Options that are not values of their type, or name nothing, are reported before any work.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{schedule=zigzag})' 2>&1 | FileCheck %s --check-prefix=SCHEDULE
// SCHEDULE: errors.mlir: error: option 'schedule' of pass 'hlopar-stage-construction': invalid value 'zigzag': expected one of 1f1b, auto, eager-1f1b, eager-1f1b-wd, gpipe, interleaved-1f1b, zb-h1, zb-h2, zb-v
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{memory-per-device=lots})' 2>&1 | FileCheck %s --check-prefix=BYTES
// BYTES: errors.mlir: error: option 'memory-per-device' of pass 'hlopar-stage-construction': invalid value 'lots'
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-stage-construction{preset=tpu})' 2>&1 | FileCheck %s --check-prefix=PRESET
// PRESET: errors.mlir: error: hlopar-stage-construction: unknown cluster preset 'tpu'; known presets: cpu, {{.*}}v100-p3.16xlarge
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-cluster-operators{layers=several})' 2>&1 | FileCheck %s --check-prefix=LAYERS
// LAYERS: errors.mlir: error: option 'layers' of pass 'hlopar-cluster-operators': invalid value 'several'
// RUN: not hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-auto-parallel{split=true})' 2>&1 | FileCheck %s --check-prefix=SPLIT
// SPLIT: error: hlopar-auto-parallel: split=true needs a number of microbatches (microbatches=B), not auto

// The number of microbatches has one channel: after the split, the program's hlopar.microbatches.
// RUN: not hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-import,hlopar-split-microbatches{microbatches=2},hlopar-cluster-operators,hlopar-stage-construction{num-hosts=1 devices-per-host=2 microbatches=2})' 2>&1 | FileCheck %s --check-prefix=CHANNEL
// CHANNEL: mlp_train_step.mlir:{{[0-9]+}}:{{[0-9]+}}: error: hlopar-stage-construction: the program is already one of 2 microbatches (hlopar-split-microbatches): that count is its hlopar.microbatches; leave microbatches unset (got microbatches=2)
// CHANNEL-NOT: Traceback

// A cluster of no devices: refused with the options, before the input is read.
// HOSTS: errors.mlir: error: option 'num-hosts' of pass 'hlopar-stage-construction': invalid value '0': expected a positive integer, got 0
// DEVICES: errors.mlir: error: option 'devices-per-host' of pass 'hlopar-auto-parallel': invalid value '0': expected a positive integer, got 0

// HOSTS-NOT: Traceback
// MEMORY-NOT: Traceback
// ENTRY-NOT: Traceback

// No stage fits in one byte of memory, on any submesh, for any number of microbatches.
// MEMORY: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-stage-construction: no pipeline fits the cluster: B={{[0-9,]+}}: {{.*}}out of memory
func.func @main(%x: tensor<4x8xf32>, %w: tensor<8x8xf32>) -> tensor<4x8xf32> {
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// Two public functions and no @main: which one is the step?
// ENTRY: errors.mlir:[[# @LINE + 3]]:{{[0-9]+}}: error: hlopar-stage-construction: expects one entry function (@main), found 2
// ENTRY-CLUSTER: errors.mlir:[[# @LINE + 2]]:{{[0-9]+}}: error: hlopar-cluster-operators: expects one entry function (@main), found 2
// ENTRY-UNSTACK: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-unstack-layer-scans: expects one entry function (@main), found 2

func.func @f(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  return %x : tensor<4x8xf32>
}
func.func @g(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %y = stablehlo.tanh %x : tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// A public function that is not @main: the MPMD program stage construction writes is @main's.
// SIGNATURE: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-stage-construction: the module has no @main (its one public function is @step)
func.func @step(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %y = stablehlo.tanh %x : tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// A scalar that is not a tensor in @main's signature (jax.jit lowers Python scalars as tensor<i32>).
// SIGNATURE: errors.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: hlopar-stage-construction: argument 1 of @main has type i32, not a ranked tensor
func.func @main(%x: tensor<4x8xf32>, %n: i32) -> tensor<4x8xf32> {
  %y = stablehlo.tanh %x : tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}
