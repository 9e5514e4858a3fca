"""An exported StableHLO module as the step `parallelize` runs (`hlopar.module_step`): the
zoo's tiny GPT exported as JAX's docs export a program (`jax.jit(step).lower(...).as_text()`),
planned as a pipeline on 2 x 4 CPU devices from the file alone, run in this process, and
checked against the same module on one device, which equals the JAX function's step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from numerics import assert_step_close, assert_trees_equal

import hlopar
from hlopar.corpus import corpus_dir
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.module import module_bytecode, parse_module
from hlopar.models import get_train_step
from hlopar.module_step import ModuleStep

TWO_HOSTS = hlopar.Cluster.local(2, 4, device_kind="cpu")
RTOL = 1e-5  # as test_in_process.py: a pipelined step's sums are ordered otherwise
UPDATE_MAX_RTOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny GPT's step exported to `gpt_step.mlir` and `.mlirbc`, its flat arguments,
    how many of them are the batch, its parameters and the JAX function's one-device step."""
    model = get_train_step("gpt", "tiny")
    params = model.init(jax.random.PRNGKey(0))
    state = model.init_opt_state(params)
    batch = model.make_batch(jax.random.PRNGKey(1))
    text = jax.jit(model.step).lower(params, state, batch).as_text()
    folder = tmp_path_factory.mktemp("exported")
    (folder / "gpt_step.mlir").write_text(text)
    (folder / "gpt_step.mlirbc").write_bytes(module_bytecode(parse_module(text)))
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, state, batch))]
    reference = model.jitted_step(params, state, batch)
    return folder, leaves, len(jax.tree_util.tree_leaves(batch)), params, reference


def test_the_module_on_one_device_is_the_jax_step(exported):
    """Called on its own, a module step runs @main on one device: the JAX function's results,
    bit for bit, from the text and from the bytecode alike."""
    folder, leaves, _, _, reference = exported
    text, bytecode = ModuleStep(folder / "gpt_step.mlir"), ModuleStep(folder / "gpt_step.mlirbc")
    assert text.__name__ == bytecode.__name__ == "gpt_step"
    assert text.in_info == bytecode.in_info and len(text.in_info) == len(leaves)
    assert text.out_info == bytecode.out_info and len(text.out_info) == len(jax.tree_util.tree_leaves(reference))
    assert_trees_equal(list(bytecode(*leaves)), [np.asarray(x) for x in jax.tree_util.tree_leaves(reference)])


def test_an_exported_step_runs_pipelined_from_the_file(exported, tmp_path, monkeypatch):
    """`parallelize("gpt_step.mlir", ...)`: planned from the module alone (2 stages on 2 x 4,
    2 microbatches), run here, equal to one device's step; a second call runs the state the
    first returned, and the module's flat results come back as a tuple."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path / "cache"))
    folder, leaves, batch_count, params, reference = exported
    n = len(leaves)
    step = hlopar.parallelize(
        str(folder / "gpt_step.mlir"),
        cluster=TWO_HOSTS,
        num_microbatches=2,
        batch_argnums=tuple(range(n - batch_count, n)),
        verbose=False,
    )
    out = step(*leaves)
    assert isinstance(out, tuple) and len(out) == len(jax.tree_util.tree_leaves(reference))
    assert step.planned.program.microbatches == 2 and len(step.planned.plan["stages"]["stages"]) >= 2
    assert_step_close(list(out), reference, params, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)
    again = step(*out[:-1], *leaves[n - batch_count :])
    one_device = ModuleStep(folder / "gpt_step.mlir")(*[np.asarray(x) for x in out[:-1]], *leaves[n - batch_count :])
    np.testing.assert_allclose(float(again[-1]), float(one_device[-1]), rtol=RTOL)


def test_arguments_that_are_not_mains_are_refused(exported):
    folder, leaves, _, _, _ = exported
    step = ModuleStep(folder / "gpt_step.mlir")
    with pytest.raises(TypeError, match=r"takes 87 arguments, got 86"):
        step(*leaves[:-1])
    wrong = list(leaves)
    wrong[3] = wrong[3].astype(np.float16)
    with pytest.raises(TypeError, match=r"argument 3 is a float32\[.*\], got a float16"):
        step(*wrong)
    with pytest.raises(ValueError, match="donations are its own"):
        hlopar.parallelize(str(folder / "gpt_step.mlir"), cluster=TWO_HOSTS, donate_argnums=(0,))


def test_a_bad_module_says_where(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {\n  %y = stablehlo.frobnicate %x\n}\n")
    with pytest.raises(DiagnosticError, match=r"bad\.mlir:2:"):
        hlopar.parallelize(str(bad), cluster=TWO_HOSTS)
    with pytest.raises(DiagnosticError, match="cannot read"):
        ModuleStep(tmp_path / "missing.mlir")


@pytest.mark.corpus
def test_a_module_jax_exported_with_lapack_calls_runs():
    """The corpus' Cholesky module (a `lapack_spotrf_ffi` custom call, exported by JAX in
    2024): XLA's LAPACK kernels are set up before it is compiled (`codegen.spmd`), so it runs
    here, where jax never lowered a linear-algebra op, instead of crashing the process; its
    factor is the matrix's Cholesky factor, and its plan on 8 devices gives the same."""
    step = ModuleStep(corpus_dir() / "jax-export" / "cpu_cholesky_lapack_potrf__data_2024_05_31_f32.mlir")
    (info,) = step.in_info
    m = np.random.default_rng(0).normal(size=info.shape).astype(np.float32)
    spd = m @ m.T + info.shape[0] * np.eye(info.shape[0], dtype=np.float32)
    (factor,) = step(spd)
    np.testing.assert_allclose(np.tril(np.asarray(factor)), np.linalg.cholesky(spd), rtol=1e-5, atol=1e-5)
    parallel = hlopar.parallelize(
        step, cluster=hlopar.Cluster.local(1, 8, device_kind="cpu"), method="shard", verbose=False
    )
    np.testing.assert_array_equal(np.asarray(parallel(spd)[0]), np.asarray(factor))


