// A host callback (here jax.debug.print of a forward value, jaxlib's Python callback
// handler) calls a function of the process that lowered the step; an hlopar-compile bundle
// runs on Ray workers, other processes: refused at the callback's line, no bundle written.
// RUN: rm -rf %t && mkdir %t
// RUN: not hlopar-compile %s --num-hosts 1 --devices-per-host 2 --microbatches 2 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s
// RUN: not hlopar-compile %s --num-hosts 1 --devices-per-host 2 --microbatches 1 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s
// RUN: %python -c "import os, sys; sys.exit(bool(os.listdir(sys.argv[1])))" %t
// CHECK: host_callbacks.mlir:[[# @LINE + 10]]:5: error: hlopar-compile: host callback 'xla_ffi_python_cpu_callback' (jax.debug.print, jax.debug.callback, io_callback or pure_callback) calls a Python function of the process that lowered the step, and the plan runs on Ray workers: other processes, which do not hold it
// CHECK-NOT: Traceback
// CHECK-NOT: internal error

module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @maximal_mesh_0 = <[], device_ids=[0]> {stablehlo.mesh = {axes = [], device_ids = dense<0> : tensor<1xi64>}}
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<8x4xf32>) -> (tensor<4x4xf32> {jax.result_info = "result[0]"}, tensor<f32> {jax.result_info = "result[1]"}) {
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
    stablehlo.custom_call @xla_ffi_python_cpu_callback(%1) {backend_config = "", has_side_effect = true, mhlo.backend_config = {index = 0 : ui64}, operand_layouts = [dense<> : tensor<0xindex>], result_layouts = [], sdy.sharding = #sdy.sharding_per_value<[<@maximal_mesh_0, []>]>} : (tensor<f32>) -> ()
    %2 = stablehlo.multiply %0, %0 : tensor<8x4xf32>
    %cst_0 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %3 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
    %4 = stablehlo.multiply %3, %0 : tensor<8x4xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%2 init: %cst_1) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_2 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %6 = stablehlo.divide %5, %cst_2 : tensor<f32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_4 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %7 = stablehlo.divide %cst_3, %cst_4 : tensor<f32>
    %8 = stablehlo.broadcast_in_dim %7, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
    %9 = stablehlo.multiply %8, %4 : tensor<8x4xf32>
    %10 = stablehlo.dot_general %9, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
    %11 = stablehlo.transpose %10, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %cst_5 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %12 = stablehlo.broadcast_in_dim %cst_5, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %13 = stablehlo.multiply %12, %11 : tensor<4x4xf32>
    %14 = stablehlo.subtract %arg0, %13 : tensor<4x4xf32>
    return %14, %6 : tensor<4x4xf32>, tensor<f32>
  }
}

