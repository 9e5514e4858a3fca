"""The model zoo: tiny configurations train for real, every configuration lowers abstractly."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tools_module import load_tool

from hlopar.models import (
    MODELS,
    UnknownModelError,
    adam_update,
    count_ops,
    get_train_step,
    gpt,
    init_adam,
    list_configs,
    mlp,
    moe,
)

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "export_model.py"

# Lowering one configuration with abstract shapes, even a 39B/70B one, takes a few seconds
# (GPT-39B: about 3 s, MoE-70B: about 3 s, on 2 cores); this is the time box per config.
LOWERING_BUDGET_S = 30.0

# The default run lowers the smallest and the largest configuration of each family (plus
# GPT-1.3B, the usual reference); the others lower in the `heavy` run. The op graph of a
# family only changes with the number of layers, so this covers every distinct depth but
# GPT's 32-layer and MoE's 16-layer ones, and keeps the file inside its one-minute budget.
DEFAULT_LOWERING = {
    "mlp": ["tiny", "small"],
    "gpt": ["tiny", "1.3B", "39B"],
    "moe": ["tiny", "70B"],
    "wide_resnet": ["tiny", "13B"],
    "u_transformer": ["tiny", "2.1B"],
}
LOWERING_CASES = [
    pytest.param(m, c, marks=() if c in DEFAULT_LOWERING[m] else pytest.mark.heavy, id=f"{m}-{c}")
    for m in sorted(MODELS)
    for c in list_configs(m)
]


def _nominal_params(name: str) -> float | None:
    """``"1.3B"`` -> 1.3e9, ``"350M"`` -> 3.5e8; None for names like ``"tiny"``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([MB])", name)
    if not m:
        return None
    return float(m.group(1)) * (1e6 if m.group(2) == "M" else 1e9)


def _load_tool():
    return load_tool("export_model")


# --------------------------------------------------------------------------- registry


def test_registry_lists_every_family_with_a_tiny_config():
    assert set(MODELS) == {"mlp", "gpt", "moe", "wide_resnet", "u_transformer"}
    for model in MODELS:
        assert "tiny" in list_configs(model)
    gpt = ["tiny", "350M", "1.3B", "2.6B", "6.7B", "15B", "39B"]
    gpt += [f"{name}-fp16" for name in gpt[1:]]
    assert list_configs("gpt") == gpt + [f"{name}-scan" for name in gpt]
    assert MODELS["gpt"].configs["39B-fp16-scan"] == dataclasses.replace(
        MODELS["gpt"].configs["39B"], dtype="float16", master_dtype="float32", scan_layers=True
    )
    assert list_configs("moe") == ["tiny", "380M", "1.3B", "2.4B", "10B", "27B", "70B"]
    assert list_configs("wide_resnet") == ["tiny", "250M", "1B", "2B", "4B", "6.8B", "13B"]
    assert list_configs("u_transformer") == ["tiny", "2.1B"]


def test_unknown_names_raise_a_clear_error():
    with pytest.raises(UnknownModelError, match="unknown model 'bert'.*gpt"):
        get_train_step("bert", "tiny")
    with pytest.raises(UnknownModelError, match="unknown gpt configuration '3B'.*1.3B"):
        get_train_step("gpt", "3B")
    with pytest.raises(UnknownModelError):
        list_configs("bert")


def test_paper_configurations_are_the_papers_numbers():
    g = MODELS["gpt"].configs["39B"]
    assert (g.hidden_size, g.num_layers, g.num_heads, g.seq_len, g.vocab_size) == (8192, 48, 64, 1024, 51200)
    m = MODELS["moe"].configs["70B"]
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_experts, m.vocab_size) == (2048, 32, 32, 64, 32000)
    w = MODELS["wide_resnet"].configs["13B"]
    assert (w.num_layers, w.base_channels, w.width_factor, w.image_size, w.num_classes) == (101, 320, 16, 224, 1024)
    assert MODELS["wide_resnet"].configs["250M"].num_layers == 50
    u = MODELS["u_transformer"].configs["2.1B"]
    assert (u.batch_size, u.dtype) == (2048, "float32")


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tiny_config_trains(model):
    ts = get_train_step(model, "tiny")
    params = ts.init(jax.random.key(0))
    opt_state = ts.init_opt_state(params)
    batch = ts.make_batch(jax.random.key(1))
    structure = jax.tree_util.tree_structure((params, opt_state))
    shapes = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves((params, opt_state))]

    losses = []
    for _ in range(3):
        params, opt_state, loss = ts.jitted_step(params, opt_state, batch)
        losses.append(float(loss))

    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    assert jax.tree_util.tree_structure((params, opt_state)) == structure
    assert [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves((params, opt_state))] == shapes
    assert int(opt_state.count) == 3
    # The abstract arguments describe exactly what init/make_batch produce.
    abstract = ts.abstract_args()
    real = (params, opt_state, batch)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(real)
    for a, r in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(real)):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)


