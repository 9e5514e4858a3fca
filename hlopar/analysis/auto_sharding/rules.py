"""Each op's factor structure, decoded from Shardy's `sdy.op_sharding_rule`.

A rule names the op's factors (its loop dimensions: `i`, `j`, `k`, ... with sizes), says
which factors each operand and result dimension is made of (several, major first, for a
reshaped dim), and which factors are reductions (sharding them leaves partial sums), need
replication, or can only be sharded by permuting data. jaxlib's `sdy-populate-op-sharding-rules`
pass writes a rule on every op Shardy knows; this module turns one into plain data, so that
strategies can be enumerated the same way for every op: a strategy assigns mesh axes to factors.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.hashing import cached_hash, state_without_hash

RULE_ATTRIBUTE = "sdy.sharding_rule"

# Per tensor dimension, the factors it is made of (major first); per tensor, its dims.
TensorFactors = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class OpRule:
    factor_sizes: tuple[int, ...]
    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    reduction: frozenset[int] = frozenset()
    need_replication: frozenset[int] = frozenset()
    permutation: frozenset[int] = frozenset()
    blocked: frozenset[int] = frozenset()
    is_custom: bool = False

    __hash__ = cached_hash  # a key of `graph_problem.StrategyCache`, hashed once
    __getstate__ = state_without_hash

    @property
    def num_factors(self) -> int:
        return len(self.factor_sizes)

    def result_factors(self) -> frozenset[int]:
        return frozenset(f for tensor in self.results for dim in tensor for f in dim)

    @staticmethod
    def elementwise(shape: tuple[int, ...], num_operands: int, num_results: int = 1) -> OpRule:
        """The rule of an op whose every operand and result is indexed like its output."""
        dims = tuple((d,) for d in range(len(shape)))
        return OpRule(tuple(shape), (dims,) * num_operands, (dims,) * num_results)


def decode_rule(attr: ir.Attribute) -> OpRule:
    rule = sdy.OpShardingRuleAttr(attr)

    def tensors(mappings) -> tuple[TensorFactors, ...]:
        return tuple(
            tuple(tuple(sdy.DimMappingAttr(dim).factor_indices) for dim in sdy.TensorMappingAttr(m).dim_mappings)
            for m in mappings
        )

    return OpRule(
        factor_sizes=tuple(rule.factor_sizes),
        operands=tensors(rule.operand_mappings),
        results=tensors(rule.result_mappings),
        reduction=frozenset(rule.reduction_factors),
        need_replication=frozenset(rule.need_replication_factors),
        permutation=frozenset(rule.permutation_factors),
        blocked=frozenset(rule.blocked_propagation_factors),
        is_custom=rule.is_custom,
    )


# Ops whose result k is their operand k unchanged: Shardy writes them no rule, but their
# layouts follow their operands (`jax.checkpoint`'s barrier, a key's sharding constraint).
PASS_THROUGH_OPS = frozenset({"stablehlo.optimization_barrier"})


def rule_of(op: ir.Operation) -> OpRule | None:
    """The op's rule, if `sdy-populate-op-sharding-rules` (or the user) wrote one; for a
    pass-through op, the rule that ties each result's dims to its operand's."""
    if RULE_ATTRIBUTE in op.attributes:
        return decode_rule(op.attributes[RULE_ATTRIBUTE])
    if op.name in PASS_THROUGH_OPS:
        return pass_through_rule(
            [list(v.type.shape) if isinstance(v.type, ir.RankedTensorType) else None for v in op.operands]
        )
    return None


def pass_through_rule(shapes: list[list[int] | None]) -> OpRule | None:
    """Result k indexed exactly as operand k, with factors of its own (None: a token or
    another non-tensor operand, which the rule cannot describe)."""
    if any(shape is None for shape in shapes):
        return None
    sizes: list[int] = []
    tensors = []
    for shape in shapes:
        tensors.append(tuple((len(sizes) + d,) for d in range(len(shape))))
        sizes += shape
    return OpRule(tuple(sizes), tuple(tensors), tuple(tensors))
