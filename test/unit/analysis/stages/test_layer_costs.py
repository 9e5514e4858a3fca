"""Per-layer intra-op plans for stage construction: one build serves both intra-op options,
identical layers and equivalent meshes share one solve, and renamed plans stay valid."""

from __future__ import annotations

import functools

import pytest
from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.auto_sharding.graph_problem import build_problem
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.analysis.stages.layer_costs import (
    layer_dims,
    plan_key,
    plan_layer,
    plan_layer_options,
    plan_layers,
    useful_axes,
)
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions, run_function_pass
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.pipeline import Pipeline


@functools.cache
def gpt_layers():
    module = parse_module(get_train_step("gpt", "tiny").lower())
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    graph = FuncGraph.from_module(module)  # reads the live IR: the module is kept alive with it
    with module.context, ir.Location.unknown():
        layering, _ = ClusterOperatorsPass(layers=4).cluster(graph)
        func = planned_functions(module)[0]
        run_function_pass(module, [func], "sdy-populate-op-sharding-rules")
        rules = {op.id: rule_of(op.mlir_op) for op in graph.walk()}
    layers = [graph.subgraph([op.index for op in graph.ops if layering.layers[op.index] == l]) for l in range(4)]
    return module, graph, layers, rules, layering.roles


def test_weight_update_sharding_from_one_build_equals_a_build_with_split_arguments():
    module, graph, layers, rules, roles = gpt_layers()
    mesh = logical_mesh((2, 4), ("x", "y"), latencies=(0.0, 0.0))
    layer = layers[1]
    default, split = plan_layer_options(layer, rules, roles, mesh, (False, True))
    positions = frozenset(k for k, v in enumerate(layer.args) if layer.values[v].is_arg)
    direct = ilp.solve(build_problem(layer, rules, mesh, split_args=positions, merge=True).problem)
    assert split.latency == pytest.approx(direct.objective, rel=1e-6)
    assert default.latency == pytest.approx(plan_layer(layer, rules, roles, mesh).latency, rel=1e-6)
    # Splitting the state costs time and saves memory.
    assert split.latency >= default.latency - 1e-12
    assert split.state_bytes <= default.state_bytes
    for spec, v in zip(split.arg_layouts, layer.args):
        shape = layer.values[v].shape
        if layer.values[v].is_arg and shape and any(d % 2 == 0 for d in shape):
            assert spec is not None and not spec.is_replicated, f"state argument {v} left whole"


def test_axes_that_divide_no_dimension_are_not_planned_twice():
    _, _, layers, rules, roles = gpt_layers()
    dims = layer_dims(layers[1])
    assert 3 not in dims and all(d % 3 for d in dims)
    wide = logical_mesh((3, 4), ("x", "y"))
    narrow = logical_mesh((1, 4), ("a", "b"))
    assert useful_axes(wide, dims) == ("y",)
    assert plan_key(wide, dims) == plan_key(narrow, dims)
    table = plan_layers(layers, rules, roles, [(wide, False), (narrow, False)], workers=1)
    # Where x can split nothing, the 3x4 plan is the 1x4 plan with its axis renamed.
    for layer, (a, b) in zip(layers, table.plans):
        if plan_key(wide, layer_dims(layer)) != plan_key(narrow, layer_dims(layer)):
            continue
        assert a.latency == pytest.approx(b.latency)
        assert [None if s is None else s.dims for s in a.arg_layouts] == [
            None if s is None else tuple(tuple({"b": "y"}.get(n, n) for n in axes) for axes in s.dims)
            for s in b.arg_layouts
        ]
    keys = {plan_key(wide, layer_dims(layer)) != plan_key(narrow, layer_dims(layer)) for layer in layers}
    assert False in keys
    assert table.solved < 2 * len(layers)  # the second mesh costs no solve where keys agree


def test_forked_workers_give_the_same_table():
    _, _, layers, rules, roles = gpt_layers()
    meshes = [(logical_mesh(shape, ("x", "y")), split) for shape in ((1, 2), (2, 2), (1, 4)) for split in (False, True)]
    serial = plan_layers(layers, rules, roles, meshes, workers=1)
    forked = plan_layers(layers, rules, roles, meshes, workers=2)
    assert [[p.latency for p in row] for row in serial.plans] == [[p.latency for p in row] for row in forked.plans]
    assert serial.solved == forked.solved
