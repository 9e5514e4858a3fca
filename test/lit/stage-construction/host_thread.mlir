// A preset whose host thread launches every fragment run (`dispatch_s`, what
// `hlopar-calibrate` measures for the in-process runtime): the simulated step is at least
// that thread's work. Inputs/slow_host_thread.json is fast_links.json with 1 ms a launch.
// The MLP on one mesh of 8 devices, 4 microbatches: 4 forwards, 4 backwards and the update,
// 9 launches, 9 ms; the devices' own 21.1 us added (they compute on the thread's cores).
// Alpa's Eq. 2 latency is the devices' alone either way.

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 schedule=auto microbatches=4 preset=%S/Inputs/fast_links.json report=%t.fast.json})' > /dev/null
// RUN: FileCheck %s --check-prefix=FAST < %t.fast.json
// FAST: "predicted_step_seconds": 2.11002{{[0-9]+}}e-05,
// FAST-NEXT: "simulated_step_seconds": 2.11002{{[0-9]+}}e-05,

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 schedule=auto microbatches=4 preset=%S/Inputs/slow_host_thread.json report=%t.slow.json})' > /dev/null
// RUN: FileCheck %s --check-prefix=SLOW < %t.slow.json
// SLOW: "predicted_step_seconds": 2.11002{{[0-9]+}}e-05,
// SLOW-NEXT: "simulated_step_seconds": 0.0090211{{[0-9]+}},

// The same with the schedule given (ranked by Eq. 2): the plan it picks is simulated too.
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 stages=1 microbatches=4 preset=%S/Inputs/slow_host_thread.json report=%t.given.json})' > /dev/null
// RUN: FileCheck %s --check-prefix=SLOW < %t.given.json
