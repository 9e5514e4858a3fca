// The README's main job: the bundled MLP training step (tools/export_model.py mlp tiny) imports
// into one @main with its 3 forward and 5 backward matmuls and no calls left.
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s
// RUN: hlopar-opt %S/../../../examples/mlp_train_step.mlir --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s --check-prefix=NOCALL
// NOCALL-NOT: call @

// CHECK:     module @jit_step
// CHECK:     func.func public @main(%arg0: tensor<16xf32>
// CHECK-NOT: call @
// CHECK-COUNT-8: stablehlo.dot_general
// CHECK-NOT: stablehlo.dot_general
// CHECK:     return
// CHECK-NOT: func.func
