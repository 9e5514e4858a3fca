// hlopar-compile names the passes' options as its own flags: an ambiguous batch is settled
// with --batch-args, not the split pass's batch-args=.
// RUN: not hlopar-compile %s --num-hosts 1 --devices-per-host 2 --microbatches 2 --schedule 1f1b -o %t.bundle 2>&1 | FileCheck %s
// CHECK: cli_terms.mlir:[[# @LINE + 5]]:{{[0-9]+}}: error: hlopar-split-microbatches: the arguments that are not training state have different leading dims (leading dim 6: argument 2; leading dim 8: argument 1): name the batch with --batch-args I,J
// CHECK-NOT: batch-args=
// CHECK-NOT: Traceback

module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<8x4xf32>, %arg2: tensor<6x4xf32>) -> (tensor<f32> {jax.result_info = "result[0]"}, tensor<4x4xf32> {jax.result_info = "result[1]"}) {
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_0 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %2 = stablehlo.divide %1, %cst_0 : tensor<f32>
    %3 = stablehlo.dot_general %arg2, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<6x4xf32>, tensor<4x4xf32>) -> tensor<6x4xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_1) applies stablehlo.add across dimensions = [0, 1] : (tensor<6x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_2 = stablehlo.constant dense<2.400000e+01> : tensor<f32>
    %5 = stablehlo.divide %4, %cst_2 : tensor<f32>
    %6 = stablehlo.add %2, %5 : tensor<f32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_4 = stablehlo.constant dense<2.400000e+01> : tensor<f32>
    %7 = stablehlo.divide %cst_3, %cst_4 : tensor<f32>
    %8 = stablehlo.broadcast_in_dim %7, dims = [] : (tensor<f32>) -> tensor<6x4xf32>
    %9 = stablehlo.dot_general %8, %arg2, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<6x4xf32>, tensor<6x4xf32>) -> tensor<4x4xf32>
    %10 = stablehlo.transpose %9, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %cst_5 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_6 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %11 = stablehlo.divide %cst_5, %cst_6 : tensor<f32>
    %12 = stablehlo.broadcast_in_dim %11, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
    %13 = stablehlo.dot_general %12, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
    %14 = stablehlo.transpose %13, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %15 = stablehlo.add %10, %14 : tensor<4x4xf32>
    %cst_7 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %16 = stablehlo.broadcast_in_dim %cst_7, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %17 = stablehlo.multiply %16, %15 : tensor<4x4xf32>
    %18 = stablehlo.subtract %arg0, %17 : tensor<4x4xf32>
    return %6, %18 : tensor<f32>, tensor<4x4xf32>
  }
}

