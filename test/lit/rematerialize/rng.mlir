// RUN: hlopar-opt %s -p 'builtin.module(hlopar-rematerialize)' 2>%t.err | FileCheck %s
// RUN: FileCheck %s --check-prefix=WARN < %t.err

// Random numbers in a rematerialized stage. The dropout mask m comes from
// `stablehlo.rng_bit_generator`, a function of its state (the key): the backward draws it
// again from the key and gets the forward's bits. The noise n comes from `stablehlo.rng`,
// which XLA implements with a generator state of its own (each run draws anew): it is not
// computed again; the forward returns it (a result it did not have) and the backward reads
// it as before, said by a warning at the op.

// WARN: {{.*}}rng.mlir:[[# @LINE + 23]]:{{[0-9]+}}: warning: hlopar-rematerialize: stage 0's backward reads the result of 'stablehlo.rng' from its forward (stashed): it is not a function of its operands, so it is not computed again

// CHECK-LABEL: func.func @main
// CHECK:         %[[F:.*]]:2 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1)
// CHECK:           %[[N:[0-9]+]] = stablehlo.rng %
// CHECK:           mpmd.return %{{.*}}, %[[N]] : tensor<f32>, tensor<8xf32>
// CHECK-NEXT:    } : ({{.*}}) -> (!mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>)
// CHECK-NEXT:    %[[B:.*]] = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%arg2, %arg0, %arg1, %[[F]]#1) {hlopar.remat} (%[[G:.*]]: tensor<8xf32>, %[[X:.*]]: tensor<8xf32>, %[[KEY:.*]]: tensor<2xui64>, %[[N2:.*]]: tensor<8xf32>) {
// CHECK-NEXT:      %{{.*}}, %[[BITS:.*]] = stablehlo.rng_bit_generator %[[KEY]], algorithm = DEFAULT
// CHECK-NOT:       stablehlo.rng %
// CHECK:           stablehlo.multiply %[[X]], %[[N2]]
// CHECK:           mpmd.return
module attributes {hlopar.devices = {m0 = array<i64: 0>}} {
  sdy.mesh @m0 = <["x"=1]>
  func.func @main(%arg0: !mpmd.mesh_tensor<"m0", tensor<8xf32>>, %arg1: !mpmd.mesh_tensor<"m0", tensor<2xui64>>, %arg2: !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> (!mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>) attributes {topology = #mpmd.topology<<"m0" : <["x"=1]>>>} {
    %0:3 = mpmd.fragment<mesh="m0", origin=["stage0"], stage=0> (%arg0, %arg1) (%x: tensor<8xf32>, %key: tensor<2xui64>) {
      %state, %bits = stablehlo.rng_bit_generator %key, algorithm = DEFAULT : (tensor<2xui64>) -> (tensor<2xui64>, tensor<8xui32>)
      %half = stablehlo.constant dense<2147483648> : tensor<8xui32>
      %keep = stablehlo.compare GT, %bits, %half : (tensor<8xui32>, tensor<8xui32>) -> tensor<8xi1>
      %zero = stablehlo.constant dense<0.0> : tensor<8xf32>
      %lo = stablehlo.constant dense<0.0> : tensor<f32>
      %hi = stablehlo.constant dense<1.0> : tensor<f32>
      %shape = stablehlo.constant dense<8> : tensor<1xi64>
      %n = stablehlo.rng %lo, %hi, %shape, distribution = UNIFORM : (tensor<f32>, tensor<f32>, tensor<1xi64>) -> tensor<8xf32>
      %xn = stablehlo.multiply %x, %n : tensor<8xf32>
      %y = stablehlo.select %keep, %xn, %zero : tensor<8xi1>, tensor<8xf32>
      %s = stablehlo.reduce(%y init: %lo) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
      mpmd.return %s, %keep, %xn : tensor<f32>, tensor<8xi1>, tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<2xui64>>) -> (!mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<8xi1>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>)
    %1 = mpmd.fragment<mesh="m0", origin=["stage0"(1)], stage=0> (%0#1, %0#2, %arg2) {hlopar.remat} (%keep: tensor<8xi1>, %xn: tensor<8xf32>, %g: tensor<8xf32>) {
      %zero = stablehlo.constant dense<0.0> : tensor<8xf32>
      %gk = stablehlo.select %keep, %g, %zero : tensor<8xi1>, tensor<8xf32>
      %gx = stablehlo.multiply %gk, %xn : tensor<8xf32>
      mpmd.return %gx : tensor<8xf32>
    } : (!mpmd.mesh_tensor<"m0", tensor<8xi1>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>) -> !mpmd.mesh_tensor<"m0", tensor<8xf32>>
    return %0#0, %1 : !mpmd.mesh_tensor<"m0", tensor<f32>>, !mpmd.mesh_tensor<"m0", tensor<8xf32>>
  }
}
