"""Where the batch goes: the dimension of each value that indexes the batch's examples.

`force-batch-dim` and `data-parallel` split the batch over mesh axes, and so every value the
examples flow into, along the dimension that holds them. That dimension is not "the leading
dim of the batch size": a transposed weight of 8 rows next to a batch of 8 examples is no
batch, and an activation reshaped to (heads, batch, ...) keeps its examples in dim 1. It is
found from the ops' factors (Shardy's op sharding rules, `rules.OpRule`), as Shardy's own
propagation follows a dimension: the batch arguments' leading dim is a factor of each op
reading them, and a result dimension made of that factor (its major part, for a reshaped
dimension) carries the batch on. The flow stops where an op reduces the factor (a weight's
gradient sums over the examples, a mean loss too) and at ops without a rule.

Values inside loops and branches are reached only through their ops' rules; a loop's
carried values are not followed (a gradient-accumulation loop's carry is a sum, not the
batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hlopar.analysis.auto_sharding.rules import OpRule
from hlopar.ir.graph import FuncGraph

__all__ = ["batch_dims"]


def batch_dims(graph: FuncGraph, rules: Mapping[int, OpRule | None], batch_args: Sequence[int]) -> dict[int, int]:
    """Value id -> the dimension holding the batch's examples, for the batch arguments
    (numbers into `graph.args`; dim 0) and every value they flow into (module docstring)."""
    values = graph.values
    dims: dict[int, int] = {}
    sizes = set()
    for i in batch_args:
        shape = values[graph.args[i]].shape
        if shape and shape[0] is not None:
            dims[graph.args[i]] = 0
            sizes.add(shape[0])
    if not dims:
        return dims
    for op in graph.walk():
        rule = rules.get(op.id)
        if rule is None:
            continue
        factors = set()
        for k, v in enumerate(op.operands):
            d = dims.get(v)
            if d is not None and k < len(rule.operands) and d < len(rule.operands[k]) and rule.operands[k][d]:
                factors.add(rule.operands[k][d][0])
        factors = {f for f in factors if rule.factor_sizes[f] in sizes}
        if not factors:
            continue
        for r, v in enumerate(op.results):
            if r >= len(rule.results):
                break
            d = next((d for d, dim in enumerate(rule.results[r]) if dim and dim[0] in factors), None)
            if d is not None:
                dims[v] = d
    return dims
