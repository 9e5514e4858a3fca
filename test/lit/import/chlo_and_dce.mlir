// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s
// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s --check-prefix=NOCHLO

// No chlo op is left anywhere in the output: a CHECK-NOT before any positive check covers the
// whole input (what LLVM's --implicit-check-not does; the `filecheck` port lacks that flag).
// NOCHLO-NOT: chlo.

// chlo ops become stablehlo ops.

// CHECK-LABEL: func.func public @main
// CHECK-NOT:     chlo.
// CHECK:         stablehlo.
// CHECK:         return
func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %0 = chlo.broadcast_add %arg0, %arg1 : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  %1 = chlo.erf %0 : tensor<4xf32> -> tensor<4xf32>
  return %1 : tensor<4xf32>
}

// -----

// Values nobody uses are removed; side-effecting custom calls are kept.

// CHECK-LABEL: func.func public @main
// CHECK-NOT:     stablehlo.multiply
// CHECK:         stablehlo.custom_call @check.expect_close
// CHECK-NEXT:    return %arg0
func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.multiply %arg0, %arg0 : tensor<4xf32>
  stablehlo.custom_call @check.expect_close(%arg0, %arg0) {has_side_effect = true} : (tensor<4xf32>, tensor<4xf32>) -> ()
  return %arg0 : tensor<4xf32>
}
