// schedule=auto: the pass chooses the schedule with the stages, by simulated step time, and
// its report says what it chose and the runner-up with its predicted time. The GPT of 4
// blocks on 2 hosts x 4 devices, 4 microbatches: the two stages of gpt_stages.mlir, under a
// zero-bubble schedule (W fills the pipeline's bubble; the cpu preset's transfers are small
// beside the compute), ZB-H2 ahead of ZB-H1 (its longer warm-up keeps the last stage busy).
// RUN: %python %S/Inputs/gpt_blocks.py 4 -o %t.gpt4.mlir
// RUN: hlopar-opt %t.gpt4.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators,hlopar-stage-construction{schedule=auto microbatches=4 num-hosts=2 devices-per-host=4 report=%t.json})' -o %t.program.mlir
// RUN: FileCheck %s --input-file %t.json
// RUN: FileCheck %s --check-prefix=PROGRAM --input-file %t.program.mlir
// RUN: %python -c "import json, sys; c = json.load(open(sys.argv[1]))['schedule_choice']; assert c['chosen']['simulated_step_seconds'] < c['runner_up']['simulated_step_seconds'], c" %t.json

// CHECK:      "options": {{.*}}schedule=auto
// CHECK:      "schedule": "zb-h2",
// CHECK-NEXT: "schedule_choice": {
// CHECK-NEXT:   "chosen": {
// CHECK-NEXT:    "schedule": "zb-h2",
// CHECK-NEXT:    "microbatches": 4,
// CHECK-NEXT:    "simulated_step_seconds": {{[0-9.e-]+}},
// CHECK:         "stages": 2
// CHECK:        "runner_up": {
// CHECK-NEXT:    "schedule": "zb-h1",
// CHECK-NEXT:    "microbatches": 4,
// CHECK-NEXT:    "simulated_step_seconds": {{[0-9.e-]+}},
// Every registered schedule was a candidate, best first.
// CHECK:        "candidates": [
// CHECK-NEXT:    {
// CHECK-NEXT:     "schedule": "zb-h2",
// CHECK-DAG:      "schedule": "gpipe",
// CHECK-DAG:      "schedule": "1f1b",
// CHECK-DAG:      "schedule": "eager-1f1b",
// CHECK-DAG:      "schedule": "eager-1f1b-wd",
// CHECK:        "predicted_step_seconds":
// CHECK:        "simulation":

// The program is the plan's: two stages, one host each.
// PROGRAM: module @jit_step attributes {hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}
