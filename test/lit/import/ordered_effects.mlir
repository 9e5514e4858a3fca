// An ordered effect (jax.debug.print(..., ordered=True), as jax.jit lowers it: a token
// threaded through @main) is refused at the op that takes the token: a located error, exit
// status 1, no traceback.
// RUN: not hlopar-opt %s -p 'builtin.module(hlopar-import)' 2>&1 | FileCheck %s
// CHECK-NOT: Traceback

module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: !stablehlo.token {jax.token = true}, %arg1: tensor<4x4xf32>) -> (!stablehlo.token {jax.token = true}, tensor<4x4xf32> {jax.result_info = "result"}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.reduce(%arg1 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
    // CHECK: ordered_effects.mlir:[[# @LINE + 1]]:10: error: host callback 'xla_ffi_python_cpu_callback' takes a token of @main: an ordered effect (ordered=True of jax.debug.print, jax.debug.callback or io_callback)
    %1 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0, %0) {backend_config = "", has_side_effect = true, mhlo.backend_config = {index = 0 : ui64}, operand_layouts = [dense<> : tensor<0xindex>, dense<> : tensor<0xindex>], result_layouts = [dense<> : tensor<0xindex>]} : (!stablehlo.token, tensor<f32>) -> !stablehlo.token
    %cst_0 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %3 = stablehlo.multiply %arg1, %2 : tensor<4x4xf32>
    return %1, %3 : !stablehlo.token, tensor<4x4xf32>
  }
}
