"""Which ops can leave sums pending, and which carry them (partial-sum layouts).

A value with pending sums (`ShardingSpec.unreduced`) is held as addends on the devices along
some mesh axes. An op whose split reduction would all-reduce may leave them pending instead
(a matrix product; a `reduce` or a `scatter` whose body adds); an op linear in some operands
carries them. Where pending pays is left to the ILP: a filter that offered pending layouts
only on the way to a sum of two pending values, a loop's carry or a shrinking op (tried)
lost plans the ILP finds otherwise (Alpa's 2-D MLP: 0.72 of Alpa's communication without
the filter, 0.95 with it; the MoE layer 1.000 against 1.006).
"""

from __future__ import annotations

from hlopar.ir.graph import OpNode

__all__ = ["CONTRACTIONS", "pending_sums_of"]

CONTRACTIONS = frozenset({"stablehlo.dot_general", "stablehlo.dot"})
# Linear in all operands together (every operand pending, the same axes).
_SUMMED_TOGETHER = frozenset({"stablehlo.add", "stablehlo.subtract", "stablehlo.concatenate"})
# Linear in the first operand. Not `convert`: the rounding of each addend is not the rounding
# of the sum; not `pad`: linear only for a zero padding value.
_LINEAR_IN_FIRST = frozenset(
    {
        "stablehlo.negate",
        "stablehlo.reshape",
        "stablehlo.transpose",
        "stablehlo.broadcast_in_dim",
        "stablehlo.slice",
        "stablehlo.copy",
        "stablehlo.reverse",
        "stablehlo.divide",
    }
)


def pending_sums_of(op: OpNode) -> tuple[bool, tuple[tuple[int, ...], ...]]:
    """How an op deals with pending sums: whether its split reduction may leave them pending,
    and the groups of operands it is linear in together (`strategies.pending_operand_variants`)."""
    name, count = op.name, len(op.operands)
    if name in CONTRACTIONS:
        return True, ()
    if name == "stablehlo.reduce" and _adds(op):
        return True, (tuple(range(count)),)  # linear in its inputs and their initial values together
    if name == "stablehlo.scatter" and count == 3 and _adds(op):
        return True, ((0, 2),)  # a scatter-add (an embedding lookup's gradient): in its input and updates
    if name in _SUMMED_TOGETHER:
        return False, (tuple(range(count)),)
    if name == "stablehlo.multiply":
        return False, ((0,), (1,))
    if name in _LINEAR_IN_FIRST:
        return False, ((0,),)
    return False, ()


def _adds(op: OpNode) -> bool:
    """Whether a reduce's body (a scatter's update computation) is one `add` of its two arguments."""
    if len(op.regions) != 1 or len(op.regions[0]) != 1:
        return False
    return [inner.name for inner in op.regions[0][0].ops] == ["stablehlo.add", "stablehlo.return"]
