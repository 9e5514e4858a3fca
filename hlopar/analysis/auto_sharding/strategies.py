"""The parallel algorithms of an op, for every op at once: mesh axes assigned to its factors.

An op's rule (`rules.OpRule`) lists its factors: the loops of its computation. Sharding a
factor over some mesh axes splits that loop across devices. A strategy gives each mesh axis
to at most one factor; from that follow the layout every operand must have and every result
gets (a tensor dim takes the axes of its factors, major factor first), and the
communication the op needs itself: an all-reduce of the partial results when a reduction
factor is split (Alpa Table 3, rows 2, 3, 5 and 7; one per split reduction factor, as XLA's
SPMD partitioner emits them). This is Table 3 of the Alpa paper
generalized to any op and any N-D mesh; Table 3's batched matmul is the rule
`([b, i, k], [b, k, j]) -> ([b, i, j]) reduction={k}`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hlopar.analysis.auto_sharding.cluster import LogicalMesh
from hlopar.analysis.auto_sharding.collectives import Collective
from hlopar.analysis.auto_sharding.resharding import per_device_bytes
from hlopar.analysis.auto_sharding.rules import OpRule, TensorFactors
from hlopar.analysis.hashing import cached_hash, state_without_hash
from hlopar.analysis.sharding import ShardingSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """What strategies need of a value: its shape and element size (None: not a tensor)."""

    shape: Shape | None
    dtype_bytes: int

    __hash__ = cached_hash  # a key of `graph_problem.StrategyCache`, hashed once
    __getstate__ = state_without_hash

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class Strategy:
    """One parallel algorithm of one op."""

    factor_axes: tuple[tuple[str, ...], ...]  # per factor, the mesh axes it is split over
    operand_specs: tuple[ShardingSpec | None, ...]
    result_specs: tuple[ShardingSpec | None, ...]
    collectives: tuple[Collective, ...]  # the op's own communication (partial-sum all-reduces)
    communication_cost: float
    compute_cost: float
    memory: float  # bytes of the results on each device
    scattered_dim: int | None = None  # the result dim a reduce-scatter splits (None: all-reduce)

    @property
    def cost(self) -> float:
        return self.communication_cost + self.compute_cost

    def describe(self, factor_names: str = "ijklmnopqrstuvwxyzabcdefgh") -> str:
        parts = [
            f"{factor_names[f] if f < len(factor_names) else f'f{f}'}->{''.join(axes)}"
            for f, axes in enumerate(self.factor_axes)
            if axes
        ]
        described = ", ".join(parts) or "replicated"
        if self.scattered_dim is not None:
            described += f", reduce-scatter->dim{self.scattered_dim}"
        return described


def spec_of(tensor: TensorFactors, factor_axes: Sequence[tuple[str, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(tuple(a for f in dim for a in factor_axes[f]) for dim in tensor))


def is_expressible(
    tensor: TensorFactors, factor_axes: Sequence[tuple[str, ...]], sizes: Sequence[int], mesh: LogicalMesh
) -> bool:
    """Whether each dim's tiles stay contiguous: in a dim made of several factors (a reshape),
    only the major factors may be split, each fully except the last split one."""
    for dim in tensor:
        if len(dim) < 2:
            continue
        partial_seen = False
        for f in dim:
            shards = mesh.axes_size(factor_axes[f]) if factor_axes[f] else 1
            if partial_seen and shards > 1:
                return False
            if shards != sizes[f]:
                partial_seen = True
    return True


FULL_ENUMERATION_AXES = 4  # mesh axes (of size > 1) up to which every assignment is enumerated


def enumerate_strategies(
    rule: OpRule,
    operands: Sequence[TensorInfo],
    results: Sequence[TensorInfo],
    mesh: LogicalMesh,
    *,
    flops: float = 0.0,
) -> list[Strategy]:
    """Every strategy of an op on the mesh, replicated first, without duplicates.

    A mesh axis goes to at most one factor; axes on one factor are used in mesh order; a
    factor's shard count must divide its size (no padding); factors that need replication or
    permutation stay whole, as do factors that appear only in operands without being
    reductions (nothing would combine their pieces).

    On a mesh of more than `FULL_ENUMERATION_AXES` axes (Shardy's tests use 7 axes of 2) a
    factor gets at most one axis: all assignments are (factors + 1)^axes per op (16,384 for a
    matmul on 7 axes) and each edge costs their square, while one axis per factor keeps a
    matmul at 358. A layout the input imposes with several axes on one dimension is still
    planned, as a pinned strategy (`graph_problem`).
    """
    present_in_results = rule.result_factors()
    shardable = [
        f
        for f, size in enumerate(rule.factor_sizes)
        if size > 1
        and f not in rule.need_replication
        and f not in rule.permutation
        and (f in present_in_results or f in rule.reduction)
    ]
    axes = [a for a in mesh.axes if a.size > 1]
    strategies: dict[tuple, Strategy] = {}
    for owners in itertools.product([None, *shardable], repeat=len(axes)):
        factor_axes: list[tuple[str, ...]] = [() for _ in rule.factor_sizes]
        for axis, owner in zip(axes, owners):
            if owner is not None:
                factor_axes[owner] += (axis.name,)
        if any(axes_ and rule.factor_sizes[f] % mesh.axes_size(axes_) for f, axes_ in enumerate(factor_axes)):
            continue
        if len(axes) > FULL_ENUMERATION_AXES and any(len(axes_) > 1 for axes_ in factor_axes):
            continue
        tensors = [*rule.operands, *rule.results]
        if not all(is_expressible(t, factor_axes, rule.factor_sizes, mesh) for t in tensors):
            continue
        strategy = strategy_for(rule, tuple(factor_axes), operands, results, mesh, flops)
        for candidate in (strategy, *reduce_scatter_variants(strategy, results, mesh)):
            key = (candidate.operand_specs, candidate.result_specs)
            if key not in strategies or candidate.cost < strategies[key].cost:
                strategies[key] = candidate
    return list(strategies.values())


def reduce_scatter_variants(strategy: Strategy, results: Sequence[TensorInfo], mesh: LogicalMesh) -> list[Strategy]:
    """The same split with its partial sums reduce-scattered instead of all-reduced: the
    result comes out split over the reduced axes along one more dimension (Alpa's post-ILP
    rewrite for weight-update sharding, offered to the ILP itself so it can weigh it)."""
    if len(results) != 1 or len(strategy.collectives) != 1 or strategy.result_specs[0] is None:
        return []  # partial sums over several factors: XLA all-reduces each, nothing to scatter
    (all_reduce,) = strategy.collectives
    reduced = all_reduce.axes
    spec, info = strategy.result_specs[0], results[0]
    variants = []
    for dim, size in enumerate(info.shape):
        axes = spec.dims[dim] + reduced
        if size % mesh.axes_size(axes):
            continue
        scattered = ShardingSpec(spec.dims[:dim] + (axes,) + spec.dims[dim + 1 :])
        collective = Collective("reduce-scatter", reduced, all_reduce.nbytes)
        variants.append(
            replace(
                strategy,
                result_specs=(scattered,),
                collectives=(collective,),
                communication_cost=collective.cost(mesh),
                memory=float(per_device_bytes(info.shape, info.dtype_bytes, scattered, mesh)),
                scattered_dim=dim,
            )
        )
    return variants


def pending_result_variant(strategy: Strategy, mesh: LogicalMesh) -> Strategy | None:
    """The same split with its partial sums left pending (`ShardingSpec.unreduced`): the
    result is a sum over the axes its all-reduces would run on, and the op communicates
    nothing; a consumer that needs the value whole pays the all-reduce
    (`resharding._pending_sums`), once for all the sums added up on the way (GSPMD's partial
    layouts; Shardy's `unreduced` axes). None where the strategy reduces nothing."""
    if len(strategy.result_specs) != 1 or strategy.result_specs[0] is None or not strategy.collectives:
        return None
    if any(c.kind != "all-reduce" for c in strategy.collectives):
        return None
    reduced = {a for c in strategy.collectives for a in c.axes}
    spec = strategy.result_specs[0]
    pending = ShardingSpec(spec.dims, tuple(a.name for a in mesh.axes if a.name in reduced or a.name in spec.unreduced))
    return replace(strategy, result_specs=(pending,), collectives=(), communication_cost=0.0, scattered_dim=None)


def pending_operand_variants(strategy: Strategy, linear: Sequence[Sequence[int]], mesh: LogicalMesh) -> list[Strategy]:
    """Variants of a strategy of an op linear in some of its operands that read pending sums
    and leave them pending: for each set of mesh axes the strategy splits nothing over, and
    each group of operands in `linear` (an op linear in them together: `add`'s two operands,
    `reduce`'s input and its zero; or in one at a time: `multiply`'s), those operands and the
    result are pending over the axes. The rest of the op is unchanged: a sum of the op over
    addends is the op of the sum."""
    if len(strategy.result_specs) != 1 or strategy.result_specs[0] is None:
        return []
    used = {a for axes in strategy.factor_axes for a in axes}
    spec = strategy.result_specs[0]
    free = [a.name for a in mesh.axes if a.size > 1 and a.name not in used and a.name not in spec.unreduced]
    variants = []
    for count in range(1, len(free) + 1):
        for axes in itertools.combinations(free, count):
            for group in linear:
                if any(strategy.operand_specs[k] is None for k in group):
                    continue
                operands = tuple(
                    ShardingSpec(o.dims, axes) if k in group and o is not None else o
                    for k, o in enumerate(strategy.operand_specs)
                )
                variants.append(
                    replace(strategy, operand_specs=operands, result_specs=(ShardingSpec(spec.dims, axes),))
                )
    return variants


def replicated_strategy(
    operands: Sequence[TensorInfo], results: Sequence[TensorInfo], mesh: LogicalMesh, flops: float = 0.0
) -> Strategy:
    """The safe strategy for an op nobody knows how to split: everything whole on every device."""

    def spec(info: TensorInfo) -> ShardingSpec | None:
        return ShardingSpec.replicated(len(info.shape)) if info.is_tensor else None

    result_specs = tuple(spec(r) for r in results)
    memory = float(sum(per_device_bytes(r.shape, r.dtype_bytes, s, mesh) for r, s in zip(results, result_specs) if s))
    return Strategy(
        factor_axes=(),
        operand_specs=tuple(spec(o) for o in operands),
        result_specs=result_specs,
        collectives=(),
        communication_cost=0.0,
        compute_cost=mesh.compute_seconds(flops, memory if flops else 0.0),
        memory=memory,
    )


def strategy_for(
    rule: OpRule,
    factor_axes: tuple[tuple[str, ...], ...],
    operands: Sequence[TensorInfo],
    results: Sequence[TensorInfo],
    mesh: LogicalMesh,
    flops: float = 0.0,
) -> Strategy:
    """The strategy that splits each factor over the given axes (assumed valid)."""
    operand_specs = tuple(
        spec_of(t, factor_axes) if info.is_tensor else None for t, info in zip(rule.operands, operands)
    )
    result_specs = tuple(spec_of(t, factor_axes) if info.is_tensor else None for t, info in zip(rule.results, results))
    # One all-reduce per split reduction factor, as XLA's partitioner does (a reduce over two
    # dims split over x and y is an all-reduce over x and another over y, not one over both).
    reductions = [
        tuple(a.name for a in mesh.axes if a.name in factor_axes[f])  # mesh order
        for f in sorted(rule.reduction)
        if factor_axes[f]
    ]
    result_bytes = [
        per_device_bytes(info.shape, info.dtype_bytes, spec, mesh)
        for info, spec in zip(results, result_specs)
        if spec is not None
    ]
    collectives = tuple(Collective("all-reduce", axes, nbytes) for axes in reductions for nbytes in result_bytes)
    used = {a for axes in factor_axes for a in axes}
    parallelism = math.prod(mesh.axis(a).size for a in used) if used else 1
    return Strategy(
        factor_axes=factor_axes,
        operand_specs=operand_specs,
        result_specs=result_specs,
        collectives=collectives,
        communication_cost=sum(c.cost(mesh) for c in collectives),
        compute_cost=(
            mesh.compute_seconds(flops / parallelism, sum(result_bytes))
            if flops and mesh.device_memory_bandwidth
            else flops / parallelism / mesh.device_flops  # compute_seconds without bytes, inlined: the hot path
        ),
        memory=float(sum(result_bytes)),
    )
