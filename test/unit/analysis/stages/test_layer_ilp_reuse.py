"""The shortcuts that make the layer ILPs cheaper to build change nothing: a restricted
problem is the element-wise restriction, and a build that reuses another build's strategy
cache is the fresh build, number for number."""

from __future__ import annotations

from test_layer_costs import gpt_layers

from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.auto_sharding.graph_problem import StrategyCache, build_problem
from hlopar.analysis.stages.layer_costs import _restricted, _split_state_choices

MESH = logical_mesh((2, 4), ("x", "y"))


def _reference_restriction(problem, allowed):
    def pick(v, seq):
        return tuple(seq[k] for k in allowed[v]) if v in allowed and seq else tuple(seq)

    return [(v, pick(v, node.costs), pick(v, node.memory)) for v, node in enumerate(problem.nodes)], [
        (e.src, e.dst, tuple(pick(e.dst, row) for row in pick(e.src, e.costs))) for e in problem.edges
    ]


def test_restricted_problem_is_the_element_wise_restriction_and_shares_matrices():
    _, _, layers, rules, _ = gpt_layers()
    layer = layers[1]
    built = build_problem(layer, rules, MESH)
    allowed = _split_state_choices(layer, built)
    assert allowed
    restricted = _restricted(built.problem, allowed)
    nodes, edges = _reference_restriction(built.problem, allowed)
    assert [(v, n.costs, n.memory) for v, n in enumerate(restricted.nodes)] == nodes
    assert [(e.src, e.dst, e.costs) for e in restricted.edges] == edges
    # Edges that shared one matrix object (and restriction) still share one.
    shared = {}
    for old, new in zip(built.problem.edges, restricted.edges):
        key = (id(old.costs), id(allowed.get(old.src)), id(allowed.get(old.dst)))
        assert shared.setdefault(key, new.costs) is new.costs


def test_build_with_a_shared_cache_equals_a_fresh_build():
    _, _, layers, rules, _ = gpt_layers()
    cache = StrategyCache(MESH)
    for layer in layers:
        build_problem(layer, rules, MESH, cache=cache)
    for layer in layers:
        assert build_problem(layer, rules, MESH, cache=cache).problem == build_problem(layer, rules, MESH).problem
