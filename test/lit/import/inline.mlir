// RUN: hlopar-opt %s --split-input-file --pass-pipeline='builtin.module(hlopar-import)' | FileCheck %s

// Private functions are inlined into @main and then removed.

// CHECK-LABEL: func.func public @main
// CHECK-NEXT:    %[[X:.*]] = stablehlo.multiply %arg0, %arg0
// CHECK-NEXT:    %[[Y:.*]] = stablehlo.add %[[X]], %arg0
// CHECK-NEXT:    return %[[Y]]
// CHECK-NOT:   func.func private @square
func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = call @square(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
  %1 = stablehlo.add %0, %arg0 : tensor<4xf32>
  return %1 : tensor<4xf32>
}
func.func private @square(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.multiply %arg0, %arg0 : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Calls inside a while body are inlined too, and nested calls all the way down.

// CHECK-LABEL: func.func public @main
// CHECK-NOT:     call
// CHECK:         stablehlo.while
// CHECK-NOT:       call
// CHECK:           stablehlo.negate
// CHECK-NOT:       call
// CHECK-NOT:   func.func private
func.func public @main(%arg0: tensor<i32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %0:2 = stablehlo.while(%iterArg = %arg0, %iterArg_0 = %arg1) : tensor<i32>, tensor<4xf32>
  cond {
    %c = stablehlo.constant dense<10> : tensor<i32>
    %1 = stablehlo.compare LT, %iterArg, %c : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %1 : tensor<i1>
  } do {
    %c = stablehlo.constant dense<1> : tensor<i32>
    %1 = stablehlo.add %iterArg, %c : tensor<i32>
    %2 = func.call @outer(%iterArg_0) : (tensor<4xf32>) -> tensor<4xf32>
    stablehlo.return %1, %2 : tensor<i32>, tensor<4xf32>
  }
  return %0#1 : tensor<4xf32>
}
func.func private @outer(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = call @inner(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
func.func private @inner(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.negate %arg0 : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Recursive functions cannot be inlined: the calls and the functions stay, valid.

// CHECK-LABEL: func.func public @main
// CHECK:         call @ping
// CHECK:       func.func private @ping
// CHECK:         call @pong
// CHECK:       func.func private @pong
// CHECK:         call @ping
func.func public @main(%arg0: tensor<f32>) -> tensor<f32> {
  %0 = call @ping(%arg0) : (tensor<f32>) -> tensor<f32>
  return %0 : tensor<f32>
}
func.func private @ping(%arg0: tensor<f32>) -> tensor<f32> {
  %0 = call @pong(%arg0) : (tensor<f32>) -> tensor<f32>
  return %0 : tensor<f32>
}
func.func private @pong(%arg0: tensor<f32>) -> tensor<f32> {
  %0 = call @ping(%arg0) : (tensor<f32>) -> tensor<f32>
  return %0 : tensor<f32>
}

// -----

// Shardings on a callee's arguments and results are constraints: they survive inlining.

// CHECK:       sdy.mesh @mesh = <["x"=2]>
// CHECK-LABEL: func.func public @main
// CHECK-NEXT:    %[[A:.*]] = sdy.sharding_constraint %arg0 <@mesh, [{"x"}]>
// CHECK-NEXT:    %[[N:.*]] = stablehlo.negate %[[A]]
// CHECK-NEXT:    %[[R:.*]] = sdy.sharding_constraint %[[N]] <@mesh, [{}]>
// CHECK-NEXT:    return %[[R]]
sdy.mesh @mesh = <["x"=2]>
func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = call @f(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
func.func private @f(%arg0: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>})
    -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
  %0 = stablehlo.negate %arg0 : tensor<4xf32>
  return %0 : tensor<4xf32>
}
