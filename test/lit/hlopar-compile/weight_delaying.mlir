// hlopar-compile --schedule eager-1f1b-wd: each backward is cut into B (input gradients, sent
// at once) and W (weight gradients, summed in donated accumulators), W running after B's send
// is issued; what B hands to W is the buffer carry.m, freed after W. The first stage sends no
// gradient back: its B runs nothing and its whole backward is W.

// RUN: rm -rf %t && mkdir %t
// RUN: hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --schedule eager-1f1b-wd -o %t/bundle
// RUN: FileCheck %s --check-prefix=LAST < %t/bundle/meshes/m1/stream.txt
// RUN: FileCheck %s --check-prefix=FIRST < %t/bundle/meshes/m0/stream.txt
// RUN: FileCheck %s --check-prefix=W < %t/bundle/meshes/m1/stage1_weight.mlir
// RUN: FileCheck %s --check-prefix=B < %t/bundle/meshes/m1/stage1_backward.mlir
// RUN: FileCheck %s --check-prefix=PIPELINE < %t/bundle/pipeline.json

// LAST: # schedule eager-1f1b-wd, 2 microbatches
// LAST: [[B0:m1:[0-9]+]]  RUN B mb=0 [stage1_backward]
// LAST-NEXT: m1:{{[0-9]+}}  SEND grad mb=0 -> m0 ({{[0-9]+}} B) [t{{[0-9]+}}]  after [[B0]]
// LAST: [[W0:m1:[0-9]+]]  RUN W mb=0 [stage1_weight]  after [[B0]]
// LAST-NEXT: ACCUMULATE mb=0  after [[W0]]
// LAST: FREE carry.0 ({{[1-9][0-9]*}} B)  after [[W0]]
// LAST: RUN B mb=1 [stage1_backward]
// LAST: RUN W mb=1 [stage1_weight]
// LAST: FREE carry.1
// LAST: UPDATE

// FIRST: [[B0:m0:[0-9]+]]  RUN B mb=0  after m0:0, m0:{{[0-9]+}}{{$}}
// FIRST-NEXT: [[W0:m0:[0-9]+]]  RUN W mb=0 [stage0_weight]  after [[B0]]
// FIRST-NEXT: ACCUMULATE mb=0  after [[W0]]

// W takes its accumulators (donated), its operands, then what B hands over; it returns the sums.
// W: func.func @main(%arg0: {{.*}}tf.aliasing_output = 0 : i32}
// W-SAME: -> (
// W: stablehlo.dot_general
// W: stablehlo.add %arg0

// B returns the input gradient and what it hands to W, and sums nothing.
// B: func.func @main(
// B-NOT: tf.aliasing_output
// B: stablehlo.dot_general
// B-NOT: tf.aliasing_output
// B: return

// PIPELINE: "split_backward": true
// PIPELINE: "weight_flops"
// PIPELINE: "carry_bytes"
// PIPELINE: "name": "stage1_backward"
// PIPELINE-NEXT: "mesh": "m1"
// PIPELINE-NEXT: "stage": 1
// PIPELINE-NEXT: "role": "backward"
// PIPELINE: "name": "stage1_weight"
// PIPELINE-NEXT: "mesh": "m1"
// PIPELINE-NEXT: "stage": 1
// PIPELINE-NEXT: "role": "weight"
