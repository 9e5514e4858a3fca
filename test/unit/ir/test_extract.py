"""Cutting top-level ops out of a function into a module of their own."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.extract import boundary, extract_function
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module

PROGRAM = """
sdy.mesh @mesh = <["x"=2]>
func.func @main(%x: tensor<8x16xf32> {jax.arg_info = "x"}, %w: tensor<16x16xf32>, %k: tensor<i32>)
    -> (tensor<8x16xf32> {jax.result_info = "y"}, tensor<f32> {jax.result_info = "loss"}) {
  %c = stablehlo.constant dense<0.5> : tensor<f32>
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %1 = stablehlo.tanh %0 : tensor<8x16xf32>
  %2 = "stablehlo.case"(%k) ({
    stablehlo.return %1 : tensor<8x16xf32>
  }, {
    %n = stablehlo.negate %0 : tensor<8x16xf32>
    stablehlo.return %n : tensor<8x16xf32>
  }) : (tensor<i32>) -> tensor<8x16xf32>
  %3 = stablehlo.reduce(%2 init: %c) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x16xf32>, tensor<f32>) -> tensor<f32>
  return %2, %3 : tensor<8x16xf32>, tensor<f32>
}
"""


def graph():
    module = parse_module(PROGRAM)
    func = next(op.operation for op in module.regions[0].blocks[0].operations if op.operation.name == "func.func")
    return module, FuncGraph.from_func(func)


def arguments(k: int):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 16), np.float32), np.int32(k)]


def test_boundary_counts_values_read_inside_regions():
    _, g = graph()
    # The case op (3) reads %0 only inside a branch: %0 is an input of {3, 4}.
    inputs, outputs = boundary(g, {3, 4})
    assert inputs == (g.args[2], g.ops[2].results[0], g.ops[1].results[0], g.ops[0].results[0])
    assert outputs == (g.ops[3].results[0], g.ops[4].results[0])
    # The constant and %0 are read by ops outside {0, 1}: both leave.
    assert boundary(g, {0, 1}) == ((g.args[0], g.args[1]), (g.ops[0].results[0], g.ops[1].results[0]))


def test_extracted_function_verifies_and_keeps_symbols_and_attributes():
    _, g = graph()
    extraction = extract_function(g, [3, 4, 0], name="piece")
    assert extraction.ops == (0, 3, 4)
    extraction.module.verify()
    text = print_module(extraction.module)
    assert "sdy.mesh @mesh" in text
    assert "func.func @piece" in text
    assert 'jax.result_info = "y"' in text and 'jax.result_info = "loss"' in text
    assert print_module(parse_module(text)) == text


def test_pieces_compute_what_the_function_computes():
    module, g = graph()
    for k in (0, 1):
        expected = compile_spmd(module, jax.devices()[:2])(*arguments(k))
        tail_inputs, _ = boundary(g, [3, 4])
        tail = extract_function(g, [3, 4], inputs=tail_inputs)
        # The head returns what the tail reads, in the tail's order; arguments pass through.
        head = extract_function(g, [0, 1, 2], inputs=g.args, outputs=[v for v in tail_inputs if v not in g.args])
        values = dict(zip(g.args, arguments(k)))
        values.update(zip(head.outputs, compile_spmd(head.module, jax.devices()[:2])(*arguments(k))))
        actual = compile_spmd(tail.module, jax.devices()[:2])(*(values[v] for v in tail.inputs))
        for a, b in zip(actual, expected):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_missing_input_is_an_error():
    _, g = graph()
    with pytest.raises(ValueError, match="not an input"):
        extract_function(g, [3], inputs=[g.args[2], g.ops[2].results[0]])
