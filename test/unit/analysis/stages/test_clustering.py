"""Operator clustering (Alpa Eq. 6): the DP against brute force, the tie-break, δ relaxation, auto L."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from hlopar.analysis.stages.clustering import brute_force_clustering, choose_num_layers, cluster_operators


def _random_instance(rng: random.Random, num_ops: int):
    flops = [rng.choice([0, 1, 2, 3, 5, 10]) for _ in range(num_ops)]
    values = []
    for producer in range(num_ops - 1):
        for _ in range(rng.randint(0, 2)):
            readers = rng.sample(range(producer + 1, num_ops), rng.randint(1, min(3, num_ops - producer - 1)))
            values.append((producer, readers, rng.choice([1, 2, 3, 8])))
    return flops, values


@pytest.mark.parametrize("seed", range(400))
def test_dp_equals_brute_force(seed):
    """Both objectives (max input bytes, then Σ FLOP^2) and the cut itself (integer FLOPs: exact ties)."""
    rng = random.Random(seed)
    num_ops = rng.randint(1, 9)
    num_layers = rng.randint(1, min(4, num_ops))
    flops, values = _random_instance(rng, num_ops)
    delta = rng.choice([0.0, 0.1, 0.5, 1.0])
    got = cluster_operators(flops, values, num_layers, delta)
    want = brute_force_clustering(flops, values, num_layers, delta)
    assert got == want
    assert got.num_layers == num_layers
    assert got.max_input_bytes == max(got.layer_input_bytes)
    assert sum(got.layer_flops) == sum(flops)


def test_cheapest_cut_wins_and_a_value_counts_once_per_layer():
    # chain 0→1→2→3→4→5 of 10-byte values, except 2→3 which is 1 byte; op 0's 100-byte value
    # feeds ops 1 and 2, so cutting before 1 or 2 is expensive.
    flops = [1] * 6
    values = [(0, [1, 2], 100), (1, [2], 10), (2, [3], 1), (3, [4], 10), (4, [5], 10)]
    got = cluster_operators(flops, values, 2)
    assert got.boundaries == (0, 3)
    assert got.layer_input_bytes == (0, 1)
    assert got.layer_of_op == (0, 0, 0, 1, 1, 1)
    # op 0's value read by ops 1 and 2, both in layer 1, is received once; the tie between the
    # two cuts (equal variance) goes to the last layer starting earliest
    three = cluster_operators([1, 1, 1], [(0, [1, 2], 100)], 2, delta=3.0)
    assert three.boundaries == (0, 1)
    assert three.layer_input_bytes == (0, 100)


def test_variance_tie_break():
    # no edges: every cut costs 0, so the most even split wins
    got = cluster_operators([4, 1, 1, 1, 1, 4], [], 2, delta=1.0)
    assert got.boundaries == (0, 3)
    assert got.layer_flops == (6.0, 6.0)
    assert got.flop_variance == 0.0
    assert got.flop_sum_squares == 72.0


def test_heavy_op_raises_the_cap_instead_of_failing():
    flops = [1, 1, 100, 1, 1, 1]
    got = cluster_operators(flops, [(k, [k + 1], 1) for k in range(5)], 3, delta=0.1)
    assert got.num_layers == 3
    assert got.delta > 0.1
    assert max(got.layer_flops) <= (1 + got.delta) * sum(flops) / 3 + 1e-9
    assert got == brute_force_clustering(flops, [(k, [k + 1], 1) for k in range(5)], 3, delta=0.1)


def test_delta_doubles_when_ops_cannot_be_packed():
    # δ = 0: cap 2 per layer, and [2], [1], [2], [1] cannot go into 3 layers of at most 2
    flops = [2, 1, 2, 1]
    got = cluster_operators(flops, [], 3, delta=0.0)
    assert got.num_layers == 3
    assert got.delta > 0.0
    assert got == brute_force_clustering(flops, [], 3, delta=0.0)


def test_zero_flops_program():
    got = cluster_operators([0, 0, 0], [(0, [1], 4), (1, [2], 4)], 3)
    assert got.boundaries == (0, 1, 2)
    assert got.max_input_bytes == 4


@pytest.mark.parametrize(
    "flops, values, layers, message",
    [
        ([1, 1], [], 3, "cannot cluster 2 operators into 3"),
        ([1, 1], [], 0, "cannot cluster"),
        ([], [], 1, "non-empty"),
        ([1, -1], [], 1, "non-negative"),
        ([1, 1], [(2, [1], 1)], 1, "producer 2"),
        ([1, 1], [(1, [0], 1)], 1, "topological"),
        ([1, 1], [(0, [1], -5)], 1, "negative size"),
    ],
)
def test_errors(flops, values, layers, message):
    with pytest.raises(ValueError, match=message):
        cluster_operators(flops, values, layers)


def _transformer_like(blocks: int, ops_per_block: int = 12):
    """A residual stream (1 unit) cut cheaply only between blocks; inside a block every cut
    crosses 4 units (the block's wide activations) besides the stream."""
    flops, values, heavy = [], [], []
    for b in range(blocks):
        base = b * ops_per_block
        for j in range(ops_per_block):
            is_heavy = j % 3 == 1
            flops.append(100.0 if is_heavy else 1.0)
            heavy.append(is_heavy)
            op = base + j
            if op < blocks * ops_per_block - 1:
                values.append((op, [op + 1], 4 if j < ops_per_block - 1 else 1))
        if b > 0:
            values.append((base - 1, [base + ops_per_block - 1], 1))  # residual add at block end
    return flops, values, heavy


def test_choose_num_layers_stops_at_block_boundaries():
    flops, values, heavy = _transformer_like(6)
    assert sum(heavy) == 24
    assert choose_num_layers(flops, values, max_layers=64, heavy=heavy) == 6
    assert choose_num_layers(flops, values, max_layers=4, heavy=heavy) == 4
    clustering = cluster_operators(flops, values, 6)
    assert clustering.boundaries == tuple(range(0, 72, 12))


def test_choose_num_layers_uniform_chain_uses_every_heavy_op():
    flops = [10.0 if k % 2 else 1.0 for k in range(40)]
    values = [(k, [k + 1], 8) for k in range(39)]
    heavy = [k % 2 == 1 for k in range(40)]
    assert choose_num_layers(flops, values, max_layers=64, heavy=heavy) == 20
    assert choose_num_layers(flops, values, max_layers=7, heavy=heavy) == 7


def test_choose_num_layers_edges():
    assert choose_num_layers([1.0] * 5, [], max_layers=8, heavy=[False] * 5) == 1
    assert choose_num_layers([1.0] * 5, [], max_layers=8, heavy=[True, False, True, False, False]) == 2
    with pytest.raises(ValueError, match="heavy has 2 entries"):
        choose_num_layers([1.0] * 5, [], max_layers=8, heavy=[True, True])
    with pytest.raises(ValueError, match="max_layers"):
        choose_num_layers([1.0] * 5, [], max_layers=0, heavy=[True] * 5)


def synthetic_program(num_ops: int, block: int = 400, seed: int = 0):
    """A long program: 10% heavy ops, a chain, short skips and one long skip per block."""
    rng = np.random.default_rng(seed)
    flops = np.where(rng.random(num_ops) < 0.1, 1e9, 1e5) * rng.uniform(0.5, 1.5, num_ops)
    values = []
    for producer in range(num_ops - 1):
        readers = [producer + 1]
        if rng.random() < 0.3:
            readers.append(min(num_ops - 1, producer + int(rng.integers(2, 30))))
        if producer % block == 0:
            readers.append(min(num_ops - 1, producer + block))
        values.append((producer, readers, int(rng.integers(1, 4)) * 1_000_000))
    return [float(f) for f in flops], values, [bool(f > 1e8) for f in flops]


@pytest.mark.heavy
@pytest.mark.parametrize("num_layers", [64, 8])
def test_speed_twenty_thousand_ops(num_layers):
    """Target: K = 20,000, L <= 64 in a few seconds (measured ~0.6-1 s on 2 shared cores)."""
    flops, values, heavy = synthetic_program(20_000)
    start = time.perf_counter()
    clustering = cluster_operators(flops, values, num_layers)
    elapsed = time.perf_counter() - start
    print(f"cluster_operators K=20000 L={num_layers}: {elapsed:.2f}s")
    assert clustering.num_layers == num_layers
    assert elapsed < 6.0
    start = time.perf_counter()
    choose_num_layers(flops, values, max_layers=64, heavy=heavy)
    assert time.perf_counter() - start < 2.0


def _reference(flops, values, num_layers, cap):
    """Eq. 6 and the variance tie-break as plain loops over the definition of C(i, k)."""
    num_ops = len(flops)

    def inputs(i, k):
        return sum(b for p, readers, b in values if p < i and any(i <= r <= k for r in readers))

    def fits(i, k):
        return sum(flops[i : k + 1]) <= cap

    inf = float("inf")
    best = [[inf] * (num_ops + 1) for _ in range(num_layers + 1)]
    best[0][0] = 0
    for r in range(1, num_layers + 1):
        for n in range(1, num_ops + 1):
            best[r][n] = min((max(best[r - 1][i], inputs(i, n - 1)) for i in range(n) if fits(i, n - 1)), default=inf)
    target = best[num_layers][num_ops]
    squares = [[inf] * (num_ops + 1) for _ in range(num_layers + 1)]
    squares[0][0] = 0
    for r in range(1, num_layers + 1):
        for n in range(1, num_ops + 1):
            squares[r][n] = min(
                (
                    squares[r - 1][i] + sum(flops[i:n]) ** 2
                    for i in range(n)
                    if fits(i, n - 1) and inputs(i, n - 1) <= target
                ),
                default=inf,
            )
    return target, squares[num_layers][num_ops]


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_reference_on_larger_programs(seed):
    rng = random.Random(1000 + seed)
    num_ops = rng.randint(20, 36)
    num_layers = rng.randint(2, 7)
    flops = [rng.choice([1, 2, 3, 20]) for _ in range(num_ops)]
    values = []
    for producer in range(num_ops - 1):
        extra = min(rng.randint(0, 2), num_ops - producer - 1)
        readers = [producer + 1] + rng.sample(range(producer + 1, num_ops), extra)
        values.append((producer, readers, rng.choice([1, 2, 5, 9])))
    got = cluster_operators(flops, values, num_layers, delta=1.0)
    # Where δ = 1 admits no clustering, the pass relaxes it and reports the δ it used: the
    # reference is held to that cap (no seed is left out).
    cap = (1.0 + got.delta) * sum(flops) / num_layers * (1 + 1e-9)
    assert (got.max_input_bytes, got.flop_sum_squares) == _reference(flops, values, num_layers, cap)
