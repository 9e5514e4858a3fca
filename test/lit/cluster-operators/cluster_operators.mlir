// RUN: hlopar-opt %s --split-input-file -p 'builtin.module(hlopar-cluster-operators{layers=2})' | FileCheck %s

// hlopar-cluster-operators writes `hlopar.layer` and `hlopar.role` on every top-level op
// (docs/ir.md). A hand-written training step of two linear layers, squared-error loss and
// SGD: forward ops are the ancestors of the loss, cut into 2 layers of equal FLOPs (one
// matmul each); each backward op follows the layer whose transpose it is (dW1 and dH read
// layer 1's input or weight and the loss's cotangent; dW0 reads layer 0's input); each
// update op follows the layer of the parameter it updates.

// CHECK-LABEL: func.func @two_linear_layers
func.func @two_linear_layers(%w0: tensor<8x8xf32>, %w1: tensor<8x8xf32>, %x: tensor<4x8xf32>)
    -> (tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>) {
  // The loss's zero is forward; its layer does not matter (constants are copied where read).
  // CHECK-NEXT: stablehlo.constant {hlopar.layer = {{[01]}} : i64, hlopar.role = "forward"} dense<0.000000e+00>
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK-NEXT: %[[H:.*]] = stablehlo.dot_general %arg2, %arg0, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "forward"}
  %h = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  // CHECK-NEXT: %[[Y:.*]] = stablehlo.dot_general %[[H]], %arg1, {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %y = stablehlo.dot_general %h, %w1, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  // CHECK-NEXT: stablehlo.multiply %[[Y]], %[[Y]] {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %sq = stablehlo.multiply %y, %y : tensor<4x8xf32>
  // CHECK-NEXT: %[[LOSS:.*]] = stablehlo.reduce{{.*}} {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %loss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  // CHECK-NEXT: stablehlo.constant {hlopar.layer = 1 : i64, hlopar.role = "backward"} dense<2.000000e+00>
  %two = stablehlo.constant dense<2.0> : tensor<4x8xf32>
  // CHECK-NEXT: %[[DY:.*]] = stablehlo.multiply {{.*}}, %[[Y]] {hlopar.layer = 1 : i64, hlopar.role = "backward"}
  %dy = stablehlo.multiply %two, %y : tensor<4x8xf32>
  // CHECK-NEXT: %[[DW1:.*]] = stablehlo.dot_general %[[H]], %[[DY]], {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "backward"}
  %dw1 = stablehlo.dot_general %h, %dy, contracting_dims = [0] x [0] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  // CHECK-NEXT: %[[DH:.*]] = stablehlo.dot_general %[[DY]], %arg1, {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "backward"}
  %dh = stablehlo.dot_general %dy, %w1, contracting_dims = [1] x [1] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  // CHECK-NEXT: %[[DW0:.*]] = stablehlo.dot_general %arg2, %[[DH]], {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "backward"}
  %dw0 = stablehlo.dot_general %x, %dh, contracting_dims = [0] x [0] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  // CHECK-NEXT: %[[LR:.*]] = stablehlo.constant {hlopar.layer = 0 : i64, hlopar.role = "update"} dense<1.000000e-01>
  %lr = stablehlo.constant dense<0.1> : tensor<8x8xf32>
  // CHECK-NEXT: stablehlo.multiply %[[LR]], %[[DW0]] {hlopar.layer = 0 : i64, hlopar.role = "update"}
  %s0 = stablehlo.multiply %lr, %dw0 : tensor<8x8xf32>
  // CHECK-NEXT: %[[NW0:.*]] = stablehlo.subtract %arg0, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "update"}
  %nw0 = stablehlo.subtract %w0, %s0 : tensor<8x8xf32>
  // CHECK-NEXT: stablehlo.multiply %[[LR]], %[[DW1]] {hlopar.layer = 1 : i64, hlopar.role = "update"}
  %s1 = stablehlo.multiply %lr, %dw1 : tensor<8x8xf32>
  // CHECK-NEXT: %[[NW1:.*]] = stablehlo.subtract %arg1, {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "update"}
  %nw1 = stablehlo.subtract %w1, %s1 : tensor<8x8xf32>
  // CHECK-NEXT: return %[[NW0]], %[[NW1]], %[[LOSS]]
  return %nw0, %nw1, %loss : tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>
}

// -----

// User markers (`jax.named_scope("hlopar_layer_N")` in the name stack) win over the DP and
// over `layers=2`: both matmuls are pinned to layer 0, the loss's square to layer 1. The
// backward of both matmuls then follows layer 0, and so do both updates.