def test_loss_is_a_mean_over_the_batch():
    """Two half batches' losses average to the full batch's loss (pipelines rely on it)."""
    ts = get_train_step("gpt", "tiny")
    params = ts.init(jax.random.key(0))
    batch = ts.make_batch(jax.random.key(1))
    half = ts.config.batch_size // 2
    first = {k: v[:half] for k, v in batch.items()}
    second = {k: v[half:] for k, v in batch.items()}
    loss = jax.jit(ts.loss_fn)
    full = loss(params, batch)
    halves = (loss(params, first) + loss(params, second)) / 2
    np.testing.assert_allclose(full, halves, rtol=1e-5)


def test_mlp_gradient_matches_finite_differences():
    with jax.enable_x64(True):
        cfg = mlp.MLPConfig(in_dim=8, hidden_dims=(16, 16), out_dim=4, batch_size=8, dtype="float64")
        ts = mlp.train_step(cfg)
        params = ts.init(jax.random.key(0))
        batch = ts.make_batch(jax.random.key(1))
        assert params[1]["kernel"].dtype == jnp.float64
        _, grads = jax.jit(jax.value_and_grad(ts.loss_fn))(params, batch)
        loss = jax.jit(ts.loss_fn)

        def loss_at(delta):
            p = list(params)
            p[1] = dict(p[1], kernel=p[1]["kernel"].at[3, 5].add(delta))
            return float(loss(p, batch))

        eps = 1e-6
        fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
        assert abs(float(grads[1]["kernel"][3, 5])) > 1e-6
        np.testing.assert_allclose(float(grads[1]["kernel"][3, 5]), fd, rtol=1e-5)


def test_moe_gating_respects_top2_and_capacity():
    logits = jax.random.normal(jax.random.key(3), (2, 16, 4))  # [groups, tokens, experts]
    capacity = 5
    combine, dispatch, aux = jax.jit(moe.top2_gating, static_argnums=1)(logits, capacity)
    combine, dispatch = np.asarray(combine), np.asarray(dispatch)
    assert combine.shape == dispatch.shape == (2, 16, 4, capacity)
    # A token goes to at most two experts, one slot each; a slot holds at most one token.
    assert dispatch.sum(axis=(2, 3)).max() <= 2
    assert dispatch.sum(axis=3).max() <= 1
    assert dispatch.sum(axis=1).max() <= 1
    # Experts fill their slots from the front, and overflowing tokens are dropped.
    per_expert = dispatch.sum(axis=(1, 3))
    assert per_expert.max() <= capacity and per_expert.sum() < 2 * 2 * 16
    # Gate weights of a kept token sum to one, and every expert slot is weighted by them.
    weights = combine.sum(axis=(2, 3))
    kept = dispatch.sum(axis=(2, 3)) > 0
    np.testing.assert_allclose(weights[kept], 1.0, rtol=1e-5)
    assert np.all((combine > 0) == (dispatch > 0))
    assert math.isfinite(float(aux)) and float(aux) > 0
    # Balanced routing gives exactly 1: E * sum_e(mean_gate_e * 1/E) = sum_e mean_gate_e.
    balanced = jnp.tile(jnp.eye(4) * 5.0, (1, 4, 1))  # token t prefers expert t % 4
    _, _, aux_balanced = moe.top2_gating(balanced, capacity)
    np.testing.assert_allclose(float(aux_balanced), 1.0, rtol=1e-5)


