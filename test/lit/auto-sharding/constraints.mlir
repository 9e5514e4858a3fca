// XLA keeps the shardings of arguments, results and sharding constraints only: the plan is
// written as an `sdy.sharding_constraint` on every op result (in the layout the op computes)
// and on every operand the consumer needs in another layout (one per value and layout,
// shared by the consumers). Here the weight is split over "x" and both matmuls read it split
// over "y": one conversion, a collective-permute in the report, the second use marked reused.
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4 preset=v100-p3.16xlarge report=%t.json})' | FileCheck %s
// RUN: FileCheck %s --check-prefix=REPORT < %t.json
// RUN: hlopar-opt %s -p 'builtin.module(hlopar-auto-sharding{mesh-shape=2x4 preset=v100-p3.16xlarge reshard-constraints=false})' | FileCheck %s --check-prefix=NONE

sdy.mesh @mesh = <["x"=2, "y"=4]>

// CHECK-LABEL: func.func @main
// CHECK-SAME:    -> (tensor<64x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {"y"}]>})
// CHECK-NEXT:  %[[W:.*]] = sdy.sharding_constraint %arg1 <@mesh, [{}, {"y"}]> : tensor<32x16xf32>
// CHECK-NEXT:  %[[D0:.*]] = stablehlo.dot_general %arg0, %[[W]], {{.*}}<@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  %[[C0:.*]] = sdy.sharding_constraint %[[D0]] <@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  %[[D1:.*]] = stablehlo.dot_general %arg2, %[[W]], {{.*}}<@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  %[[C1:.*]] = sdy.sharding_constraint %[[D1]] <@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  %[[T:.*]] = stablehlo.tanh %[[C0]]
// CHECK-NEXT:  %[[CT:.*]] = sdy.sharding_constraint %[[T]] <@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  %[[A:.*]] = stablehlo.add %[[CT]], %[[C1]]
// CHECK-NEXT:  %[[CA:.*]] = sdy.sharding_constraint %[[A]] <@mesh, [{"x"}, {"y"}]>
// CHECK-NEXT:  return %[[CA]]

// REPORT:      "reshards": [
// REPORT:        "from_spec": "[R, S(x)]",
// REPORT-NEXT:   "to_spec": "[R, S(y)]",
// REPORT-NEXT:   "collectives": [
// REPORT-NEXT:    "collective-permute(512 B, {x,y})"
// REPORT:        "reused": false
// REPORT:        "reused": true

// NONE-NOT: sdy.sharding_constraint
func.func @main(%arg0: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>},
                %arg1: tensor<32x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"x"}]>},
                %arg2: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) -> tensor<64x16xf32> {
  %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<64x32xf32>, tensor<32x16xf32>) -> tensor<64x16xf32>
  %1 = stablehlo.dot_general %arg2, %arg1, contracting_dims = [1] x [0] : (tensor<64x32xf32>, tensor<32x16xf32>) -> tensor<64x16xf32>
  %2 = stablehlo.tanh %0 : tensor<64x16xf32>
  %3 = stablehlo.add %2, %1 : tensor<64x16xf32>
  return %3 : tensor<64x16xf32>
}