// CHECK-LABEL: func.func @user_markers
func.func @user_markers(%w0: tensor<8x8xf32>, %w1: tensor<8x8xf32>, %x: tensor<4x8xf32>)
    -> (tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  // CHECK: stablehlo.dot_general %arg2, %arg0, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "forward"}
  %h = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("jit(step)/jvp(hlopar_layer_0)/dot_general"("step.py":3:0))
  // CHECK-NEXT: stablehlo.dot_general {{.*}}, %arg1, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "forward"}
  %y = stablehlo.dot_general %h, %w1, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("jit(step)/jvp(hlopar_layer_0)/dot_general"("step.py":4:0))
  // CHECK-NEXT: stablehlo.multiply {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %sq = stablehlo.multiply %y, %y : tensor<4x8xf32> loc("jit(step)/jvp(hlopar_layer_1)/mul"("step.py":5:0))
  // CHECK-NEXT: stablehlo.reduce{{.*}} {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %loss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %two = stablehlo.constant dense<2.0> : tensor<4x8xf32>
  %dy = stablehlo.multiply %two, %y : tensor<4x8xf32>
  // CHECK: stablehlo.dot_general {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "backward"}
  %dw1 = stablehlo.dot_general %h, %dy, contracting_dims = [0] x [0] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  // CHECK-NEXT: stablehlo.dot_general {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "backward"}
  %dh = stablehlo.dot_general %dy, %w1, contracting_dims = [1] x [1] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  // CHECK-NEXT: stablehlo.dot_general {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "backward"}
  %dw0 = stablehlo.dot_general %x, %dh, contracting_dims = [0] x [0] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  %lr = stablehlo.constant dense<0.1> : tensor<8x8xf32>
  %s0 = stablehlo.multiply %lr, %dw0 : tensor<8x8xf32>
  // CHECK: stablehlo.subtract %arg0, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "update"}
  %nw0 = stablehlo.subtract %w0, %s0 : tensor<8x8xf32>
  %s1 = stablehlo.multiply %lr, %dw1 : tensor<8x8xf32>
  // CHECK: stablehlo.subtract %arg1, {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "update"}
  %nw1 = stablehlo.subtract %w1, %s1 : tensor<8x8xf32>
  return %nw0, %nw1, %loss : tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>
}

// -----

// A forward-only program (inference: no loss, no state) is all forward, cut into 2 layers.

// CHECK-LABEL: func.func @inference
func.func @inference(%w0: tensor<8x8xf32>, %w1: tensor<8x8xf32>, %x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  // CHECK-NEXT: stablehlo.dot_general {{.*}} {hlopar.layer = 0 : i64, hlopar.role = "forward"}
  %h = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  // Either side of the tanh is as good a cut (same bytes, same FLOP variance).
  // CHECK-NEXT: stablehlo.tanh {{.*}} {hlopar.layer = {{[01]}} : i64, hlopar.role = "forward"}
  %a = stablehlo.tanh %h : tensor<4x8xf32>
  // CHECK-NEXT: stablehlo.dot_general {{.*}} {hlopar.layer = 1 : i64, hlopar.role = "forward"}
  %y = stablehlo.dot_general %a, %w1, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// The zoo's MLP as JAX exports it (3 dense layers, Adam), clustered into 3 layers: each
// dense layer's forward matmul in its own layer, the backward matmuls in reverse order
// (weight and input gradients of layer 2, then 1, then 0).
// RUN: %python %S/../../../tools/export_model.py mlp tiny -o %t.mlp.mlir
// RUN: hlopar-opt %t.mlp.mlir -p 'builtin.module(hlopar-import,hlopar-cluster-operators{layers=3})' | FileCheck %s --check-prefix=MLP
// MLP-LABEL: func.func public @main
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 0 : i64, hlopar.role = "forward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 1 : i64, hlopar.role = "forward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 2 : i64, hlopar.role = "forward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 2 : i64, hlopar.role = "backward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 2 : i64, hlopar.role = "backward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 1 : i64, hlopar.role = "backward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 1 : i64, hlopar.role = "backward"
// MLP: stablehlo.dot_general {{.*}}hlopar.layer = 0 : i64, hlopar.role = "backward"
// MLP-NOT: stablehlo.dot_general
// MLP: stablehlo.subtract {{.*}}hlopar.role = "update"
// MLP-NOT: hlopar.role = "forward"
// MLP: return
