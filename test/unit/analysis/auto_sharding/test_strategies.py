"""Strategies from op rules: Table 3 of the Alpa paper, compound (reshaped) dims, N-D meshes."""

from __future__ import annotations

import dataclasses

import pytest

from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.auto_sharding.collectives import Collective
from hlopar.analysis.auto_sharding.rules import OpRule
from hlopar.analysis.auto_sharding.strategies import (
    TensorInfo,
    enumerate_strategies,
    pending_operand_variants,
    pending_result_variant,
)
from hlopar.analysis.sharding import ShardingSpec

# C[b,i,j] = sum_k A[b,i,k] B[b,k,j]: factors b=0, i=1, j=2, k=3 (Table 3's batched matmul).
BMM = OpRule(
    factor_sizes=(8, 16, 32, 64),
    operands=(((0,), (1,), (3,)), ((0,), (3,), (2,))),
    results=(((0,), (1,), (2,)),),
    reduction=frozenset({3}),
)
A, B, C = TensorInfo((8, 16, 64), 4), TensorInfo((8, 64, 32), 4), TensorInfo((8, 16, 32), 4)


def spec(*dims: str) -> ShardingSpec:
    return ShardingSpec(tuple(tuple(d) for d in dims))


def by_specs(strategies):
    return {(s.operand_specs, s.result_specs): s for s in strategies}


