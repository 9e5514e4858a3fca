// Option values out of their bounds, or malformed, are refused with the options, before any
// work: the limit and the reason, exit status 1, never an internal error (hlopar/analysis/limits.py).

// A cluster or mesh past what the planner handles.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-parallel{num-hosts=4096})' 2>&1 | FileCheck %s --check-prefix=HOSTS
// HOSTS: option_bounds.mlir: error: option 'num-hosts' of pass 'hlopar-auto-parallel': invalid value '4096': 4096 is more than 1,024, the most hlopar takes for a cluster's hosts or devices per host
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{num-hosts=2 devices-per-host=100000000000000000000})' 2>&1 | FileCheck %s --check-prefix=HUGE
// HUGE: error: option 'devices-per-host' of pass 'hlopar-stage-construction': invalid value '100000000000000000000': {{.*}} is more than 1,024
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-parallel{num-hosts=64 devices-per-host=8})' 2>&1 | FileCheck %s --check-prefix=MESHES
// MESHES: option_bounds.mlir: error: pass 'hlopar-auto-parallel': a cluster of 64 x 8 devices has 769 logical meshes {{.*}} more than 400, the most it plans within
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=100000x100000})' 2>&1 | FileCheck %s --check-prefix=MESH
// MESH: error: option 'mesh-shape' of pass 'hlopar-auto-sharding': invalid value '100000x100000': a mesh of 100000x100000 = 10,000,000,000 devices is more than 1,024

// Malformed shapes and limits that are not limits.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x})' 2>&1 | FileCheck %s --check-prefix=SHAPE
// SHAPE: error: option 'mesh-shape' of pass 'hlopar-auto-sharding': invalid value '2x': expected integers joined by x or commas, such as 2x4
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=0x4})' 2>&1 | FileCheck %s --check-prefix=ZERO
// ZERO: error: option 'mesh-shape' of pass 'hlopar-auto-sharding': invalid value '0x4': mesh sizes are positive integers, got 0x4
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{time-limit=-5})' 2>&1 | FileCheck %s --check-prefix=TIME
// TIME: error: option 'time-limit' of pass 'hlopar-auto-sharding': invalid value '-5': expected a number > 0, got -5
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{time-limit=nan})' 2>&1 | FileCheck %s --check-prefix=NAN
// NAN: error: option 'time-limit' of pass 'hlopar-stage-construction': invalid value 'nan': expected a finite number, got nan
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{workers=100000})' 2>&1 | FileCheck %s --check-prefix=WORKERS
// WORKERS: error: option 'workers' of pass 'hlopar-stage-construction': invalid value '100000': 100000 is more than 256
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-cross-mesh-resharding{seed=-1})' 2>&1 | FileCheck %s --check-prefix=SEED
// SEED: error: option 'seed' of pass 'hlopar-cross-mesh-resharding': invalid value '-1': expected an integer >= 0, got -1

// A report that cannot be written is refused with the options too, not after the work.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-cluster-operators{report=%t.missing/r.json})' 2>&1 | FileCheck %s --check-prefix=REPORT
// REPORT: error: option 'report' of pass 'hlopar-cluster-operators': invalid value '{{.*}}r.json': cannot write output: the directory '{{.*}}.missing' does not exist

// HOSTS-NOT: internal error
// MESH-NOT: internal error

func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  return %x : tensor<4x8xf32>
}
