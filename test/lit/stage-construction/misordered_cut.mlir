// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-stage-construction{schedule=1f1b num-hosts=1 devices-per-host=2 stages=2 plan-shardings=false workers=1})' 2>&1 | FileCheck %s

// A layering (as `hlopar-cluster-operators` writes it, here by hand) in which a backward op
// of layer 1 reads a backward value of layer 0: cut into two stages, stage 1's backward would
// read what stage 0's backward makes after it. Stage construction refuses the cut at the
// reading op's source line, the op it reads in a note, instead of writing a program that
// fails at run time ("read before it is made").

// CHECK-NOT: Traceback
// CHECK: step.py:12:3: error: the backward op stablehlo.dot_general (jit(step)/transpose(jvp(layer_1))/dot_general) of stage 1 reads a value made by the backward op stablehlo.multiply of stage 0, which a pipeline runs after it
// CHECK: step.py:11:3: note: the backward op stablehlo.multiply of stage 0 is here
func.func @main(%w0: tensor<8x8xf32>, %w1: tensor<8x8xf32>, %x: tensor<4x8xf32>)
    -> (tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>) {
  %zero = stablehlo.constant {hlopar.layer = 1 : i64, hlopar.role = "forward"} dense<0.0> : tensor<f32>
  %h = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] {hlopar.layer = 0 : i64, hlopar.role = "forward"} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %y = stablehlo.dot_general %h, %w1, contracting_dims = [1] x [0] {hlopar.layer = 1 : i64, hlopar.role = "forward"} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %sq = stablehlo.multiply %y, %y {hlopar.layer = 1 : i64, hlopar.role = "forward"} : tensor<4x8xf32>
  %loss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] {hlopar.layer = 1 : i64, hlopar.role = "forward"} : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %two = stablehlo.constant {hlopar.layer = 1 : i64, hlopar.role = "backward"} dense<2.0> : tensor<4x8xf32>
  // The cotangent of y, put in layer 0.
  %dy = stablehlo.multiply %two, %y {hlopar.layer = 0 : i64, hlopar.role = "backward"} : tensor<4x8xf32> loc("step.py":11:3)
  %dw1 = stablehlo.dot_general %h, %dy, contracting_dims = [0] x [0] {hlopar.layer = 1 : i64, hlopar.role = "backward"} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32> loc("jit(step)/transpose(jvp(layer_1))/dot_general"("step.py":12:3))
  %dh = stablehlo.dot_general %dy, %w1, contracting_dims = [1] x [1] {hlopar.layer = 0 : i64, hlopar.role = "backward"} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
  %dw0 = stablehlo.dot_general %x, %dh, contracting_dims = [0] x [0] {hlopar.layer = 0 : i64, hlopar.role = "backward"} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  %lr = stablehlo.constant {hlopar.layer = 0 : i64, hlopar.role = "update"} dense<0.1> : tensor<8x8xf32>
  %s0 = stablehlo.multiply %lr, %dw0 {hlopar.layer = 0 : i64, hlopar.role = "update"} : tensor<8x8xf32>
  %nw0 = stablehlo.subtract %w0, %s0 {hlopar.layer = 0 : i64, hlopar.role = "update"} : tensor<8x8xf32>
  %s1 = stablehlo.multiply %lr, %dw1 {hlopar.layer = 1 : i64, hlopar.role = "update"} : tensor<8x8xf32>
  %nw1 = stablehlo.subtract %w1, %s1 {hlopar.layer = 1 : i64, hlopar.role = "update"} : tensor<8x8xf32>
  return %nw0, %nw1, %loss : tensor<8x8xf32>, tensor<8x8xf32>, tensor<f32>
}
