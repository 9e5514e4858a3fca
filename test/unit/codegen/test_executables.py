"""Executables keep their values on the devices, and consume the buffers they are donated."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from microbatch_steps import run_pipeline, step_data

from hlopar.codegen.executables import (
    ALIASING_OUTPUT,
    BUFFER_DONOR,
    accumulating_module,
    compile_executable,
    set_donation,
)
from hlopar.codegen.fragments import fragment_modules
from hlopar.ir.module import parse_module, print_module

SHARDED = """
sdy.mesh @mesh = <["x"=2]>
func.func @main(%g: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, %w: tensor<4xf32>)
    -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, tensor<4xf32>) {
  %t = stablehlo.tanh %g : tensor<8x4xf32>
  %n = stablehlo.negate %w : tensor<4xf32>
  return %t, %n : tensor<8x4xf32>, tensor<4xf32>
}
"""


def test_accumulator_is_donated_and_consumed():
    module = accumulating_module(parse_module(SHARDED), [0])
    text = print_module(module)
    assert f"{ALIASING_OUTPUT} = 0 : i32" in text and "call" not in text
    executable = compile_executable(module, jax.devices()[:2])
    assert executable.donated == {0}
    g = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
    w = np.ones(4, np.float32)
    acc = executable.place(0, np.full((8, 4), 2.0, np.float32))
    gradient = executable.place(1, g)
    first, second = executable.run([acc, gradient, w])
    assert acc.is_deleted() and not gradient.is_deleted()
    np.testing.assert_allclose(np.asarray(first), 2.0 + np.tanh(g), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(second), -w)
    assert first.sharding == executable.output_shardings[0]
    # The running sum is fed back: each run consumes the previous one.
    again, _ = executable.run([first, gradient, w])
    assert first.is_deleted()
    np.testing.assert_allclose(np.asarray(again), 2.0 + 2 * np.tanh(g), rtol=1e-6)


def test_kept_results_come_back_as_they_are():
    module = accumulating_module(parse_module(SHARDED), [0, 1], keep=[1])
    executable = compile_executable(module, jax.devices()[:2])
    g, w = np.ones((8, 4), np.float32), np.ones(4, np.float32)
    total, negated, raw = executable(np.zeros((8, 4), np.float32), np.full(4, 5.0, np.float32), g, w)
    np.testing.assert_allclose(total, np.tanh(g), rtol=1e-6)
    np.testing.assert_allclose(negated, 5.0 - w)
    np.testing.assert_allclose(raw, -w)


def test_set_donation_writes_what_jax_writes():
    module = parse_module(SHARDED)
    set_donation(module, {0: 0, 1: None})
    text = print_module(module)
    assert f"{ALIASING_OUTPUT} = 0 : i32" in text and f"{BUFFER_DONOR} = true" in text
    executable = compile_executable(module, jax.devices()[:2])
    g = executable.place(0, np.ones((8, 4), np.float32))
    executable.run([g, np.ones(4, np.float32)])
    assert g.is_deleted()
    with pytest.raises(ValueError, match="cannot alias result 0"):
        set_donation(parse_module(SHARDED), {1: 0})


def test_fragments_compile_with_accumulation():
    """A backward fragment of a planned pipeline, compiled to sum its outputs in place."""
    text = step_data("mlp")[0]
    module = run_pipeline(
        text,
        "hlopar-split-microbatches{microbatches=2},hlopar-cluster-operators,"
        "hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 workers=1}",
    )
    main = next(op.operation for op in module.regions[0].blocks[0].operations if op.operation.name == "func.func")
    backward = [f for f in fragment_modules(main) if '"(1)' in str(f.fragment.attributes["origin"])][0]
    count = len(backward.fragment.results)
    executable = compile_executable(accumulating_module(backward.module, list(range(count))), jax.devices()[:4])
    assert executable.donated == set(range(count))
    # Run on random values: each result is its accumulator plus what the fragment computes.
    plain = compile_executable(backward.module, jax.devices()[:4])
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(shape).astype(dtype) for shape, dtype in executable.spmd.input_types]
    summed = executable(*values)
    alone = plain(*values[count:])
    assert len(summed) == len(alone) == count
    for total, accumulator, result in zip(summed, values, alone):
        np.testing.assert_allclose(total, accumulator + result, rtol=1e-6, atol=1e-7)


def test_arrays_in_host_memory_are_placed_without_compiling(monkeypatch):
    """A CPU device's array (the caller's, on device 0) is placed from host memory, piece by
    piece: jax's device_put between devices would compile a move program per layout (the
    tiny GPT's first step: 7 of them, 0.3 s; docs/performance.md)."""
    from jax._src import compiler

    executable = compile_executable(parse_module(SHARDED), jax.devices()[2:4])
    compiled = []
    original = compiler.backend_compile_and_load
    monkeypatch.setattr(compiler, "backend_compile_and_load", lambda *a, **k: compiled.append(1) or original(*a, **k))
    g = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), jax.devices()[0])
    placed = executable.place(0, g)
    assert compiled == []
    assert placed.sharding == executable.input_shardings[0]
    assert [s.device for s in placed.addressable_shards] == list(jax.devices()[2:4])
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(g))
    assert executable.place(0, placed) is placed  # already laid out: as it is


def test_an_equivalent_layout_is_read_as_it_is(monkeypatch):
    """`P("x")` and `P("x", None)` on a (8, 4) array are the same pieces on the same devices:
    the executable reads the array as it is, no copy through host memory (what
    `fragment_calls.Placements` expects of it); its results are those of the array placed
    from host memory, to the bit."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hlopar.codegen import executables

    executable = compile_executable(parse_module(SHARDED), jax.devices()[:2])
    layout = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), PartitionSpec("x"))
    g = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4) / 32, layout)
    assert g.sharding != executable.input_shardings[0]
    assert g.sharding.is_equivalent_to(executable.input_shardings[0], 2)
    puts = []
    original = executables.jax.device_put
    monkeypatch.setattr(executables.jax, "device_put", lambda *a, **k: puts.append(1) or original(*a, **k))
    assert executable.place(0, g) is g
    assert puts == []
    w = np.ones(4, np.float32)
    as_it_is = executable.run([g, w])
    from_host = executable.run([np.asarray(g), w])  # laid out from host memory, as before
    for a, b in zip(as_it_is, from_host):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
