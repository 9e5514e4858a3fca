// GPT on a homogeneous cluster gets equal stages (Alpa §8.1, Fig. 9): a GPT of 4 identical
// transformer blocks on 2 hosts x 4 devices (cpu preset) becomes 2 stages of 2 blocks on
// submeshes of 1x4 devices, one per host, each stage's forward and backward on its mesh and
// each parameter updated where it lives.
// RUN: %python %S/Inputs/gpt_blocks.py 4 -o %t.gpt4.mlir
// RUN: hlopar-opt %t.gpt4.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4})' -o %t.program.mlir
// RUN: FileCheck %s --input-file %t.program.mlir
// RUN: grep -c 'mpmd.fragment<' %t.program.mlir | FileCheck %s --check-prefix=COUNT

// One mesh per stage, one host each.
// CHECK: module @jit_step attributes {hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}
// CHECK-NEXT: sdy.mesh @m0 = <["x"=1, "y"=4]>
// CHECK-NEXT: sdy.mesh @m1 = <["x"=1, "y"=4]>

// Arguments live where they are first read: the embedding (arguments 0, 1) on the first
// stage, the final layer norm (2, 3) on the last, then the 12 arrays of each block: blocks 0
// and 1 (arguments 4 to 27) on m0, blocks 2 and 3 (28 to 51) on m1.
// CHECK-LABEL: func.func public @main
// CHECK-SAME: %arg0: !mpmd.mesh_tensor<"m0", {{[^%]*}}%arg1: !mpmd.mesh_tensor<"m0", {{[^%]*}}%arg2: !mpmd.mesh_tensor<"m1", {{[^%]*}}%arg3: !mpmd.mesh_tensor<"m1", {{[^%]*}}
// CHECK-SAME: {{((%arg[0-9]+: !mpmd.mesh_tensor<"m0"[^%]*){24})}}{{((%arg[0-9]+: !mpmd.mesh_tensor<"m1"[^%]*){24})}}%arg52:
// CHECK-SAME: attributes {topology = #mpmd.topology<<"m0" : <["x"=1, "y"=4]>>, <"m1" : <["x"=1, "y"=4]>>>}

// Forward of stage 0, the activations to stage 1, its forward and backward, the cotangent
// back to stage 0, its backward; then the updates on each mesh. Nothing else runs.
// COUNT: {{^}}6{{$}}
// CHECK-NEXT: mpmd.fragment<mesh="m0", origin=["stage0"], stage=0>
// CHECK: mpmd.transfer {{.*}} -> !mpmd.mesh_tensor<"m1", tensor<8x16x64xf32>
// CHECK: mpmd.fragment<mesh="m1", origin=["stage1"], stage=1>
// CHECK: mpmd.fragment<mesh="m1", origin=["stage1"(1)], stage=1>
// CHECK: mpmd.transfer {{.*}} -> !mpmd.mesh_tensor<"m0", tensor<8x16x64xf32>
// CHECK: mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0>
// CHECK: mpmd.fragment<mesh="m0", origin=["stage0_update"]>
// CHECK: mpmd.fragment<mesh="m1", origin=["stage1_update"]>
// CHECK: return
