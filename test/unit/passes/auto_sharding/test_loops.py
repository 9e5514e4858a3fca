"""`while` loops are planned inside: carried values keep one layout, body ops are split too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hlopar.analysis.loops import trip_count
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
    dots = [op for op in case.walk() if op.name == "stablehlo.dot_general"]
    assert dots and all("sdy.sharding" in op.mlir_op.attributes for op in dots)
    executable = compile_spmd(module, jax.devices()[:8])
    for index in range(3):
        (actual,) = executable(np.int32(index), x, w)
        np.testing.assert_allclose(actual, np.asarray(jax.jit(switched)(index, x, w)), rtol=1e-4, atol=1e-5)


# A value converted to the loop's carried layout, and read in that layout again after the loop:
# the one conversion the plan writes (an sdy.sharding_constraint) must come before the loop.
CONVERTED_INTO_AND_AFTER_A_LOOP = """
module {
  sdy.mesh @mesh = <["x"=2, "y"=4]>
  func.func @main(%arg0: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) -> (tensor<16x16xf32>, tensor<16x16xf32>) {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %w:2 = stablehlo.while(%i = %c0, %h = %arg0) : tensor<i32>, tensor<16x16xf32>
      cond {
        %p = stablehlo.compare LT, %i, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %n = stablehlo.add %i, %c1 : tensor<i32>
        %h2 = stablehlo.multiply %h, %h {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"y"}]>]>} : tensor<16x16xf32>
        stablehlo.return %n, %h2 : tensor<i32>, tensor<16x16xf32>
      }
    %s = stablehlo.add %arg0, %w#1 {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"y"}]>]>} : tensor<16x16xf32>
    return %s, %w#1 : tensor<16x16xf32>, tensor<16x16xf32>
  }
}
"""


def test_a_conversion_shared_by_a_loop_and_a_later_op_comes_before_the_loop():
    module = parse_module(CONVERTED_INTO_AND_AFTER_A_LOOP)
    pipeline = "builtin.module(hlopar-import,hlopar-auto-sharding{mesh-shape=2x4})"
    Pipeline.parse(pipeline, module.context).run(module, PassContext())  # verifies the module
    graph = FuncGraph.from_module(module)
    names = [op.name for op in graph.ops]
    (loop,) = [i for i, name in enumerate(names) if name == "stablehlo.while"]
    assert "sdy.sharding_constraint" in names[:loop], names

    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(16, 16)).astype(np.float32)
    looped = x**8
    actual = compile_spmd(module, jax.devices()[:8])(x)
    np.testing.assert_allclose(actual[0], x + looped, rtol=1e-6)
    np.testing.assert_allclose(actual[1], looped, rtol=1e-6)
