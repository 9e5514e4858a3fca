"""hlopar-import: the imported module computes what the original computes, on real devices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import backend
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib import _jax

from hlopar.corpus import corpus_dir
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[3]
CORPUS = corpus_dir()


def imported(text: str):
    module = parse_module(text, source_name="test.mlir")
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    return module


def run_module(text: str, args: list[jax.Array], devices) -> list[np.ndarray]:
    """Compiles module text with stock jaxlib for `devices` and runs it on sharded inputs."""
    options = backend.get_compile_options(
        num_replicas=1, num_partitions=len(devices), device_assignment=np.array([[d.id for d in devices]])
    )
    options.executable_build_options.use_shardy_partitioner = True
    options.executable_build_options.use_spmd_partitioning = len(devices) > 1
    executable = backend.get_backend().compile_and_load(text, _jax.DeviceList(tuple(devices)), options)
    outputs = executable.execute_sharded(list(args)).disassemble_into_single_device_arrays()
    return [[np.asarray(shard) for shard in per_device] for per_device in outputs]


def test_sharded_jax_program_keeps_its_shardings_and_numbers():
    devices = jax.devices()[:8]
    mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"))
    x_sharding = NamedSharding(mesh, P("x", "y"))

    @jax.jit
    def step(x, w):
        h = jnp.tanh(x @ w)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("x", None)))
        return jax.nn.gelu(h).sum(axis=1)

    x = jax.device_put(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32), x_sharding)
    w = jax.device_put(
        np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32), NamedSharding(mesh, P("y", None))
    )
    expected = np.asarray(step(x, w))
    module = imported(step.lower(x, w).as_text())
    text = print_module(module)
    assert "chlo." not in text and "func.call" not in text and " call @" not in text
    assert 'sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {"y"}]>' in text
    assert "sdy.sharding_constraint" in text
    outputs = run_module(text, [x, w], devices)
    # The result is sharded over "x" (2 shards of 8 rows), replicated over "y".
    shards = outputs[0]
    np.testing.assert_allclose(np.concatenate([shards[0], shards[4]]), expected, rtol=1e-5)
    for device_index in range(8):
        np.testing.assert_allclose(shards[device_index], shards[(device_index // 4) * 4], rtol=0)


def test_gspmd_strings_compile_with_the_same_layout():
    src = (ROOT / "test/lit/import/shardings.mlir").read_text().split("// -----")[0]
    module = imported(src)
    devices = jax.devices()[:8]
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    y = np.arange(16, dtype=np.float32)
    xa = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    ya = jax.device_put(y, NamedSharding(mesh, P()))
    (shards,) = run_module(print_module(module), [xa, ya], devices)
    # Result: {devices=[2,1,4]<=[8] last_tile_dim_replicate}: rows split in two, each half on 4 devices.
    for device_index, shard in enumerate(shards):
        half = device_index // 4
        np.testing.assert_array_equal(shard, (x + y)[half * 4 : (half + 1) * 4])


def test_nested_jit_is_inlined_into_one_main():
    @jax.jit
    def inner(a):
        return jnp.sin(a) * 2

    @jax.jit
    def outer(a):
        return inner(a) + inner(a + 1)

    a = jnp.arange(6.0)
    text = outer.lower(a).as_text()
    assert "call @" in text  # jax emits a private function for the inner jit
    module = imported(text)
    graph = FuncGraph.from_module(module)
    assert not any(op.name == "func.call" for op in graph.walk())
    funcs = [op for op in module.regions[0].blocks[0].operations if op.operation.name == "func.func"]
    assert len(funcs) == 1
    (shards,) = run_module(print_module(module), [jax.device_put(a, jax.devices()[0])], jax.devices()[:1])
    np.testing.assert_allclose(shards[0], np.asarray(outer(a)), rtol=1e-6)


def test_chlo_is_legalized_with_the_same_numbers():
    @jax.jit
    def f(a):
        return jax.lax.erf(a) + jnp.tan(a) + jax.lax.lgamma(a + 3)

    a = jnp.linspace(-1.0, 1.0, 16)
    text = f.lower(a).as_text()
    assert "chlo." in text
    module = imported(text)
    assert "chlo." not in print_module(module)
    (shards,) = run_module(print_module(module), [jax.device_put(a, jax.devices()[0])], jax.devices()[:1])
    np.testing.assert_allclose(shards[0], np.asarray(f(a)), rtol=1e-5)


@pytest.mark.corpus
def test_portable_artifact_and_bytecode_load():
    from jaxlib.mlir.dialects import stablehlo

    text = (CORPUS / "stablehlo-testdata" / "abs_float32_20_20.mlir").read_text()
    artifact = stablehlo.serialize_portable_artifact_str(text, stablehlo.get_current_version())
    module = parse_module(artifact, source_name="abs.mlirbc")
    assert "stablehlo.abs" in print_module(module)


@pytest.mark.corpus
@pytest.mark.parametrize("name", ["add_qi8.mlir", "abs_shape_float32_20_20_qi8.mlir"])
def test_quantized_programs_fail_naming_the_dialect(name):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hlopar.cli.opt",
            str(CORPUS / "stablehlo-testdata" / "quantized" / name),
            "--split-input-file",
            "--pass-pipeline=builtin.module(hlopar-import)",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "dialect 'quant' is not available in jaxlib's MLIR" in result.stderr
    assert "Traceback" not in result.stderr
    assert f"{name}:" in result.stderr  # file:line:col


def test_bad_text_raises_located_diagnostics():
    with pytest.raises(DiagnosticError) as error:
        parse_module("func.func @f() {\n  return %x : tensor<f32>\n}", source_name="bad.mlir")
    (diagnostic,) = error.value.diagnostics
    assert (diagnostic.location.file, diagnostic.location.line, diagnostic.location.col) == ("bad.mlir", 2, 10)


@pytest.mark.corpus
def test_fixed_corpus_sample_imports():
    """The CI sample of the corpus: everything imports or is cleanly rejected (tools/run_corpus.py)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "run_corpus.py"), "--sample", "120"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "pass rate: 100.00% of 120 files" in result.stdout
