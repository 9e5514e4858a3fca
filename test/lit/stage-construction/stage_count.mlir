// The number of stages as an option of the whole planner (hlopar-auto-parallel's `stages`,
// hlopar-compile's --stages, parallelize's stages=): exactly that many meshes, where the
// planner alone cuts this step in three.

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4})' 2>&1 | FileCheck %s --check-prefix=CHOSEN
// CHOSEN: hlopar.devices = {m0 = array<i64: 4, 5>, m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 6, 7>}

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 stages=2})' 2>&1 | FileCheck %s --check-prefix=TWO
// TWO: hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}
// TWO-COUNT-2: mpmd.fragment<mesh="m{{[01]}}", origin=["stage{{[01]}}"]
// TWO-NOT: "m2"

// RUN: rm -rf %t && mkdir -p %t
// RUN: hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --stages 2 -o %t/bundle | FileCheck %s --check-prefix=COMPILE
// COMPILE: hlopar-compile: 2 stages on 2 meshes

// RUN: not hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --method shard --stages 2 -o %t/shard 2>&1 | FileCheck %s --check-prefix=SHARD
// SHARD: error: {{.*}}stages=2 needs method 'auto' or 'pipeline': method 'shard' plans one stage
