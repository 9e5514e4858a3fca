// Batch statistics with microbatches (GPipe): a mean over the batch used per example divides by the microbatch's
// count (a new constant: the loss's mean keeps the whole batch's). What is computed from the statistic (a running
// mean) runs per microbatch and leaves it divided by B, through a reshape of kind "sum": the microbatches' sum is
// the mean of their values.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=2 loss-result=2})' 2>&1 | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=1 batch-args=2 loss-result=2})' 2>&1 | FileCheck %s --check-prefix=ONE

// CHECK: statistics.mlir:[[# @LINE + 24]]:{{[0-9]+}}: warning: hlopar-split-microbatches: batch statistics are computed per microbatch of 2 examples (GPipe), not over the batch of 8; running statistics are the mean over microbatches
// CHECK-LABEL: func.func @main
// CHECK: %[[N:.*]] = stablehlo.constant dense<8.000000e+00> : tensor<4xf32>
// CHECK: %[[S:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0] {hlopar.microbatch = "sum"} : (tensor<2x4xf32>, tensor<f32>) -> tensor<4xf32>
// CHECK-NEXT: %[[LOCAL_N:.*]] = stablehlo.constant dense<2.000000e+00> : tensor<4xf32>
// CHECK-NEXT: %[[MEAN:.*]] = stablehlo.divide %[[S]], %[[LOCAL_N]] {hlopar.microbatch = "batch"} : tensor<4xf32>
// CHECK: %[[TOTAL:.*]] = stablehlo.reduce
// CHECK: %[[LOSS:.*]] = stablehlo.divide %[[TOTAL]], %{{.*}} {hlopar.microbatch = "sum"} : tensor<f32>
// CHECK: %[[KEPT:.*]] = stablehlo.multiply %arg1, %{{.*}} : tensor<4xf32>
// CHECK-NEXT: %[[NEW:.*]] = stablehlo.multiply %[[MEAN]], %{{.*}} {hlopar.microbatch = "batch"} : tensor<4xf32>
// CHECK-NEXT: %[[RA:.*]] = stablehlo.add %[[KEPT]], %[[NEW]] {hlopar.microbatch = "batch"} : tensor<4xf32>
// CHECK-NEXT: %[[SHARE:.*]] = stablehlo.constant dense<2.500000e-01> : tensor<4xf32>
// CHECK-NEXT: %[[PART:.*]] = stablehlo.multiply %[[RA]], %[[SHARE]] {hlopar.microbatch = "batch"} : tensor<4xf32>
// CHECK-NEXT: %[[AVERAGED:.*]] = stablehlo.reshape %[[PART]] {hlopar.microbatch = "sum"} : (tensor<4xf32>) -> tensor<4xf32>
// CHECK-NEXT: return %arg0, %[[AVERAGED]], %[[LOSS]]
// ONE-NOT: warning
// ONE-NOT: dense<2.000000e+00>
// ONE-NOT: dense<2.500000e-01>
// ONE: return %arg0, %{{.*}}, %{{.*}} : tensor<4xf32>, tensor<4xf32>, tensor<f32>
func.func @main(%w: tensor<4xf32>, %ra: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<4xf32>, tensor<4xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %n = stablehlo.constant dense<8.0> : tensor<4xf32>
  %count = stablehlo.constant dense<32.0> : tensor<f32>
  %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
  %mean = stablehlo.divide %s, %n : tensor<4xf32>
  %mb = stablehlo.broadcast_in_dim %mean, dims = [1] : (tensor<4xf32>) -> tensor<8x4xf32>
  %c = stablehlo.subtract %x, %mb : tensor<8x4xf32>
  %sq = stablehlo.multiply %c, %c : tensor<8x4xf32>
  %t = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
  %loss = stablehlo.divide %t, %count : tensor<f32>
  %momentum = stablehlo.constant dense<0.9> : tensor<4xf32>
  %rest = stablehlo.constant dense<0.1> : tensor<4xf32>
  %kept = stablehlo.multiply %ra, %momentum : tensor<4xf32>
  %new = stablehlo.multiply %mean, %rest : tensor<4xf32>
  %new_ra = stablehlo.add %kept, %new : tensor<4xf32>
  return %w, %new_ra, %loss : tensor<4xf32>, tensor<4xf32>, tensor<f32>
}
