// Gradient accumulation as a user's fori_loop lowers it: each iteration's product contracts
// the batch, which the input splits over x. With partial-sum layouts (partial-sums=true) the
// product's sums stay pending (Shardy's unreduced axes) through the accumulation and the
// loop, and are reduced once, where the subtraction after the loop reads them (reduce-
// scattered over x, the layout it reads); without them (the default) the product is
// reduce-scattered in the loop, in every iteration.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=4 partial-sums=true})' | FileCheck %s
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=4})' | FileCheck %s --check-prefix=REDUCED

sdy.mesh @mesh = <["x"=4]>

// CHECK-LABEL: func.func @main
// CHECK:       %[[INIT:.*]] = sdy.sharding_constraint %{{.*}} <@mesh, [{}, {}], unreduced={"x"}>
// CHECK:       %[[LOOP:.*]]:2 = stablehlo.while(%{{.*}} = %{{.*}}, %[[ACC:.*]] = %[[INIT]])
// CHECK:       stablehlo.dot_general {{.*}}sdy.sharding_per_value<[<@mesh, [{}, {}], unreduced={"x"}>]>
// CHECK:       %[[SUM:.*]] = stablehlo.add %[[ACC]], {{.*}}unreduced={"x"}
// CHECK:       %[[YIELD:.*]] = sdy.sharding_constraint %[[SUM]] <@mesh, [{}, {}], unreduced={"x"}>
// CHECK:       stablehlo.return %{{.*}}, %[[YIELD]]
// CHECK:       %[[OUT:.*]] = sdy.sharding_constraint %[[LOOP]]#1 <@mesh, [{}, {}], unreduced={"x"}>
// CHECK:       %[[WHOLE:.*]] = sdy.sharding_constraint %[[OUT]] <@mesh, [{"x"}, {}]>
// CHECK:       stablehlo.subtract %{{.*}}, %[[WHOLE]]
// CHECK-NOT:   unreduced
// CHECK:       return

// REDUCED-LABEL: func.func @main
// REDUCED-NOT:   unreduced
// REDUCED:       stablehlo.while
// REDUCED:       stablehlo.dot_general {{.*}}sdy.sharding_per_value<[<@mesh, [{"x"}, {}]>]>
// REDUCED:       return
func.func @main(%w: tensor<16x16xf32>, %x: tensor<2x64x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}, {}]>}) -> tensor<16x16xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %c1 = stablehlo.constant dense<1> : tensor<i32>
  %c2 = stablehlo.constant dense<2> : tensor<i32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<16x16xf32>
  %r:2 = stablehlo.while(%i = %c0, %acc = %zero) : tensor<i32>, tensor<16x16xf32>
    cond {
      %p = stablehlo.compare LT, %i, %c2 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %xi = stablehlo.dynamic_slice %x, %i, %c0, %c0, sizes = [1, 64, 16] : (tensor<2x64x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x64x16xf32>
      %xr = stablehlo.reshape %xi : (tensor<1x64x16xf32>) -> tensor<64x16xf32>
      %g = stablehlo.dot_general %xr, %xr, contracting_dims = [0] x [0] : (tensor<64x16xf32>, tensor<64x16xf32>) -> tensor<16x16xf32>
      %a = stablehlo.add %acc, %g : tensor<16x16xf32>
      %n = stablehlo.add %i, %c1 : tensor<i32>
      stablehlo.return %n, %a : tensor<i32>, tensor<16x16xf32>
    }
  %u = stablehlo.subtract %w, %r#1 : tensor<16x16xf32>
  return %u : tensor<16x16xf32>
}
