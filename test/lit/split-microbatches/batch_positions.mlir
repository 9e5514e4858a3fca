// Gathers and scatters indexed by the batch's own positions (issue 27, item 2): `h[jnp.arange(B), labels]` and its
// gradient index the rows of the batch by an iota along it (wrapped as JAX wraps negative indices). Split, they are
// batched gathers and scatters (operand_batching_dims, as take_along_axis lowers): each microbatch reads its own rows
// with its own positions, and the iota is gone. A table that does not carry the batch, indexed by the example's
// position, keeps its gather: the iota counts the whole batch's rows (microbatch index k, k * 2 + iota).
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=4 batch-args=1,2 loss-result=1})' 2>&1 | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-split-microbatches{microbatches=1 batch-args=1,2 loss-result=1})' 2>&1 | FileCheck %s --check-prefix=ONE

// CHECK-LABEL: func.func @main(%arg0: tensor<3xf32>, %arg1: tensor<2x3xf32>, %arg2: tensor<2xi32>, %arg3: tensor<8x3xf32>, %arg4: tensor<1xi32>)
// The table's positions: those of the whole batch.
// CHECK: %[[K:.*]] = stablehlo.reshape %arg4
// CHECK: %[[LOCAL:.*]] = stablehlo.iota dim = 0 {hlopar.microbatch = "batch"} : tensor<2xi32>
// CHECK: %[[GLOBAL:.*]] = stablehlo.add %[[LOCAL]]
// CHECK: %[[LABELS:.*]] = stablehlo.broadcast_in_dim %arg2, dims = [0] {hlopar.microbatch = "batch"} : (tensor<2xi32>) -> tensor<2x1xi32>
// CHECK: "stablehlo.gather"(%{{.*}}, %[[LABELS]]) <{dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [1], operand_batching_dims = [0], start_indices_batching_dims = [0], start_index_map = [1], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 1>}> {hlopar.microbatch = "batch"} : (tensor<2x3xf32>, tensor<2x1xi32>) -> tensor<2xf32>
// CHECK: "stablehlo.gather"(%arg3, %{{.*}}) <{dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0, 1], start_index_map = [0, 1], index_vector_dim = 1>{{.*}} : (tensor<8x3xf32>, tensor<2x2xi32>) -> tensor<2xf32>
// CHECK: "stablehlo.scatter"(%{{.*}}, %[[LABELS]], %{{.*}}) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [1], input_batching_dims = [0], scatter_indices_batching_dims = [0], scatter_dims_to_operand_dims = [1], index_vector_dim = 1>, unique_indices = false}>
// CHECK: }) {hlopar.microbatch = "batch"} : (tensor<2x3xf32>, tensor<2x1xi32>, tensor<2xf32>) -> tensor<2x3xf32>
// CHECK: stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.add across dimensions = [0] {hlopar.microbatch = "sum"} : (tensor<2x3xf32>, tensor<f32>) -> tensor<3xf32>

// One microbatch: as written.
// ONE: "stablehlo.gather"(%{{.*}}, %{{.*}}) <{dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0, 1], start_index_map = [0, 1], index_vector_dim = 1>{{.*}} : (tensor<8x3xf32>, tensor<8x2xi32>) -> tensor<8xf32>
func.func @main(%w: tensor<3xf32>, %x: tensor<8x3xf32>, %labels: tensor<8xi32>, %table: tensor<8x3xf32>) -> (tensor<3xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %lr = stablehlo.constant dense<1.000000e-01> : tensor<3xf32>
  %c0 = stablehlo.constant dense<0> : tensor<8xi32>
  %c8 = stablehlo.constant dense<8> : tensor<8xi32>
  %wb = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<3xf32>) -> tensor<8x3xf32>
  %h = stablehlo.multiply %x, %wb : tensor<8x3xf32>
  %iota = stablehlo.iota dim = 0 : tensor<8xi32>
  %negative = stablehlo.compare LT, %iota, %c0, SIGNED : (tensor<8xi32>, tensor<8xi32>) -> tensor<8xi1>
  %wrapped = stablehlo.add %iota, %c8 : tensor<8xi32>
  %rows = stablehlo.select %negative, %wrapped, %iota : tensor<8xi1>, tensor<8xi32>
  %rv = stablehlo.broadcast_in_dim %rows, dims = [0] : (tensor<8xi32>) -> tensor<8x1xi32>
  %lv = stablehlo.broadcast_in_dim %labels, dims = [0] : (tensor<8xi32>) -> tensor<8x1xi32>
  %idx = stablehlo.concatenate %rv, %lv, dim = 1 : (tensor<8x1xi32>, tensor<8x1xi32>) -> tensor<8x2xi32>
  %picked = "stablehlo.gather"(%h, %idx) <{dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0, 1], start_index_map = [0, 1], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 1>}> : (tensor<8x3xf32>, tensor<8x2xi32>) -> tensor<8xf32>
  %weights = "stablehlo.gather"(%table, %idx) <{dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0, 1], start_index_map = [0, 1], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 1>}> : (tensor<8x3xf32>, tensor<8x2xi32>) -> tensor<8xf32>
  %weighted = stablehlo.multiply %picked, %weights : tensor<8xf32>
  %loss = stablehlo.reduce(%weighted init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
  %zeros = stablehlo.constant dense<0.000000e+00> : tensor<8x3xf32>
  %dh = "stablehlo.scatter"(%zeros, %idx, %weights) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0, 1], scatter_dims_to_operand_dims = [0, 1], index_vector_dim = 1>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8x3xf32>, tensor<8x2xi32>, tensor<8xf32>) -> tensor<8x3xf32>
  %dwe = stablehlo.multiply %dh, %x : tensor<8x3xf32>
  %grad = stablehlo.reduce(%dwe init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x3xf32>, tensor<f32>) -> tensor<3xf32>
  %step = stablehlo.multiply %lr, %grad : tensor<3xf32>
  %new = stablehlo.subtract %w, %step : tensor<3xf32>
  return %new, %loss : tensor<3xf32>, tensor<f32>
}
