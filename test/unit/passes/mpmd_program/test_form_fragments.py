"""Grouping ops into fragments: one per group when the groups allow it, never a cycle."""

from __future__ import annotations

import random

import pytest

from hlopar.passes.mpmd_program import form_fragments


def check(reads, keys, fragments) -> None:
    placed = [op for fragment in fragments for op in fragment]
    assert sorted(placed) == [i for i, k in enumerate(keys) if k is not None]
    position = {op: f for f, fragment in enumerate(fragments) for op in fragment}
    for fragment in fragments:
        assert list(fragment) == sorted(fragment)
        assert len({keys[op] for op in fragment}) == 1
        for op in fragment:
            for source in reads[op]:
                if keys[source] is not None:
                    assert position[source] <= position[op], "a fragment reads a later one"


def quotient_is_acyclic(reads, keys) -> bool:
    edges = {
        (keys[s], keys[op])
        for op in range(len(keys))
        for s in reads[op]
        if keys[op] is not None and keys[s] is not None and keys[s] != keys[op]
    }
    nodes = {k for k in keys if k is not None}
    indegree = {n: 0 for n in nodes}
    for _, b in edges:
        indegree[b] += 1
    ready = [n for n in nodes if not indegree[n]]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for a, b in edges:
            if a == n:
                indegree[b] -= 1
                if not indegree[b]:
                    ready.append(b)
    return seen == len(nodes)


def test_contiguous_groups():
    reads = [set(), {0}, {1}, {2}]
    assert form_fragments(reads, ["a", "a", "b", "b"]) == [(0, 1), (2, 3)]


def test_interleaved_groups_without_cycle_stay_one_fragment_each():
    # b, a, b where only the last b reads a: a goes first, then both b ops together.
    reads = [set(), set(), {1}]
    assert form_fragments(reads, ["b", "a", "b"]) == [(1,), (0, 2)]


def test_cycle_splits_the_group():
    # a -> b -> a: the second a op cannot join the first fragment.
    reads = [set(), {0}, {1}]
    assert form_fragments(reads, ["a", "b", "a"]) == [(0,), (1,), (2,)]


def test_left_out_ops_are_ignored():
    reads = [set(), {0}, {0, 1}]
    assert form_fragments(reads, [None, "a", "b"]) == [(1,), (2,)]


@pytest.mark.parametrize("seed", range(200))
def test_random_graphs(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 25)
    groups = rng.randint(1, 5)
    keys = [
        rng.choice([None] + list(range(groups))) if rng.random() < 0.1 else rng.randrange(groups) for _ in range(count)
    ]
    reads = [{s for s in range(i) if rng.random() < 0.15} for i in range(count)]
    fragments = form_fragments(reads, keys)
    check(reads, keys, fragments)
    if quotient_is_acyclic(reads, keys):
        assert len(fragments) == len({k for k in keys if k is not None})
