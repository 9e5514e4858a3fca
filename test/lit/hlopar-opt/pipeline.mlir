// hlopar passes and upstream passes mix in one pipeline; IR printing and timing per step.

// RUN: hlopar-opt %s --pass-pipeline='builtin.module(hlopar-import{canonicalize=false},canonicalize,func.func(cse))' | FileCheck %s
// CHECK-LABEL: func.func @main
// CHECK-NEXT:    %[[A:.*]] = stablehlo.add %arg0, %arg0
// CHECK-NEXT:    %[[M:.*]] = stablehlo.multiply %[[A]], %[[A]]
// CHECK-NEXT:    return %[[M]]

// RUN: hlopar-opt %s --pass-pipeline='builtin.module(hlopar-import,cse)' --mlir-print-ir-after-all --mlir-timing -o /dev/null 2>&1 | FileCheck %s --check-prefix=INSTR
// INSTR: // -----// IR Dump After hlopar-import //----- //
// INSTR: func.func @main
// INSTR: // -----// IR Dump After cse //----- //
// INSTR: Execution time report
// INSTR: Parser
// INSTR: hlopar-import
// INSTR: cse
// INSTR: Output
// INSTR: Total

// RUN: hlopar-opt --help | FileCheck %s --check-prefix=HELP
// HELP: hlopar passes
// HELP: hlopar-import
// HELP: inline=<bool>

// Bytecode out, bytecode in.
// RUN: hlopar-opt %s --emit-bytecode -o %t.mlirbc
// RUN: hlopar-opt %t.mlirbc | FileCheck %s --check-prefix=BYTECODE
// BYTECODE: func.func @main

func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32>
  %1 = stablehlo.add %arg0, %arg0 : tensor<4xf32>
  %2 = stablehlo.multiply %0, %1 : tensor<4xf32>
  return %2 : tensor<4xf32>
}
