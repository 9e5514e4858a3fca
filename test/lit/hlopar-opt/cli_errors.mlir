// Bad command lines and bad input give one clean error line and exit 1, never a traceback.

// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(no-such-pass)' 2>&1 | FileCheck %s --check-prefix=UNKNOWN
// UNKNOWN: error: unknown pass or pipeline 'no-such-pass'
// UNKNOWN-NOT: Traceback

// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(hlopar-import{no-such-option=1})' 2>&1 | FileCheck %s --check-prefix=OPTION
// OPTION: error: pass 'hlopar-import' has no option 'no-such-option'

// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(hlopar-import{inline=maybe})' 2>&1 | FileCheck %s --check-prefix=VALUE
// VALUE: error: option 'inline' of pass 'hlopar-import': invalid value 'maybe'

// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(func.func(hlopar-import))' 2>&1 | FileCheck %s --check-prefix=NESTED
// NESTED: error: 'hlopar-import' runs on the whole module

// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(canonicalize' 2>&1 | FileCheck %s --check-prefix=SYNTAX
// SYNTAX: error: pass pipeline:1:{{[0-9]+}}: expected ')'

// RUN: not hlopar-opt %t.does-not-exist 2>&1 | FileCheck %s --check-prefix=MISSING
// MISSING: error: cannot read '{{.*}}does-not-exist': No such file or directory

// A failed run leaves an existing output file untouched.
// RUN: echo previous > %t.out
// RUN: not hlopar-opt %s --pass-pipeline='builtin.module(no-such-pass)' -o %t.out
// RUN: FileCheck %s --check-prefix=KEPT < %t.out
// KEPT: previous

// An output where nothing can be written is refused before any work.
// RUN: not hlopar-opt %s -o %t.no-such-dir/out.mlir 2>&1 | FileCheck %s --check-prefix=NO-DIR
// NO-DIR: out.mlir: error: cannot write output: the directory '{{.*}}no-such-dir' does not exist

// RUN: printf 'func.func @f() {\n  return %%%%x : tensor<f32>\n}\n' | not hlopar-opt - 2>&1 | FileCheck %s --check-prefix=STDIN
// STDIN: -:2:10: error: use of undeclared SSA value name

func.func @f() {
  return
}
