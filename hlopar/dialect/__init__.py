"""hlopar's IR contract: the names, attributes and ops hlopar writes into StableHLO and
Shardy's `mpmd` dialect, and their readers and writers (docs/ir.md).

A layer above `hlopar.ir` (MLIR plumbing) and below analysis, passes, codegen and the
runtime: every part of hlopar that reads or writes hlopar's own IR does it through here.
"""
