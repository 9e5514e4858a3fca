// A value converted to a loop's carried layout and read in that layout again after the loop:
// the one conversion (an `sdy.sharding_constraint`, shared by both consumers) comes before
// the loop, not before the later op, which would leave the loop's operand undefined.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4})' | FileCheck %s

sdy.mesh @mesh = <["x"=2, "y"=4]>

// CHECK-LABEL: func.func @main
// CHECK:       %[[C:.*]] = sdy.sharding_constraint %arg0 <@mesh, [{}, {"y"}]>
// CHECK-NEXT:  %[[W:.*]]:2 = stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %[[C]])
// CHECK:       stablehlo.add %[[C]], %[[W]]#1
func.func @main(%arg0: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) -> (tensor<16x16xf32>, tensor<16x16xf32>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %c1 = stablehlo.constant dense<1> : tensor<i32>
  %c3 = stablehlo.constant dense<3> : tensor<i32>
  %w:2 = stablehlo.while(%i = %c0, %h = %arg0) : tensor<i32>, tensor<16x16xf32>
    cond {
      %p = stablehlo.compare LT, %i, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %n = stablehlo.add %i, %c1 : tensor<i32>
      %h2 = stablehlo.multiply %h, %h {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"y"}]>]>} : tensor<16x16xf32>
      stablehlo.return %n, %h2 : tensor<i32>, tensor<16x16xf32>
    }
  %s = stablehlo.add %arg0, %w#1 {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"y"}]>]>} : tensor<16x16xf32>
  return %s, %w#1 : tensor<16x16xf32>, tensor<16x16xf32>
}
