"""`while` loops are planned inside: carried values keep one layout, body ops are split too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hlopar.analysis.auto_sharding.graph_problem import trip_count
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline


def looped(x, w):
    def body(_, h):
        return jnp.tanh(h @ w)

    return jax.lax.fori_loop(0, 6, body, x).sum()


def test_fori_loop_is_planned_inside_and_computes_the_same():
    x = np.random.default_rng(0).normal(size=(512, 256)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(256, 256)).astype(np.float32) / 16
    module = parse_module(jax.jit(looped).lower(x, w).as_text())
    context = PassContext()
    pipeline = "builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 latency=0,0 report=/dev/null})"
    Pipeline.parse(pipeline, module.context).run(module, context)
    assert not [d for d in context.diagnostics if "while" in d.message], context.diagnostics

    graph = FuncGraph.from_module(module)
    (loop,) = [op for op in graph.ops if op.name == "stablehlo.while"]
    assert trip_count(graph, loop) == 6
    body_dots = [op for op in loop.walk() if op.name == "stablehlo.dot_general"]
    assert body_dots and all("sdy.sharding" in op.mlir_op.attributes for op in body_dots)
    text = print_module(module)
    assert '{"x"' in text or '{"y"' in text

    (expected,) = [np.asarray(jax.jit(looped)(x, w))]
    (actual,) = compile_spmd(module, jax.devices()[:8])(x, w)
    np.testing.assert_allclose(actual, expected, rtol=1e-4)


def test_trip_count_falls_back_to_one_when_the_bound_is_not_constant():
    def dynamic(x, n):
        return jax.lax.fori_loop(0, n, lambda _, h: h * 2.0, x)

    module = parse_module(jax.jit(dynamic).lower(jnp.ones(4), 3).as_text())
    graph = FuncGraph.from_module(module)
    (loop,) = [op for op in graph.walk() if op.name == "stablehlo.while"]
    assert trip_count(graph, loop) == 1


def test_switch_branches_are_planned_and_compute_the_same():
    def switched(index, x, w):
        branches = [lambda h: jnp.tanh(h @ w), lambda h: jax.nn.relu(h @ w.T), lambda h: h * 2.0]
        return jax.lax.switch(index, branches, x).sum(axis=1)

    x = np.random.default_rng(0).normal(size=(512, 256)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(256, 256)).astype(np.float32) / 16
    module = parse_module(jax.jit(switched).lower(np.int32(1), x, w).as_text())
    context = PassContext()
    pipeline = "builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4 latency=0,0})"
    Pipeline.parse(pipeline, module.context).run(module, context)
    assert not [d for d in context.diagnostics if "case" in d.message], context.diagnostics
    graph = FuncGraph.from_module(module)
    (case,) = [op for op in graph.ops if op.name == "stablehlo.case"]
    assert all("sdy.sharding" in op.mlir_op.attributes for op in case.walk() if op.name == "stablehlo.dot_general")
    executable = compile_spmd(module, jax.devices()[:8])
    for index in range(3):
        (actual,) = executable(np.int32(index), x, w)
        np.testing.assert_allclose(actual, np.asarray(jax.jit(switched)(index, x, w)), rtol=1e-4, atol=1e-5)
