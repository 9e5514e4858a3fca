// RUN: hlopar-opt %s --split-input-file --verify-diagnostics

// Parse and verifier errors are reported at the op, with the file's own line numbers.

func.func @undeclared(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error @+1 {{use of undeclared SSA value name}}
  %0 = stablehlo.add %arg0, %missing : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

func.func @wrong_type(%arg0: tensor<4xf32>) -> tensor<8xf32> {
  // expected-error @+1 {{op requires the same shape for all operands and results}}
  %0 = "stablehlo.add"(%arg0, %arg0) : (tensor<4xf32>, tensor<4xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

// expected-error @+1 {{dialect 'quant' is not available in jaxlib's MLIR}}
func.func @quantized(%arg0: tensor<4x!quant.uniform<i8:f32, 0.5>>) {
  return
}

// -----

// An op of a dialect jaxlib lacks, in generic form.

func.func @generic_foreign() {
  // expected-error @+1 {{dialect 'check' is not available in jaxlib's MLIR}}
  "check.expect_eq_const"() : () -> ()
  return
}
