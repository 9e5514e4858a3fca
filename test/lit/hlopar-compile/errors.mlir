// hlopar-compile fails like hlopar-opt: a located error, exit status 1, no traceback, and
// no bundle directory (nor its hidden staging directory) left behind.

// Bad input: the parser's error, at its line and column.
// RUN: rm -rf %t && mkdir %t
// RUN: not hlopar-compile %s --num-hosts 1 --devices-per-host 2 --microbatches 2 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s --check-prefix=PARSE
// RUN: not ls -A %t/bundle
// RUN: %python -c "import os, sys; sys.exit(bool(os.listdir(sys.argv[1])))" %t
// PARSE: errors.mlir:[[# @LINE + 13]]:8: error: custom op 'stablehlo.bogus' is unknown
// PARSE-NOT: Traceback

// A missing input.
// RUN: not hlopar-compile %t/missing.mlir --num-hosts 1 --devices-per-host 2 --microbatches 2 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s --check-prefix=MISSING
// RUN: %python -c "import os, sys; sys.exit(bool(os.listdir(sys.argv[1])))" %t
// MISSING: error: cannot read '{{.*}}missing.mlir': No such file or directory

// A bad command line is a usage error (status 2).
// RUN: not hlopar-compile %s --num-hosts 1 --devices-per-host 2 --microbatches 0 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s --check-prefix=USAGE
// USAGE: hlopar-compile: error: argument --microbatches: expected a positive integer, got 0

func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %y = stablehlo.bogus %x : tensor<4xf32>
  return %y : tensor<4xf32>
}

// A step whose batch does not split: the split pass's error, at @main.
// RUN: not hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 3 --schedule 1f1b -o %t/bundle 2>&1 | FileCheck %s --check-prefix=SPLIT
// RUN: %python -c "import os, sys; sys.exit(bool(os.listdir(sys.argv[1])))" %t
// SPLIT: mlp_train_step.mlir:2:3: error: hlopar-split-microbatches: batch argument 19 has leading dim 8, not divisible by 3 microbatches

// An unknown preset: the stage construction's error.
// RUN: not hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --schedule 1f1b --preset tpu -o %t/bundle 2>&1 | FileCheck %s --check-prefix=PRESET
// PRESET: mlp_train_step.mlir: error: hlopar-stage-construction: unknown cluster preset 'tpu'

// A directory that is not a bundle is never replaced; a failed run leaves it as it was.
// RUN: mkdir %t/precious && echo keep > %t/precious/notes.txt
// RUN: not hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --schedule 1f1b -o %t/precious 2>&1 | FileCheck %s --check-prefix=NOT-BUNDLE
// RUN: FileCheck %s --check-prefix=KEPT < %t/precious/notes.txt
// NOT-BUNDLE: precious: error: exists and is not an hlopar-compile bundle; refusing to replace it
// KEPT: keep

// An earlier bundle is replaced by a successful run, and kept by a failed one.
// RUN: hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --schedule gpipe -o %t/ok
// RUN: hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 2 --schedule 1f1b -o %t/ok
// RUN: FileCheck %s --check-prefix=REPLACED < %t/ok/meshes/m0/stream.txt
// RUN: not hlopar-compile %S/../../../examples/mlp_train_step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 3 --schedule gpipe -o %t/ok
// RUN: FileCheck %s --check-prefix=REPLACED < %t/ok/meshes/m0/stream.txt
// RUN: %python -c "import os, sys; sys.exit(sorted(os.listdir(sys.argv[1])) != ['ok', 'precious'])" %t
// REPLACED: # schedule 1f1b, 2 microbatches