def test_dtype_is_a_config_field():
    cfg = dataclasses.replace(gpt.GPT_CONFIGS["tiny"], dtype="float16")
    ts = gpt.train_step(cfg)
    assert ts.name == "gpt-custom"
    text = ts.lower()
    assert "tensor<128x64xf16>" in text  # the token embedding
    # Without a master dtype everything is float16, Adam's moments too: no master copy.
    opt_state = ts.abstract_args()[1]
    assert opt_state.master is None
    assert {x.dtype for x in jax.tree_util.tree_leaves(opt_state.mu)} == {jnp.dtype("float16")}


def _dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree)}


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("config", ["350M-fp16", "350M-fp16-scan"])
def test_gpt_fp16_is_mixed_precision(config):
    """Alpa's precision: float16 weights, activations and gradients, float32 master weights and
    moments, 16 bytes per parameter (Micikevicius et al. 2018)."""
    ts = get_train_step("gpt", config)
    params, opt_state, batch = ts.abstract_args()
    n = ts.param_count()
    assert _dtypes(params) == {"float16"}
    assert _dtypes((opt_state.master, opt_state.mu, opt_state.nu)) == {"float32"}
    shapes = [x.shape for x in jax.tree_util.tree_leaves(params)]
    for tree in (opt_state.master, opt_state.mu, opt_state.nu):
        assert [x.shape for x in jax.tree_util.tree_leaves(tree)] == shapes
    grads = jax.eval_shape(jax.grad(ts.loss_fn), params, batch)
    assert _dtypes(grads) == {"float16"}
    state = (params, opt_state.master, opt_state.mu, opt_state.nu)
    assert (_bytes(state), _bytes(grads)) == (14 * n, 2 * n)  # 2 + 4 + 4 + 4, and 2: 16 in all
    # The forward and backward compute in float16: every matmul's operands and result.
    text = ts.lower()
    dots = re.findall(r"stablehlo\.dot_general.*: \((.*)\) -> (.*)", text)
    assert len(dots) >= 3 * 4 * (1 if config.endswith("scan") else ts.config.num_layers)
    for operands, result in dots:
        assert re.findall(r"x(f\d+)>", operands + result) == ["f16"] * 3, (operands, result)
    # The update casts float16 gradients to float32: one convert per parameter leaf at least.
    leaves = len(shapes)
    assert len(re.findall(r"stablehlo\.convert .*: \(tensor<[^>]*xf16>\) -> tensor<[^>]*xf32>", text)) >= leaves


def test_mixed_precision_step_is_adam_on_the_master_weights():
    """One mixed-precision step = float32 Adam on the master weights with the float16
    gradients cast to float32; the new float16 params are the new master weights rounded."""
    cfg = dataclasses.replace(gpt.GPT_CONFIGS["tiny"], dtype="float16", master_dtype="float32")
    ts = gpt.train_step(cfg)
    params = ts.init(jax.random.key(0))
    opt_state = ts.init_opt_state(params)
    batch = ts.make_batch(jax.random.key(1))
    assert _dtypes(params) == {"float16"} and _dtypes(opt_state.master) == {"float32"}
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda m, p: bool(jnp.all(m == p.astype(jnp.float32))), opt_state.master, params)
    )

    grads = jax.jit(jax.grad(ts.loss_fn))(params, batch)
    grads32 = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    reference = jax.jit(adam_update)(grads32, init_adam(opt_state.master), opt_state.master)
    new_params, new_state, _ = ts.jitted_step(params, opt_state, batch)
    for got, want in zip(
        jax.tree_util.tree_leaves((new_state.master, new_state.mu, new_state.nu)),
        jax.tree_util.tree_leaves((reference[0], reference[1].mu, reference[1].nu)),
    ):
        np.testing.assert_array_equal(got, want)
    for p, m in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(new_state.master)):
        assert p.dtype == jnp.float16
        np.testing.assert_array_equal(p, m.astype(jnp.float16))
    assert int(new_state.count) == 1

    losses = []
    params, opt_state = new_params, new_state
    for _ in range(3):
        params, opt_state, loss = ts.jitted_step(params, opt_state, batch)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_adam_matches_the_papers_update_rule():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = [{"w": jnp.array([0.5, 0.1, -1.0])}, {"w": jnp.array([-0.2, 0.4, 0.3])}]
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    state = init_adam(params)
    p = np.array([1.0, -2.0, 3.0])
    m = np.zeros(3)
    v = np.zeros(3)
    for t, g in enumerate(grads, start=1):
        params, state = adam_update(g, state, params, lr=lr, b1=b1, b2=b2, eps=eps)
        gn = np.asarray(g["w"], np.float64)
        m = b1 * m + (1 - b1) * gn
        v = b2 * v + (1 - b2) * gn**2
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(params["w"], p, rtol=1e-5)
    assert int(state.count) == 2


