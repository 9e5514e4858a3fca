// A preset file (`hlopar-calibrate`'s format) is a preset everywhere one is named: the same
// program on 2 hosts x 4 devices plans differently when the file says links across hosts are
// slow. Inputs/slow_links.json and Inputs/fast_links.json are the cpu preset with those links
// 250x slower than inside a host, and as fast.

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 preset=%S/Inputs/slow_links.json})' 2>&1 | FileCheck %s --check-prefix=SLOW
// No mesh spans the hosts: one per host, the activations sent once per microbatch at 5 ms.
// SLOW: hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}
// SLOW: "hlopar.cross_mesh_transfer"
// SLOW: lower_bound = 5.0{{[0-9]+}}e-03

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 preset=%S/Inputs/fast_links.json})' 2>&1 | FileCheck %s --check-prefix=FAST
// FAST-NOT: hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}
// FAST: lower_bound = 1.0{{[0-9]+}}e-05

// idle-hosts=true: the stages are also planned on fewer hosts. With slow links, host 0's 4
// devices alone (3 stages, 13 us a step) beat both hosts (5.6 ms: each microbatch's
// activations cross the slow link twice); host 1 stays idle. With fast links every device is
// used, the same plan as without the option.
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 idle-hosts=true preset=%S/Inputs/slow_links.json report=%t.slow.json})' 2>&1 | FileCheck %s --check-prefix=IDLE
// IDLE: hlopar.devices = {m0 = array<i64: 2>, m1 = array<i64: 0, 1>, m2 = array<i64: 3>}
// RUN: FileCheck %s --check-prefix=IDLE-REPORT < %t.slow.json
// IDLE-REPORT: "num_hosts": 2,
// IDLE-REPORT-NEXT: "hosts_used": 1,
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 idle-hosts=true preset=%S/Inputs/fast_links.json})' 2>&1 | FileCheck %s --check-prefix=FAST-IDLE
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 preset=%S/Inputs/fast_links.json})' 2>&1 | FileCheck %s --check-prefix=FAST-IDLE
// FAST-IDLE: hlopar.devices = {m0 = array<i64: 4, 5>, m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 6, 7>}

// A file that is not there, or not a preset file: the pass says which and why.
// RUN: not hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 preset=%S/Inputs/missing.json})' 2>&1 | FileCheck %s --check-prefix=MISSING
// MISSING: mlp_train_step.mlir: error: hlopar-stage-construction: cluster preset file {{.*}}Inputs/missing.json: No such file or directory
// MISSING-NOT: Traceback
// RUN: not hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 preset=%S/Inputs/gpt_blocks.py})' 2>&1 | FileCheck %s --check-prefix=NOT-A-PRESET
// NOT-A-PRESET: error: hlopar-stage-construction: cluster preset file {{.*}}Inputs/gpt_blocks.py: not a readable JSON file