def test_table_3_rows_are_all_there_with_their_costs():
    mesh = logical_mesh((2, 2), ("x", "y"))
    found = by_specs(enumerate_strategies(BMM, [A, B], [C], mesh, flops=2 * 8 * 16 * 32 * 64))
    m = 8 * 16 * 32 * 4  # bytes of C
    rows = [
        # (lhs, rhs, out, expected collectives): rows 1-7 of Table 3 with mesh axes 0 = x, 1 = y
        ((spec("", "x", ""), spec("", "", "y")), spec("", "x", "y"), ()),
        ((spec("", "x", "y"), spec("", "y", "")), spec("", "x", ""), (Collective("all-reduce", ("y",), m // 2),)),
        ((spec("", "", "y"), spec("", "y", "x")), spec("", "", "x"), (Collective("all-reduce", ("y",), m // 2),)),
        ((spec("x", "y", ""), spec("x", "", "")), spec("x", "y", ""), ()),
        ((spec("x", "", "y"), spec("x", "y", "")), spec("x", "", ""), (Collective("all-reduce", ("y",), m // 2),)),
        ((spec("", "xy", ""), spec("", "", "")), spec("", "xy", ""), ()),
        ((spec("", "", "xy"), spec("", "xy", "")), spec("", "", ""), (Collective("all-reduce", ("x", "y"), m),)),
    ]
    for operand_specs, result_spec, collectives in rows:
        strategy = found[(operand_specs, (result_spec,))]
        assert strategy.collectives == collectives
        # Every row splits the work over all 4 devices: equal compute cost.
        assert (
            strategy.compute_cost == found[((spec("", "x", ""), spec("", "", "y")), (spec("", "x", "y"),))].compute_cost
        )


def test_replicated_is_first_and_costs_the_full_compute():
    mesh = logical_mesh((2, 2), ("x", "y"))
    strategies = enumerate_strategies(BMM, [A, B], [C], mesh, flops=1e9)
    assert strategies[0].describe() == "replicated"
    full = max(s.compute_cost for s in strategies)
    assert strategies[0].compute_cost == full
    assert min(s.compute_cost for s in strategies) == full / 4  # split over both axes
    # 5 choices (none, b, i, j, k) per axis: 25 distinct strategies, plus reduce-scatter variants.
    assert len([s for s in strategies if s.scattered_dim is None]) == 25


def test_a_known_memory_bandwidth_prices_the_results_each_device_writes():
    """A roofline, added: FLOPs at the peak plus the bytes of results at the memory rate;
    without a bandwidth (the built-in presets) an op costs its FLOPs only, to the last bit."""
    plain = logical_mesh((2, 2), ("x", "y"))
    mesh = dataclasses.replace(plain, device_memory_bandwidth=1e9)
    flops = 2 * 8 * 16 * 32 * 64
    priced = by_specs(enumerate_strategies(BMM, [A, B], [C], mesh, flops=flops))
    unpriced = by_specs(enumerate_strategies(BMM, [A, B], [C], plain, flops=flops))
    assert priced.keys() == unpriced.keys()
    c_bytes = 8 * 16 * 32 * 4
    whole = {s.factor_axes: s for s in priced.values() if s.scattered_dim is None}
    for key, strategy in priced.items():
        before = unpriced[key]
        assert strategy.memory == before.memory
        # The product writes its partial sums whole; a reduce-scatter variant's result is
        # smaller, its kernel the same.
        written = whole[strategy.factor_axes].memory
        assert strategy.compute_cost == before.compute_cost + written / 1e9
    replicated = priced[((spec("", "", ""), spec("", "", "")), (spec("", "", ""),))]
    assert replicated.compute_cost == flops / plain.device_flops + c_bytes / 1e9
    split = priced[((spec("", "x", ""), spec("", "", "y")), (spec("", "x", "y"),))]
    assert split.compute_cost == flops / 4 / plain.device_flops + c_bytes / 4 / 1e9
    # What costs nothing to make (an argument's layouts) writes nothing.
    free = enumerate_strategies(OpRule.elementwise(C.shape, 0, 1), [], [C], mesh, flops=0.0)
    assert {s.compute_cost for s in free} == {0.0}
    assert mesh.compute_seconds(2e9, 3e9) == 2e9 / plain.device_flops + 3.0
    assert plain.compute_seconds(2e9, 3e9) == 2e9 / plain.device_flops
    with pytest.raises(ValueError, match="device_memory_bandwidth must be finite and >= 0"):
        dataclasses.replace(plain, device_memory_bandwidth=-1.0)


def test_partial_sums_can_be_reduce_scattered():
    mesh = logical_mesh((2, 2), ("x", "y"))
    found = by_specs(enumerate_strategies(BMM, [A, B], [C], mesh))
    m = 8 * 16 * 32 * 4
    # Table 3 row 2 (i -> x, k -> y), its all-reduce over y replaced by a reduce-scatter that
    # leaves the result split over y along j: half the communication.
    row_2 = found[((spec("", "x", "y"), spec("", "y", "")), (spec("", "x", ""),))]
    scattered = found[((spec("", "x", "y"), spec("", "y", "")), (spec("", "x", "y"),))]
    assert scattered.collectives == (Collective("reduce-scatter", ("y",), m // 2),)
    assert scattered.scattered_dim == 2
    assert scattered.communication_cost < row_2.communication_cost
    assert scattered.memory == row_2.memory / 2


def pending(spec_: ShardingSpec, *axes: str) -> ShardingSpec:
    return ShardingSpec(spec_.dims, axes)


def test_a_split_reduction_may_leave_its_sums_pending():
    mesh = logical_mesh((2, 2), ("x", "y"))
    found = by_specs(enumerate_strategies(BMM, [A, B], [C], mesh))
    row_2 = found[((spec("", "x", "y"), spec("", "y", "")), (spec("", "x", ""),))]
    left = pending_result_variant(row_2, mesh)
    assert left.result_specs == (pending(spec("", "x", ""), "y"),)
    assert left.operand_specs == row_2.operand_specs and left.factor_axes == row_2.factor_axes
    assert (left.collectives, left.communication_cost) == ((), 0.0)
    assert (left.compute_cost, left.memory) == (row_2.compute_cost, row_2.memory)
    # Reductions split over both axes: the sums pend over both, in mesh order.
    both = found[((spec("", "", "xy"), spec("", "xy", "")), (spec("", "", ""),))]
    assert pending_result_variant(both, mesh).result_specs == (pending(spec("", "", ""), "x", "y"),)
    # Nothing pends where nothing is reduced, nor where a reduce-scatter already scattered it.
    assert pending_result_variant(found[((spec("", "x", ""), spec("", "", "")), (spec("", "x", ""),))], mesh) is None
    scattered = found[((spec("", "x", "y"), spec("", "y", "")), (spec("", "x", "y"),))]
    assert pending_result_variant(scattered, mesh) is None


def test_linear_ops_carry_pending_sums_over_the_axes_they_do_not_split():
    mesh = logical_mesh((2, 2), ("x", "y"))
    info = TensorInfo((16, 32), 4)
    found = by_specs(enumerate_strategies(OpRule.elementwise((16, 32), 2), [info, info], [info], mesh))
    split_x = found[((spec("x", ""), spec("x", "")), (spec("x", ""),))]
    row = pending(spec("x", ""), "y")
    # add: both operands pend together; multiply: one at a time, the other whole along y.
    together = pending_operand_variants(split_x, ((0, 1),), mesh)
    assert [(s.operand_specs, s.result_specs) for s in together] == [((row, row), (row,))]
    one_at_a_time = pending_operand_variants(split_x, ((0,), (1,)), mesh)
    assert [s.operand_specs for s in one_at_a_time] == [(row, spec("x", "")), (spec("x", ""), row)]
    assert all(s.cost == split_x.cost and s.memory == split_x.memory for s in together + one_at_a_time)
    # A strategy that splits over no axis: sums pending over x, y or both.
    whole = found[((spec("", ""), spec("", "")), (spec("", ""),))]
    assert [s.result_specs[0].unreduced for s in pending_operand_variants(whole, ((0, 1),), mesh)] == [
        ("x",),
        ("y",),
        ("x", "y"),
    ]


def test_factors_that_do_not_divide_are_not_split():
    rule = OpRule.elementwise((3, 8), 1)
    mesh = logical_mesh((2,), ("x",))
    strategies = enumerate_strategies(rule, [TensorInfo((3, 8), 4)], [TensorInfo((3, 8), 4)], mesh)
    assert {s.result_specs[0] for s in strategies} == {spec("", ""), spec("", "x")}


def test_reshape_splits_only_the_major_factor_of_a_merged_dim():
    # (4, 6) -> (24,): factors i=4, j=6; the result dim is made of [i, j].
    rule = OpRule((4, 6), (((0,), (1,)),), (((0, 1),),))
    mesh = logical_mesh((2,), ("x",))
    strategies = enumerate_strategies(rule, [TensorInfo((4, 6), 4)], [TensorInfo((24,), 4)], mesh)
    results = {s.result_specs[0] for s in strategies}
    assert results == {spec(""), spec("x")}  # splitting j alone would not give contiguous tiles
    (split,) = [s for s in strategies if s.result_specs[0] == spec("x")]
    assert split.operand_specs == (spec("x", ""),)


def test_need_replication_and_three_axis_meshes():
    rule = OpRule((8, 8), (((0,), (1,)),), (((0,), (1,)),), need_replication=frozenset({1}))
    mesh = logical_mesh((2, 2, 2), ("x", "y", "z"))
    info = TensorInfo((8, 8), 4)
    strategies = enumerate_strategies(rule, [info], [info], mesh)
    assert strategies and all(not s.result_specs[0].dims[1] for s in strategies)
    assert spec("xyz", "") in {s.result_specs[0] for s in strategies}


def test_many_axis_meshes_give_a_factor_one_axis():
    """Shardy's tests plan on 7 axes of 2: every assignment would be 3^7 layouts of a 2-D
    value (and their square per edge); one axis per dimension is 1 + 2*7 + 7*6."""
    rule = OpRule.elementwise((32, 32), 1)
    info = TensorInfo((32, 32), 4)
    seven = logical_mesh((2,) * 7, tuple("abcdefg"))
    strategies = enumerate_strategies(rule, [info], [info], seven)
    assert len(strategies) == 1 + 2 * 7 + 7 * 6
    assert all(len(axes) <= 1 for s in strategies for axes in s.result_specs[0].dims)
    four = logical_mesh((2,) * 4, tuple("abcd"))  # up to 4 axes: every assignment
    assert spec("ab", "cd") in {s.result_specs[0] for s in enumerate_strategies(rule, [info], [info], four)}