# --------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("model,config", LOWERING_CASES)
def test_config_lowers_with_abstract_shapes(model, config):
    """A named configuration, up to GPT-39B / MoE-70B / Wide-ResNet-13B, lowers in seconds."""
    ts = get_train_step(model, config)
    start = time.perf_counter()
    text = ts.lower()
    seconds = time.perf_counter() - start
    assert text.startswith("module @jit_"), text[:80]
    assert "func.func public @main" in text
    assert count_ops(text) > 100
    assert seconds < LOWERING_BUDGET_S, f"{ts.name} took {seconds:.1f} s to lower"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_param_counts_match_the_papers(model):
    """Every named configuration's #params is within 5% of the papers' tables."""
    for name in list_configs(model):
        nominal = _nominal_params(name)
        if nominal is not None:
            count = get_train_step(model, name).param_count()
            assert abs(count - nominal) / nominal < 0.05, (name, count)


def test_gpt_layers_are_unrolled_and_scoped():
    ts = get_train_step("gpt", "tiny")
    text = ts.lower(debug_info=True)
    assert "stablehlo.while" not in text  # no lax.scan
    for i in range(ts.config.num_layers):
        assert re.search(rf"[(/]layer_{i}[)/]", text), f"layer_{i}"
    assert count_ops(text) == count_ops(ts.lower())


def test_lowered_text_parses_in_the_hlopar_context():
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    text = get_train_step("moe", "tiny").lower()
    with make_context():
        module = ir.Module.parse(text)
        assert module.operation.verify()


@pytest.mark.heavy
@pytest.mark.parametrize("model,config", [(m, c) for m in sorted(MODELS) for c in list_configs(m)])
def test_every_config_parses_and_verifies(model, config):
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    text = get_train_step(model, config).lower()
    with make_context():
        assert ir.Module.parse(text).operation.verify()


# --------------------------------------------------------------------------- export tool


def test_export_tool_writes_text_and_bytecode(tmp_path, capsys):
    tool = _load_tool()
    out = tmp_path / "mlp.mlir"
    assert tool.main(["mlp", "tiny", "-o", str(out)]) == 0
    assert out.read_text().startswith("module @jit_")
    assert "mlp-tiny" in capsys.readouterr().err

    assert tool.main(["gpt", "tiny", "-o", "-"]) == 0
    assert capsys.readouterr().out.startswith("module @jit_")

    bc = tmp_path / "mlp.mlirbc"
    assert tool.main(["mlp", "tiny", "--bytecode", "-o", str(bc)]) == 0
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    with make_context():
        module = ir.Module.parse(bc.read_bytes())
        assert "func.func public @main" in str(module)


def test_export_tool_rejects_unknown_names(capsys):
    tool = _load_tool()
    assert tool.main(["gpt", "3B"]) == 2
    err = capsys.readouterr().err
    assert "unknown gpt configuration '3B'" in err and "Traceback" not in err
    assert tool.main(["bert", "tiny"]) == 2
    assert "unknown model 'bert'" in capsys.readouterr().err
    assert tool.main(["gpt"]) == 2
    assert tool.main(["gpt", "tiny", "--bytecode"]) == 2


def test_export_tool_runs_as_a_script():
    proc = subprocess.run([sys.executable, str(TOOL), "--list"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gpt: tiny 350M 1.3B 2.6B 6.7B 15B 39B" in proc.stdout
    proc = subprocess.run([sys.executable, str(TOOL), "nope", "tiny"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "unknown model 'nope'" in proc.stderr
