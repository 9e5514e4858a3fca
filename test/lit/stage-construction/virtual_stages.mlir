// Several stages per mesh (virtual stages): with a schedule of chunks (interleaved-1f1b, zb-v)
// the pass cuts the layers into v p stages on p meshes of one submesh shape and places stage k
// on the schedule's mesh for it. The MLP in 4 layers on 1 host x 4 devices: p = 2 meshes of 2
// devices, v = 2 (4 layers hold no more chunks); stage k on m(k mod 2) interleaved, on
// m0, m1, m1, m0 as ZB-V's V. One topology entry and one sdy.mesh per mesh; each stage keeps
// its fragments (stage=k).

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators{layers=4},hlopar-stage-construction{schedule=interleaved-1f1b num-hosts=1 devices-per-host=4 microbatches=4 report=%t.interleaved.json})' | FileCheck %s --check-prefix=LOOP
// LOOP:      module @jit_step attributes {hlopar.devices = {m0 = array<i64: 0, 1>, m1 = array<i64: 2, 3>}
// LOOP-NEXT:   sdy.mesh @m0 = <["x"=1, "y"=2]>
// LOOP-NEXT:   sdy.mesh @m1 = <["x"=1, "y"=2]>
// LOOP-NOT:    sdy.mesh
// LOOP:        mpmd.topology<<"m0" : <["x"=1, "y"=2]>>, <"m1" : <["x"=1, "y"=2]>>>
// LOOP:        mpmd.fragment<mesh="m0", origin=["stage0"], stage=0>
// LOOP:        mpmd.fragment<mesh="m1", origin=["stage1"], stage=1>
// LOOP:        mpmd.fragment<mesh="m0", origin=["stage2"], stage=2>
// LOOP:        mpmd.fragment<mesh="m1", origin=["stage3"], stage=3>
// LOOP:        mpmd.fragment<mesh="m1", origin=["stage3"(1)], stage=3>
// LOOP:        mpmd.fragment<mesh="m0", origin=["stage2"(1)], stage=2>
// LOOP:        mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1>
// LOOP:        mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0>
// LOOP-NOT:    "m2"

// The report: the schedule, and per stage its layers and mesh.
// RUN: FileCheck %s --check-prefix=REPORT --input-file %t.interleaved.json
// REPORT:      "schedule": "interleaved-1f1b",
// REPORT:      "stages": [
// REPORT:        "stage": 0,
// REPORT-NEXT:   "mesh": "m0",
// REPORT-NEXT:   "layers": [
// REPORT-NEXT:    0,
// REPORT-NEXT:    0
// REPORT:        "devices": [
// REPORT-NEXT:    0,
// REPORT-NEXT:    1
// REPORT:        "stage": 1,
// REPORT-NEXT:   "mesh": "m1",
// REPORT:        "stage": 2,
// REPORT-NEXT:   "mesh": "m0",
// REPORT-NEXT:   "layers": [
// REPORT-NEXT:    2,
// REPORT-NEXT:    2
// REPORT:        "devices": [
// REPORT-NEXT:    0,
// REPORT-NEXT:    1
// REPORT:        "stage": 3,
// REPORT-NEXT:   "mesh": "m1",

// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators{layers=4},hlopar-stage-construction{schedule=zb-v num-hosts=1 devices-per-host=4 microbatches=4})' | FileCheck %s --check-prefix=V
// V:      hlopar.devices = {m0 = array<i64: 0, 1>, m1 = array<i64: 2, 3>}
// V:      mpmd.fragment<mesh="m0", origin=["stage0"], stage=0>
// V:      mpmd.fragment<mesh="m1", origin=["stage1"], stage=1>
// V:      mpmd.fragment<mesh="m1", origin=["stage2"], stage=2>
// V:      mpmd.fragment<mesh="m0", origin=["stage3"], stage=3>
// V:      mpmd.fragment<mesh="m0", origin=["stage3"(1)], stage=3>
// V:      mpmd.fragment<mesh="m1", origin=["stage2"(1)], stage=2>
// V:      mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1>
// V:      mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0>

// hlopar-compile takes the schedule and builds, simulates and checks the program.
// RUN: rm -rf %t && mkdir -p %t
// RUN: hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 1 --devices-per-host 4 --microbatches 4 --layers 4 --schedule interleaved-1f1b -o %t/bundle | FileCheck %s --check-prefix=COMPILE
// COMPILE:      hlopar-compile: 4 stages on 2 meshes, 4 microbatches, schedule interleaved-1f1b
// COMPILE-NEXT:   stage 0: mesh m0, 1x2 devices 0-1,
// COMPILE-NEXT:   stage 1: mesh m1, 1x2 devices 2-3,
// COMPILE-NEXT:   stage 2: mesh m0, 1x2 devices 0-1,
// COMPILE-NEXT:   stage 3: mesh m1, 1x2 devices 2-3,

// schedule=auto weighs them with the others. The GPT of 8 blocks (23 layers) on 1 host x 4
// devices, 8 microbatches: ZB-V in 8 stages on 4 one-device meshes, stage k and 7 - k on mesh
// k, just ahead of ZB-H2's 4 stages (5.14 against 5.16 ms simulated); interleaved-1f1b's 8
// stages (5.60 ms) beat eager-1f1b's and 1f1b's 4 (6.28 ms).
// RUN: %python %S/Inputs/gpt_blocks.py 8 -o %t.gpt8.mlir
// RUN: hlopar-opt %t.gpt8.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators,hlopar-stage-construction{schedule=auto microbatches=8 num-hosts=1 devices-per-host=4 report=%t.auto.json})' | FileCheck %s --check-prefix=AUTO
// RUN: FileCheck %s --check-prefix=CHOICE --input-file %t.auto.json
// RUN: %python -c "import json, sys; c = {x['schedule']: x['simulated_step_seconds'] for x in json.load(open(sys.argv[1]))['schedule_choice']['candidates']}; assert c['interleaved-1f1b'] < min(c['eager-1f1b'], c['1f1b']), c" %t.auto.json
// AUTO:      hlopar.devices = {m0 = array<i64: 0>, m1 = array<i64: 1>, m2 = array<i64: 2>, m3 = array<i64: 3>}
// AUTO:      mpmd.fragment<mesh="m0", origin=["stage0"], stage=0>
// AUTO:      mpmd.fragment<mesh="m1", origin=["stage1"], stage=1>
// AUTO:      mpmd.fragment<mesh="m2", origin=["stage2"], stage=2>
// AUTO:      mpmd.fragment<mesh="m3", origin=["stage3"], stage=3>
// AUTO:      mpmd.fragment<mesh="m3", origin=["stage4"], stage=4>
// AUTO:      mpmd.fragment<mesh="m2", origin=["stage5"], stage=5>
// AUTO:      mpmd.fragment<mesh="m1", origin=["stage6"], stage=6>
// AUTO:      mpmd.fragment<mesh="m0", origin=["stage7"], stage=7>
// AUTO-NOT:  "m4"
// CHOICE:      "schedule": "zb-v",
// CHOICE-NEXT: "schedule_choice": {
// CHOICE-NEXT:   "chosen": {
// CHOICE-NEXT:    "schedule": "zb-v",
// CHOICE-NEXT:    "microbatches": 8,
// CHOICE:         "stages": 8,
// CHOICE-NEXT:    "chunks": 2
// CHOICE:        "runner_up": {
// CHOICE-NEXT:    "schedule": "zb-h2",