def test_a_module_exported_sharded_runs_on_its_mesh_and_is_replanned(tmp_path, monkeypatch):
    """The tiny MLP exported data-parallel over 8 devices (`in_shardings`, an `sdy.mesh` of 8):
    called on its own it runs on 8 devices as exported; `parallelize` plans it afresh for 2 x 4
    (the export's shardings taken as the user's), and both equal the JAX step on one device."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path / "cache"))
    model = get_train_step("mlp", "tiny")
    params = model.init(jax.random.PRNGKey(0))
    state = model.init_opt_state(params)
    batch = model.make_batch(jax.random.PRNGKey(1))
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    shardings = jax.tree_util.tree_map(lambda _: whole, (params, state)) + (
        jax.tree_util.tree_map(lambda _: rows, batch),
    )
    path = tmp_path / "mlp_data_parallel.mlir"
    path.write_text(jax.jit(model.step, in_shardings=shardings).lower(params, state, batch).as_text())
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, state, batch))]
    reference = model.jitted_step(params, state, batch)
    as_exported = ModuleStep(path)(*leaves)
    assert_step_close(list(as_exported), reference, params, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)
    n, batch_count = len(leaves), len(jax.tree_util.tree_leaves(batch))
    step = hlopar.parallelize(
        str(path), cluster=TWO_HOSTS, num_microbatches=2, batch_argnums=tuple(range(n - batch_count, n)), verbose=False
    )
    assert_step_close(list(step(*leaves)), reference, params, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)


@pytest.mark.corpus
def test_a_module_without_a_batch_runs_as_one_microbatch():
    """The corpus' QR module (`lapack_sgeqrf_ffi`): its one argument is the shape of its
    result, so nothing in it looks like a batch. With one microbatch there is nothing to split:
    it is planned as one microbatch of no batch (was refused: "no argument looks like a
    batch") and equals its run on one device."""
    step = ModuleStep(corpus_dir() / "jax-export" / "cpu_qr_lapack_geqrf__data_2025_04_02_f32.mlir")
    args = [np.random.default_rng(0).normal(size=info.shape).astype(info.dtype) for info in step.in_info]
    expected = step(*args)
    parallel = hlopar.parallelize(step, cluster=hlopar.Cluster.local(2, 4, device_kind="cpu"), verbose=False)
    out = parallel(*args)
    assert parallel.planned.program.microbatches == 1
    assert_trees_equal([np.asarray(x) for x in out], [np.asarray(x) for x in expected])


def test_an_exported_flax_step_with_dropout_runs_in_microbatches(tmp_path, monkeypatch):
    """A Flax MLP with dropout (a typed key: its key data in the module), optax's Adam and a
    padding-weighted loss, written as Flax's docs write a step and exported as JAX's docs
    export one: the module on one device equals the JAX step exactly, and parallelized with 2
    microbatches on 2 x 4 (the batch and labels by number) equals it to rounding."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path / "cache"))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.1, deterministic=not train)(x)
            return nn.Dense(4)(x)

    model, tx = MLP(), optax.adam(1e-3)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    labels = jax.random.randint(jax.random.PRNGKey(2), (16,), -1, 4)  # -1: padding
    params = model.init(jax.random.PRNGKey(0), x, train=False)
    opt_state = tx.init(params)

    def train_step(params, opt_state, x, labels, key):
        def loss_fn(p):
            logits = model.apply(p, x, train=True, rngs={"dropout": key})
            mask = (labels >= 0).astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
            return jnp.sum(losses * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(3)
    path = tmp_path / "flax_step.mlir"
    path.write_text(jax.jit(train_step).lower(params, opt_state, x, labels, key).as_text())
    leaves = [
        np.asarray(a) for a in jax.tree_util.tree_leaves((params, opt_state, x, labels, jax.random.key_data(key)))
    ]
    reference = [
        np.asarray(a) for a in jax.tree_util.tree_leaves(jax.jit(train_step)(params, opt_state, x, labels, key))
    ]
    assert_trees_equal([np.asarray(a) for a in ModuleStep(path)(*leaves)], reference)
    n = len(leaves)
    step = hlopar.parallelize(
        str(path), cluster=TWO_HOSTS, num_microbatches=2, batch_argnums=(n - 3, n - 2), verbose=False
    )
    out = [np.asarray(a) for a in step(*leaves)]
    assert step.planned.program.microbatches == 2
    assert len(out) == len(reference)
    for have, want in zip(out, reference):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)  # sums over 2 microbatches, reordered (2e-9 seen)
