module @jit_step attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<16xf32>, %arg1: tensor<8x16xf32>, %arg2: tensor<16xf32>, %arg3: tensor<16x16xf32>, %arg4: tensor<4xf32>, %arg5: tensor<16x4xf32>, %arg6: tensor<i32>, %arg7: tensor<16xf32>, %arg8: tensor<8x16xf32>, %arg9: tensor<16xf32>, %arg10: tensor<16x16xf32>, %arg11: tensor<4xf32>, %arg12: tensor<16x4xf32>, %arg13: tensor<16xf32>, %arg14: tensor<8x16xf32>, %arg15: tensor<16xf32>, %arg16: tensor<16x16xf32>, %arg17: tensor<4xf32>, %arg18: tensor<16x4xf32>, %arg19: tensor<8x8xf32>, %arg20: tensor<8x4xf32>) -> (tensor<16xf32> {jax.result_info = "result[0][0]['bias']"}, tensor<8x16xf32> {jax.result_info = "result[0][0]['kernel']"}, tensor<16xf32> {jax.result_info = "result[0][1]['bias']"}, tensor<16x16xf32> {jax.result_info = "result[0][1]['kernel']"}, tensor<4xf32> {jax.result_info = "result[0][2]['bias']"}, tensor<16x4xf32> {jax.result_info = "result[0][2]['kernel']"}, tensor<i32> {jax.result_info = "result[1].count"}, tensor<16xf32> {jax.result_info = "result[1].mu[0]['bias']"}, tensor<8x16xf32> {jax.result_info = "result[1].mu[0]['kernel']"}, tensor<16xf32> {jax.result_info = "result[1].mu[1]['bias']"}, tensor<16x16xf32> {jax.result_info = "result[1].mu[1]['kernel']"}, tensor<4xf32> {jax.result_info = "result[1].mu[2]['bias']"}, tensor<16x4xf32> {jax.result_info = "result[1].mu[2]['kernel']"}, tensor<16xf32> {jax.result_info = "result[1].nu[0]['bias']"}, tensor<8x16xf32> {jax.result_info = "result[1].nu[0]['kernel']"}, tensor<16xf32> {jax.result_info = "result[1].nu[1]['bias']"}, tensor<16x16xf32> {jax.result_info = "result[1].nu[1]['kernel']"}, tensor<4xf32> {jax.result_info = "result[1].nu[2]['bias']"}, tensor<16x4xf32> {jax.result_info = "result[1].nu[2]['kernel']"}, tensor<f32> {jax.result_info = "result[2]"}) {
    %0 = stablehlo.dot_general %arg19, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
    %1 = stablehlo.broadcast_in_dim %arg0, dims = [1] : (tensor<16xf32>) -> tensor<1x16xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1] : (tensor<1x16xf32>) -> tensor<8x16xf32>
    %3 = stablehlo.add %0, %2 : tensor<8x16xf32>
    %4 = call @relu(%3) : (tensor<8x16xf32>) -> tensor<8x16xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %6 = stablehlo.compare GT, %3, %5, FLOAT : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xi1>
    %7 = stablehlo.dot_general %4, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %8 = stablehlo.broadcast_in_dim %arg2, dims = [1] : (tensor<16xf32>) -> tensor<1x16xf32>
    %9 = stablehlo.broadcast_in_dim %8, dims = [0, 1] : (tensor<1x16xf32>) -> tensor<8x16xf32>
    %10 = stablehlo.add %7, %9 : tensor<8x16xf32>
    %11 = call @relu(%10) : (tensor<8x16xf32>) -> tensor<8x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %12 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %13 = stablehlo.compare GT, %10, %12, FLOAT : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xi1>
    %14 = stablehlo.dot_general %11, %arg5, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
    %15 = stablehlo.broadcast_in_dim %arg4, dims = [1] : (tensor<4xf32>) -> tensor<1x4xf32>
    %16 = stablehlo.broadcast_in_dim %15, dims = [0, 1] : (tensor<1x4xf32>) -> tensor<8x4xf32>
    %17 = stablehlo.add %14, %16 : tensor<8x4xf32>
    %18 = stablehlo.subtract %17, %arg20 : tensor<8x4xf32>
    %19 = chlo.square %18 : tensor<8x4xf32> -> tensor<8x4xf32>
    %cst_1 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %20 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
    %21 = stablehlo.multiply %20, %18 : tensor<8x4xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %22 = stablehlo.reduce(%19 init: %cst_2) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_3 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %23 = stablehlo.divide %22, %cst_3 : tensor<f32>
    %cst_4 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_5 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %24 = stablehlo.divide %cst_4, %cst_5 : tensor<f32>
    %25 = stablehlo.broadcast_in_dim %24, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
    %26 = stablehlo.multiply %25, %21 : tensor<8x4xf32>
    %cst_6 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %27 = stablehlo.reduce(%26 init: %cst_6) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32>
    %28 = stablehlo.reshape %27 : (tensor<4xf32>) -> tensor<1x4xf32>
    %cst_7 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %29 = stablehlo.reduce(%28 init: %cst_7) applies stablehlo.add across dimensions = [0] : (tensor<1x4xf32>, tensor<f32>) -> tensor<4xf32>
    %30 = stablehlo.dot_general %26, %11, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
    %31 = stablehlo.transpose %30, dims = [1, 0] : (tensor<4x16xf32>) -> tensor<16x4xf32>
    %32 = stablehlo.dot_general %26, %arg5, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x4xf32>, tensor<16x4xf32>) -> tensor<8x16xf32>
    %cst_8 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %33 = stablehlo.broadcast_in_dim %cst_8, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %34 = stablehlo.select %13, %32, %33 : tensor<8x16xi1>, tensor<8x16xf32>
    %cst_9 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %35 = stablehlo.reduce(%34 init: %cst_9) applies stablehlo.add across dimensions = [0] : (tensor<8x16xf32>, tensor<f32>) -> tensor<16xf32>
    %36 = stablehlo.reshape %35 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_10 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %37 = stablehlo.reduce(%36 init: %cst_10) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %38 = stablehlo.dot_general %34, %4, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    %39 = stablehlo.transpose %38, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %40 = stablehlo.dot_general %34, %arg3, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %cst_11 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %41 = stablehlo.broadcast_in_dim %cst_11, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %42 = stablehlo.select %6, %40, %41 : tensor<8x16xi1>, tensor<8x16xf32>
    %cst_12 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %43 = stablehlo.reduce(%42 init: %cst_12) applies stablehlo.add across dimensions = [0] : (tensor<8x16xf32>, tensor<f32>) -> tensor<16xf32>
    %44 = stablehlo.reshape %43 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_13 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %45 = stablehlo.reduce(%44 init: %cst_13) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %46 = stablehlo.dot_general %42, %arg19, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
    %47 = stablehlo.transpose %46, dims = [1, 0] : (tensor<16x8xf32>) -> tensor<8x16xf32>
    %c = stablehlo.constant dense<1> : tensor<i32>
    %48 = stablehlo.add %arg6, %c : tensor<i32>
    %49 = stablehlo.convert %48 : (tensor<i32>) -> tensor<f32>
    %cst_14 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %50 = stablehlo.power %cst_14, %49 : tensor<f32>
    %cst_15 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %51 = stablehlo.subtract %cst_15, %50 : tensor<f32>
    %cst_16 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %52 = stablehlo.power %cst_16, %49 : tensor<f32>
    %cst_17 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %53 = stablehlo.subtract %cst_17, %52 : tensor<f32>
    %cst_18 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %54 = stablehlo.broadcast_in_dim %cst_18, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %55 = stablehlo.multiply %54, %arg7 : tensor<16xf32>
    %cst_19 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %56 = stablehlo.broadcast_in_dim %cst_19, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %57 = stablehlo.multiply %56, %45 : tensor<16xf32>
    %58 = stablehlo.add %55, %57 : tensor<16xf32>
    %cst_20 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %59 = stablehlo.broadcast_in_dim %cst_20, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %60 = stablehlo.multiply %59, %arg8 : tensor<8x16xf32>
    %cst_21 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %61 = stablehlo.broadcast_in_dim %cst_21, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %62 = stablehlo.multiply %61, %47 : tensor<8x16xf32>
    %63 = stablehlo.add %60, %62 : tensor<8x16xf32>
    %cst_22 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %64 = stablehlo.broadcast_in_dim %cst_22, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %65 = stablehlo.multiply %64, %arg9 : tensor<16xf32>
    %cst_23 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %66 = stablehlo.broadcast_in_dim %cst_23, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %67 = stablehlo.multiply %66, %37 : tensor<16xf32>
    %68 = stablehlo.add %65, %67 : tensor<16xf32>
    %cst_24 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %69 = stablehlo.broadcast_in_dim %cst_24, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %70 = stablehlo.multiply %69, %arg10 : tensor<16x16xf32>
    %cst_25 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %71 = stablehlo.broadcast_in_dim %cst_25, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %72 = stablehlo.multiply %71, %39 : tensor<16x16xf32>
    %73 = stablehlo.add %70, %72 : tensor<16x16xf32>
    %cst_26 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %74 = stablehlo.broadcast_in_dim %cst_26, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %75 = stablehlo.multiply %74, %arg11 : tensor<4xf32>
    %cst_27 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %76 = stablehlo.broadcast_in_dim %cst_27, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %77 = stablehlo.multiply %76, %29 : tensor<4xf32>
    %78 = stablehlo.add %75, %77 : tensor<4xf32>
    %cst_28 = stablehlo.constant dense<0.899999976> : tensor<f32>
    %79 = stablehlo.broadcast_in_dim %cst_28, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %80 = stablehlo.multiply %79, %arg12 : tensor<16x4xf32>
    %cst_29 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %81 = stablehlo.broadcast_in_dim %cst_29, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %82 = stablehlo.multiply %81, %31 : tensor<16x4xf32>
    %83 = stablehlo.add %80, %82 : tensor<16x4xf32>
    %cst_30 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %84 = stablehlo.broadcast_in_dim %cst_30, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %85 = stablehlo.multiply %84, %arg13 : tensor<16xf32>
    %86 = stablehlo.multiply %45, %45 : tensor<16xf32>
    %cst_31 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %87 = stablehlo.broadcast_in_dim %cst_31, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %88 = stablehlo.multiply %87, %86 : tensor<16xf32>
    %89 = stablehlo.add %85, %88 : tensor<16xf32>
    %cst_32 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %90 = stablehlo.broadcast_in_dim %cst_32, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %91 = stablehlo.multiply %90, %arg14 : tensor<8x16xf32>
    %92 = stablehlo.multiply %47, %47 : tensor<8x16xf32>
    %cst_33 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %93 = stablehlo.broadcast_in_dim %cst_33, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %94 = stablehlo.multiply %93, %92 : tensor<8x16xf32>
    %95 = stablehlo.add %91, %94 : tensor<8x16xf32>
    %cst_34 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %96 = stablehlo.broadcast_in_dim %cst_34, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %97 = stablehlo.multiply %96, %arg15 : tensor<16xf32>
    %98 = stablehlo.multiply %37, %37 : tensor<16xf32>
    %cst_35 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %99 = stablehlo.broadcast_in_dim %cst_35, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %100 = stablehlo.multiply %99, %98 : tensor<16xf32>
    %101 = stablehlo.add %97, %100 : tensor<16xf32>
    %cst_36 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %102 = stablehlo.broadcast_in_dim %cst_36, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %103 = stablehlo.multiply %102, %arg16 : tensor<16x16xf32>
    %104 = stablehlo.multiply %39, %39 : tensor<16x16xf32>
    %cst_37 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %105 = stablehlo.broadcast_in_dim %cst_37, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %106 = stablehlo.multiply %105, %104 : tensor<16x16xf32>
    %107 = stablehlo.add %103, %106 : tensor<16x16xf32>
    %cst_38 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %108 = stablehlo.broadcast_in_dim %cst_38, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %109 = stablehlo.multiply %108, %arg17 : tensor<4xf32>
    %110 = stablehlo.multiply %29, %29 : tensor<4xf32>
    %cst_39 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %111 = stablehlo.broadcast_in_dim %cst_39, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %112 = stablehlo.multiply %111, %110 : tensor<4xf32>
    %113 = stablehlo.add %109, %112 : tensor<4xf32>
    %cst_40 = stablehlo.constant dense<9.990000e-01> : tensor<f32>
    %114 = stablehlo.broadcast_in_dim %cst_40, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %115 = stablehlo.multiply %114, %arg18 : tensor<16x4xf32>
    %116 = stablehlo.multiply %31, %31 : tensor<16x4xf32>
    %cst_41 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %117 = stablehlo.broadcast_in_dim %cst_41, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %118 = stablehlo.multiply %117, %116 : tensor<16x4xf32>
    %119 = stablehlo.add %115, %118 : tensor<16x4xf32>
    %120 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %121 = stablehlo.divide %58, %120 : tensor<16xf32>
    %122 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %123 = stablehlo.divide %89, %122 : tensor<16xf32>
    %cst_42 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %124 = stablehlo.broadcast_in_dim %cst_42, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %125 = stablehlo.multiply %124, %121 : tensor<16xf32>
    %126 = stablehlo.sqrt %123 : tensor<16xf32>
    %cst_43 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %127 = stablehlo.broadcast_in_dim %cst_43, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %128 = stablehlo.add %126, %127 : tensor<16xf32>
    %129 = stablehlo.divide %125, %128 : tensor<16xf32>
    %130 = stablehlo.subtract %arg0, %129 : tensor<16xf32>
    %131 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %132 = stablehlo.divide %63, %131 : tensor<8x16xf32>
    %133 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %134 = stablehlo.divide %95, %133 : tensor<8x16xf32>
    %cst_44 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %135 = stablehlo.broadcast_in_dim %cst_44, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %136 = stablehlo.multiply %135, %132 : tensor<8x16xf32>
    %137 = stablehlo.sqrt %134 : tensor<8x16xf32>
    %cst_45 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %138 = stablehlo.broadcast_in_dim %cst_45, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %139 = stablehlo.add %137, %138 : tensor<8x16xf32>
    %140 = stablehlo.divide %136, %139 : tensor<8x16xf32>
    %141 = stablehlo.subtract %arg1, %140 : tensor<8x16xf32>
    %142 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %143 = stablehlo.divide %68, %142 : tensor<16xf32>
    %144 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %145 = stablehlo.divide %101, %144 : tensor<16xf32>
    %cst_46 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %146 = stablehlo.broadcast_in_dim %cst_46, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %147 = stablehlo.multiply %146, %143 : tensor<16xf32>
    %148 = stablehlo.sqrt %145 : tensor<16xf32>
    %cst_47 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %149 = stablehlo.broadcast_in_dim %cst_47, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %150 = stablehlo.add %148, %149 : tensor<16xf32>
    %151 = stablehlo.divide %147, %150 : tensor<16xf32>
    %152 = stablehlo.subtract %arg2, %151 : tensor<16xf32>
    %153 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %154 = stablehlo.divide %73, %153 : tensor<16x16xf32>
    %155 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %156 = stablehlo.divide %107, %155 : tensor<16x16xf32>
    %cst_48 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %157 = stablehlo.broadcast_in_dim %cst_48, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %158 = stablehlo.multiply %157, %154 : tensor<16x16xf32>
    %159 = stablehlo.sqrt %156 : tensor<16x16xf32>
    %cst_49 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %160 = stablehlo.broadcast_in_dim %cst_49, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %161 = stablehlo.add %159, %160 : tensor<16x16xf32>
    %162 = stablehlo.divide %158, %161 : tensor<16x16xf32>
    %163 = stablehlo.subtract %arg3, %162 : tensor<16x16xf32>
    %164 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %165 = stablehlo.divide %78, %164 : tensor<4xf32>
    %166 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %167 = stablehlo.divide %113, %166 : tensor<4xf32>
    %cst_50 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %168 = stablehlo.broadcast_in_dim %cst_50, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %169 = stablehlo.multiply %168, %165 : tensor<4xf32>
    %170 = stablehlo.sqrt %167 : tensor<4xf32>
    %cst_51 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %171 = stablehlo.broadcast_in_dim %cst_51, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %172 = stablehlo.add %170, %171 : tensor<4xf32>
    %173 = stablehlo.divide %169, %172 : tensor<4xf32>
    %174 = stablehlo.subtract %arg4, %173 : tensor<4xf32>
    %175 = stablehlo.broadcast_in_dim %51, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %176 = stablehlo.divide %83, %175 : tensor<16x4xf32>
    %177 = stablehlo.broadcast_in_dim %53, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %178 = stablehlo.divide %119, %177 : tensor<16x4xf32>
    %cst_52 = stablehlo.constant dense<1.000000e-03> : tensor<f32>
    %179 = stablehlo.broadcast_in_dim %cst_52, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %180 = stablehlo.multiply %179, %176 : tensor<16x4xf32>
    %181 = stablehlo.sqrt %178 : tensor<16x4xf32>
    %cst_53 = stablehlo.constant dense<9.99999993E-9> : tensor<f32>
    %182 = stablehlo.broadcast_in_dim %cst_53, dims = [] : (tensor<f32>) -> tensor<16x4xf32>
    %183 = stablehlo.add %181, %182 : tensor<16x4xf32>
    %184 = stablehlo.divide %180, %183 : tensor<16x4xf32>
    %185 = stablehlo.subtract %arg5, %184 : tensor<16x4xf32>
    return %130, %141, %152, %163, %174, %185, %48, %58, %63, %68, %73, %78, %83, %89, %95, %101, %107, %113, %119, %23 : tensor<16xf32>, tensor<8x16xf32>, tensor<16xf32>, tensor<16x16xf32>, tensor<4xf32>, tensor<16x4xf32>, tensor<i32>, tensor<16xf32>, tensor<8x16xf32>, tensor<16xf32>, tensor<16x16xf32>, tensor<4xf32>, tensor<16x4xf32>, tensor<16xf32>, tensor<8x16xf32>, tensor<16xf32>, tensor<16x16xf32>, tensor<4xf32>, tensor<16x4xf32>, tensor<f32>
  }
  func.func private @relu(%arg0: tensor<8x16xf32>) -> tensor<8x16xf32> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %1 = stablehlo.maximum %arg0, %0 : tensor<8x16xf32>
    return %1 : tensor<8x16xf32>
  }
}
