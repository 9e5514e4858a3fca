"""Alpa's intra-op expectations (its `tests/shard_parallel/`), re-expressed for hlopar (issue 30).

What carries over from Alpa's tests is their facts: the models (an MLP of 6 dense layers, a
stack of 2 BERT layers, with remat too, BERT for masked LM, a tied embedding, a conv net with
batch norm, an MoE layer, a 2-layer MLP accumulating gradients over 2 microbatches), their
sizes, the mesh (Alpa's [4, 1] / [1, 4] is one axis of 4 here; [2, 2] stays 2x2), the link
costs Alpa gives the mesh (alpha, beta per axis), and the communication Alpa asserts (how
many collectives of which kind, and the objective its ILP must reach). The steps are plain
JAX with optax, as a user writes them; the MoE layer uses the zoo's `moe_ffn`.

Link costs: Alpa's objective has no compute term (its heavy ops may not be replicated, the
rest is free); hlopar's prices FLOPs too, so Alpa's unitless alpha and beta need a unit next
to the `cpu` preset's 20 GFLOP/s. One unit is a nanosecond: latency alpha ns, bandwidth
1/beta bytes per ns. The communication of a plan is costed with those links from the
collectives XLA compiled (`tools/check_fidelity.py` reads them), a reduce-scatter that XLA's
CPU backend compiles as all-reduce + dynamic-slice costed as the reduce-scatter it is on
GPUs. A case passes where that is within Alpa's own tolerance (1 %) of the cost Alpa states.

Where hlopar's plan differs in kind (it reduce-scatters gradients and all-gathers parameters
where Alpa all-reduces: the same bytes, one latency more each), the cost still has to hold.
`docs/auto_sharding.md` ("Alpa's cases") tabulates the results.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from numerics import assert_trees_close
from tools_module import load_tool

from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.auto_sharding.collectives import all_reduce_cost, collective_cost
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module
from hlopar.models.moe import MoEConfig, init_moe_ffn, moe_ffn
from hlopar.module_step import ModuleStep

tool = load_tool("check_fidelity")
F32 = jnp.float32
Abstract = jax.ShapeDtypeStruct
NS = 1e-9  # one unit of Alpa's alpha and beta (see the module docstring)
ADAM = optax.adam(1e-2)
MOMENTUM = optax.sgd(1e-2, momentum=0.9)


# --- the models, as a user writes them --------------------------------------------------------


def _dense_stack(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def _mse(out, target):
    return jnp.mean((out - target) ** 2)


def _training_step(loss, optimizer=ADAM):
    def step(params, opt_state, *batch):
        grads = jax.grad(loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _layer_norm(h, scale, bias):
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) * lax.rsqrt(var + 1e-12) * scale + bias


def _attention_block(p, h, heads):
    """Post-norm self-attention with one fused query/key/value projection, laid out per head
    as Alpa's BERT does, so that splitting its columns splits heads."""
    batch, seq, hidden = h.shape
    qkv = (h @ p["qkv"] + p["qkv_bias"]).reshape(batch, seq, heads, hidden // heads, 3)
    q, k, v = qkv[..., 0], qkv[..., 1], qkv[..., 2]
    probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (hidden // heads) ** 0.5, axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(h.shape)
    return _layer_norm(h + attended @ p["out"] + p["out_bias"], p["ln1_scale"], p["ln1_bias"])


def _bert_layer(p, h, heads):
    """Alpa's BERT layer: the attention block, then a GELU MLP 4x wide, post-norm."""
    h = _attention_block(p, h, heads)
    inner = jax.nn.gelu(h @ p["up"] + p["up_bias"])
    return _layer_norm(h + inner @ p["down"] + p["down_bias"], p["ln2_scale"], p["ln2_bias"])


def _attention_shapes(d: int) -> dict:
    return {
        "qkv": (d, 3 * d),
        "qkv_bias": (3 * d,),
        "out": (d, d),
        "out_bias": (d,),
        **{f"ln{i}_{part}": (d,) for i in (1, 2) for part in ("scale", "bias")},
    }


def _mlp_params(layers: int, hidden: int):
    return [(Abstract((hidden, hidden), F32), Abstract((hidden,), F32))] * layers


def _bert_params(layers: int, hidden: int):
    d = hidden
    shapes = _attention_shapes(d) | {"up": (d, 4 * d), "up_bias": (4 * d,), "down": (4 * d, d), "down_bias": (d,)}
    return [{name: Abstract(shape, F32) for name, shape in shapes.items()} for _ in range(layers)]


@functools.cache
def _mlp(layers: int, batch: int, hidden: int) -> str:
    params = _mlp_params(layers, hidden)
    x = Abstract((batch, hidden), F32)
    step = _training_step(lambda p, x, y: _mse(_dense_stack(p, x), y))
    return jax.jit(step).lower(params, jax.eval_shape(ADAM.init, params), x, x).as_text()


@functools.cache
def _bert(layers: int, batch: int, seq: int, hidden: int, heads: int, remat: bool = False) -> str:
    layer = jax.checkpoint(_bert_layer, static_argnums=2) if remat else _bert_layer

    def loss(params, h, label):
        for p in params:
            h = layer(p, h, heads)
        return _mse(h, label)

    params = _bert_params(layers, hidden)
    x = Abstract((batch, seq, hidden), F32)
    return jax.jit(_training_step(loss)).lower(params, jax.eval_shape(ADAM.init, params), x, x).as_text()


MOE = MoEConfig(hidden_size=64, num_layers=1, num_heads=16, num_experts=16, ffn_multiplier=4, group_size=32)


def _moe_params():
    """The attention block's parameters and the MoE's: a gate, experts stacked on axis 0."""
    attention = {name: Abstract(shape, F32) for name, shape in _attention_shapes(MOE.hidden_size).items()}
    return attention | {"moe": {name: Abstract(spec.shape, F32) for name, spec in init_moe_ffn(MOE).items()}}


@functools.cache
def _moe_layer(batch: int, seq: int) -> str:
    """Alpa's MoE layer: the attention block, then GShard's top-2 MoE feed-forward (the zoo's
    `moe_ffn`: groups of 32 tokens, 16 experts, capacity 4), post-norm."""

    def loss(p, h, label):
        h = _attention_block(p, h, MOE.num_heads)
        out, _ = moe_ffn(p["moe"], h, MOE)
        return _mse(_layer_norm(h + out, p["ln2_scale"], p["ln2_bias"]), label)

    params = _moe_params()
    x = Abstract((batch, seq, MOE.hidden_size), F32)
    return jax.jit(_training_step(loss)).lower(params, jax.eval_shape(ADAM.init, params), x, x).as_text()


@functools.cache
def _accumulating_mlp(batch: int, microbatches: int, hidden: int, loop: str = "fori_loop") -> str:
    params = _mlp_params(2, hidden)
    x = Abstract((batch, hidden), F32)
    return (
        jax.jit(_accumulating_step(batch, microbatches, hidden, loop))
        .lower(params, jax.eval_shape(MOMENTUM.init, params), x, x)
        .as_text()
    )


def _accumulating_step(batch: int, microbatches: int, hidden: int, loop: str = "fori_loop"):
    """Two dense layers; the step sums the gradients of `microbatches` slices of the batch in
    a `fori_loop` (or a `scan` over them), then takes one momentum step."""
    loss = lambda p, x, y: _mse(_dense_stack(p, x), y)  # noqa: E731

    def step(params, opt_state, x, y):
        xs = x.reshape(microbatches, batch // microbatches, hidden)
        ys = y.reshape(microbatches, batch // microbatches, hidden)

        def accumulate(i, total):
            return jax.tree.map(jnp.add, total, jax.grad(loss)(params, xs[i], ys[i]))

        zeros = jax.tree.map(jnp.zeros_like, params)
        if loop == "scan":
            step_grads = lambda total, xy: (jax.tree.map(jnp.add, total, jax.grad(loss)(params, *xy)), None)  # noqa: E731
            grads, _ = lax.scan(step_grads, zeros, (xs, ys))
        else:
            grads = lax.fori_loop(0, microbatches, accumulate, zeros)
        updates, opt_state = MOMENTUM.update(jax.tree.map(lambda g: g / microbatches, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _batch_norm(x, scale, bias, mean, var):
    """Training-mode batch norm over N, H, W, the variance from the mean of squares (two
    reductions, as flax's); returns the output and the running statistics moved 10 % toward
    the batch's."""
    batch_mean = x.mean((0, 1, 2))
    batch_var = (x * x).mean((0, 1, 2)) - batch_mean * batch_mean
    out = (x - batch_mean) * lax.rsqrt(batch_var + 1e-5) * scale + bias
    return out, (0.9 * mean + 0.1 * batch_mean, 0.9 * var + 0.1 * batch_var)


def _conv_net(params, stats, x):
    """Alpa's conv net: 3x3 convolutions of stride 2 without bias, batch norm, ReLU, and a
    2x2 max pool of stride 1."""
    new_stats = []
    for (kernel, scale, bias), (mean, var) in zip(params, stats):
        x = lax.conv_general_dilated(x, kernel, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x, running = _batch_norm(x, scale, bias, mean, var)
        x = lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
        new_stats.append(running)
    return x, new_stats


def _conv_shapes(layers: int, channel: int):
    params = [(Abstract((3, 3, channel, channel), F32), Abstract((channel,), F32), Abstract((channel,), F32))]
    return params * layers, [(Abstract((channel,), F32), Abstract((channel,), F32))] * layers


@functools.cache
def _conv(layers: int, batch: int, image: int, channel: int) -> str:
    def step(params, opt_state, stats, x, y):
        def loss(p):
            out, new_stats = _conv_net(p, stats, x)
            return _mse(out, y), new_stats

        grads, stats = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = MOMENTUM.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    params, stats = _conv_shapes(layers, channel)
    out = image // 2**layers
    x, y = Abstract((batch, image, image, channel), F32), Abstract((batch, out, out, channel), F32)
    return jax.jit(step).lower(params, jax.eval_shape(MOMENTUM.init, params), stats, x, y).as_text()


@functools.cache
def _tied_embedding(vocab: int, hidden: int, batch: int, seq: int) -> str:
    """Alpa's tied embedding: tokens looked up in a table whose transpose is the output layer,
    a summed softmax cross-entropy, Adam."""

    def loss(table, tokens, labels):
        logits = table[tokens] @ table.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    table = Abstract((vocab, hidden), F32)
    ids = Abstract((batch, seq), jnp.int32)
    return jax.jit(_training_step(loss)).lower(table, jax.eval_shape(ADAM.init, table), ids, ids).as_text()


def _bert_mlm_params(layers: int, hidden: int, vocab: int, seq: int):
    embeddings = {"words": (vocab, hidden), "positions": (seq, hidden), "token_types": (2, hidden)}
    embeddings |= {"ln_scale": (hidden,), "ln_bias": (hidden,)}
    head = {"dense": (hidden, hidden), "dense_bias": (hidden,), "ln_scale": (hidden,), "ln_bias": (hidden,)}
    head |= {"decoder_bias": (vocab,)}
    as_abstract = lambda shapes: {name: Abstract(shape, F32) for name, shape in shapes.items()}  # noqa: E731
    return {"embeddings": as_abstract(embeddings), "layers": _bert_params(layers, hidden), "head": as_abstract(head)}


@functools.cache
def _bert_mlm(layers: int, batch: int, seq: int, hidden: int, heads: int, vocab: int) -> str:
    """Alpa's BERT for masked LM: word, position and token-type embeddings, the BERT layers,
    a dense + GELU + layer-norm head whose decoder is the word embedding transposed (tied),
    and the cross-entropy of the labelled tokens (label > 0) scaled by 0.1234."""

    def loss(params, ids, token_types, positions, labels):
        e = params["embeddings"]
        h = e["words"][ids] + e["positions"][positions] + e["token_types"][token_types]
        h = _layer_norm(h, e["ln_scale"], e["ln_bias"])
        for p in params["layers"]:
            h = _bert_layer(p, h, heads)
        head = params["head"]
        h = _layer_norm(jax.nn.gelu(h @ head["dense"] + head["dense_bias"]), head["ln_scale"], head["ln_bias"])
        logits = h @ e["words"].T + head["decoder_bias"]
        mask = jnp.where(labels > 0, 1.0, 0.0)
        token_loss = -jnp.sum(jax.nn.one_hot(labels, vocab) * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        return (mask * token_loss).sum() / mask.sum() * 0.1234

    params = _bert_mlm_params(layers, hidden, vocab, seq)
    ids = Abstract((batch, seq), jnp.int32)
    opt_state = jax.eval_shape(ADAM.init, params)
    return jax.jit(_training_step(loss)).lower(params, opt_state, ids, ids, ids, ids).as_text()


# --- the cases ---------------------------------------------------------------------------------


def _param_bytes(params) -> list[int]:
    return [4 * leaf.size for leaf in jax.tree.leaves(params)]


@dataclass(frozen=True)
class Case:
    """One of Alpa's tests on one mesh: the program, the mesh with Alpa's alpha and beta per
    axis, and the communication Alpa states for it (seconds on that mesh)."""

    name: str
    program: Callable[[], str]
    mesh: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    alpa_cost: Callable[[object], float]
    options: str = ""

    @property
    def logical_mesh(self):
        return logical_mesh(
            self.mesh, latencies=[a * NS for a in self.alpha], bandwidths=[1 / (b * NS) for b in self.beta]
        )

    def pass_options(self) -> str:
        latency = ",".join(f"{a * NS:g}" for a in self.alpha)
        bandwidth = ",".join(f"{1 / (b * NS):g}" for b in self.beta)
        return f"latency={latency} bandwidth={bandwidth} {self.options}".strip()


def _data_parallel(params):
    """Alpa's data-parallel cost: one all-reduce of every weight gradient over the mesh."""
    return lambda mesh: sum(all_reduce_cost(mesh, ("x",), n) for n in _param_bytes(params))


def _mlp_2d(mesh):
    """Alpa's 2-D MLP (test_n_layer_mlp_2d_mesh): weights split by columns/rows over y, the
    batch over x: 6 gradient all-reduces (weight halves and biases) over x, 5 activation
    all-reduces (batch halves) over y."""
    layers, batch, hidden = 6, 256, 32
    return layers * (
        all_reduce_cost(mesh, ("x",), hidden * hidden * 4 / 2) + all_reduce_cost(mesh, ("x",), hidden * 4)
    ) + (layers - 1) * all_reduce_cost(mesh, ("y",), batch * hidden * 4 / 2)


def _bert_2d(mesh):
    """Alpa's 2-D BERT layer (test_bert_layer_2d_mesh): every parameter's gradient half
    all-reduced over x, 4 activation all-reduces a layer but one over y."""
    layers, batch, seq, hidden = 2, 8, 8, 128
    return sum(all_reduce_cost(mesh, ("x",), n / 2) for n in _param_bytes(_bert_params(layers, hidden))) + (
        4 * layers - 1
    ) * all_reduce_cost(mesh, ("y",), batch * seq * hidden * 4 / 2)


def _tied_embedding_2d(mesh):
    """Alpa's tied embedding on 2x2 (test_embedding_2d_mesh): the table's gradient half
    all-reduced over x; twice the embedded batch half and twice the batch's per-token
    softmax statistics over y."""
    vocab, hidden, batch, seq = 1024, 8, 8, 8
    return (
        all_reduce_cost(mesh, ("x",), vocab * hidden * 4 / 2)
        + 2 * all_reduce_cost(mesh, ("y",), batch * seq * hidden * 4 / 2)
        + 2 * all_reduce_cost(mesh, ("y",), batch * seq * 4 / 2)
    )


def _moe_1d(mesh):
    """Alpa's MoE layer (test_moe_layer): 4 all-to-alls of the dispatched tokens (batch x seq
    x hidden x 2 in all, capacity factor 2; hlopar's all-to-all price, without Alpa's penalty
    factor) and the attention's, layer norms' and gate's gradients all-reduced."""
    batch, seq, hidden = 64, 16, 64
    attention = {name: leaf for name, leaf in _moe_params().items() if name != "moe"}
    dense = _param_bytes(attention) + [hidden * MOE.num_experts * 4]  # the gate
    return 4 * collective_cost("all-to-all", mesh, ("x",), batch * seq * hidden * 2 * 4 / 4) + sum(
        all_reduce_cost(mesh, ("x",), n) for n in dense
    )


CASES = [
    # test_mlp.py: 6 dense layers with biases, Adam, alpha = beta = 1
    Case("mlp data parallel", lambda: _mlp(6, 256, 32), (4,), (1,), (1,), _data_parallel(_mlp_params(6, 32))),
    Case(
        "mlp model parallel",
        lambda: _mlp(6, 32, 256),
        (4,),
        (1,),
        (1,),
        lambda mesh: 5 * all_reduce_cost(mesh, ("x",), 32 * 256 * 4),
    ),
    Case("mlp 2d mesh", lambda: _mlp(6, 256, 32), (2, 2), (1, 1), (1, 0.1), _mlp_2d),
    Case(
        "mlp zero-2",
        lambda: _mlp(6, 256, 32),
        (4,),
        (1,),
        (1,),
        _data_parallel(_mlp_params(6, 32)),
        "prefer-reduce-scatter=true",
    ),
    # test_bert.py: 2 layers, hidden 4x in the MLP, Adam
    Case(
        "bert layer data parallel",
        lambda: _bert(2, 64, 64, 32, 8),
        (4,),
        (1,),
        (1,),
        _data_parallel(_bert_params(2, 32)),
    ),
    Case(
        "bert layer model parallel",
        lambda: _bert(2, 8, 8, 128, 8),
        (4,),
        (1,),
        (1,),
        lambda mesh: 7 * all_reduce_cost(mesh, ("x",), 8 * 8 * 128 * 4),
    ),
    Case("bert layer 2d mesh", lambda: _bert(2, 8, 8, 128, 8), (2, 2), (2, 2), (1, 0.1), _bert_2d),
    Case(
        "bert layer model parallel remat",
        lambda: _bert(2, 8, 8, 128, 8, remat=True),
        (4,),
        (1,),
        (1,),
        lambda mesh: 11 * all_reduce_cost(mesh, ("x",), 8 * 8 * 128 * 4),
    ),
    Case("tied embedding 2d mesh", lambda: _tied_embedding(1024, 8, 8, 8), (2, 2), (1, 1), (1, 1), _tied_embedding_2d),
    Case(
        "bert layer zero-2",
        lambda: _bert(2, 64, 64, 32, 8),
        (4,),
        (1,),
        (1,),
        _data_parallel(_bert_params(2, 32)),
        "prefer-reduce-scatter=true",
    ),
    Case(
        "bert mlm data parallel",
        lambda: _bert_mlm(2, 32, 32, 16, 4, 128),
        (4,),
        (1,),
        (1,),
        _data_parallel(_bert_mlm_params(2, 16, 128, 32)),
    ),
    Case(
        "bert mlm zero-2",
        lambda: _bert_mlm(2, 32, 32, 16, 4, 128),
        (4,),
        (1,),
        (1,),
        _data_parallel(_bert_mlm_params(2, 16, 128, 32)),
        "prefer-reduce-scatter=true",
    ),
    # test_conv.py: 3 layers, batch 16, 16x16 images of 4 channels, SGD with momentum
    Case(
        "conv data parallel",
        lambda: _conv(3, 16, 16, 4),
        (4,),
        (1,),
        (1,),
        lambda mesh: _data_parallel(_conv_shapes(3, 4)[0])(mesh) + 2 * _data_parallel(_conv_shapes(3, 4)[1])(mesh),
    ),
    Case(
        "conv zero-2",
        lambda: _conv(3, 16, 16, 4),
        (4,),
        (1,),
        (1,),
        lambda mesh: _data_parallel(_conv_shapes(3, 4)[0])(mesh) + 2 * _data_parallel(_conv_shapes(3, 4)[1])(mesh),
        "prefer-reduce-scatter=true",
    ),
    # test_moe.py: batch 64, seq 16, hidden 64, 16 heads, 16 experts in groups of 32 tokens
    Case("moe layer", lambda: _moe_layer(64, 16), (4,), (1,), (1,), _moe_1d),
]
# Kept out of the default suite (each 5-18 s on two shared cores): the 2-D BERT layer's plan,
# and the cases whose finding another case of the default suite shows too.
HEAVY = {"bert layer 2d mesh", "bert layer zero-2", "bert mlm zero-2", "bert layer model parallel remat"}


@functools.cache
def _planned(case: Case):
    """The plan's report and the compiled program's HLO (cached: two tests read each)."""
    mesh = "x".join(map(str, case.mesh))
    return tool.plan_and_compile(parse_module(case.program()), mesh, "cpu", case.pass_options())


def _compiled(case: Case):
    report, hlo = _planned(case)
    return tool.compiled_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"])


def _communication_s(case: Case) -> float:
    report, _ = _planned(case)
    return _communication(report, _compiled(case), case.logical_mesh)


def _communication(report: dict, compiled, mesh) -> float:
    """The compiled collectives' time on the case's links; an all-reduce that stands for a
    planned reduce-scatter (XLA's CPU backend has none) costed as that reduce-scatter."""
    planned_scatters = [c for c in tool.predicted_collectives(report) if c[0] == "reduce-scatter"]
    total = 0.0
    for kind, axes, nbytes in compiled:
        if kind == "all-reduce" and ("reduce-scatter", axes, nbytes) in planned_scatters:
            planned_scatters.remove(("reduce-scatter", axes, nbytes))
            kind = "reduce-scatter"
        total += collective_cost(kind, mesh, axes, nbytes)
    return total


_LAYER_NORM_SLICES = (
    "hlopar keeps the attention and MLP outputs split over hidden between the reduce-scatter "
    "and the all-gather that stand for Alpa's all-reduce, and all-reduces each layer norm's "
    "statistics (256-512 B) there, for the elementwise compute that saves (Alpa's objective "
    "prices none; Alpa's plan priced by hlopar's model was not measured)"
)
KNOWN_DEARER = {
    "bert layer model parallel": f"measured +2.1 %: {_LAYER_NORM_SLICES}",
    **dict.fromkeys(
        ("bert mlm data parallel", "bert mlm zero-2"),
        "measured +10.7 % with the default options: the tied word embedding's gradient is reduced "
        "twice (its lookup's scatter and the decoder's dot, each a reduce-scatter of 8 KiB) and then "
        "summed; partial-sums=true reduces it once (test_partial_sums_reduce_a_tied_weight_once)",
    ),
    "conv zero-2": "measured +29 %: prefer-reduce-scatter prices each byte a replicated state "
    "holds beyond its split layout at one transfer; with that price, keeping the second and "
    "third kernels split (gathered for the forward and again for the backward, 2 all-gathers "
    "of 576 B Alpa does not have) is 4.4 ns a kernel cheaper in the objective than whole "
    "(gathered after the update): the preference's price, not the solver",
}


def _params(known: dict[str, str] | None = None):
    marks = {c.name: [pytest.mark.heavy] if c.name in HEAVY else [] for c in CASES}
    for name, reason in (known or {}).items():
        marks[name].append(pytest.mark.xfail(strict=True, reason=reason))
    return [pytest.param(c, marks=marks[c.name], id=c.name) for c in CASES]


@pytest.mark.parametrize("case", _params(KNOWN_DEARER))
def test_plan_communicates_no_more_than_alpa_states(case):
    report, _ = _planned(case)
    assert report["status"] == "OPTIMAL"
    assert _communication_s(case) <= 1.01 * case.alpa_cost(case.logical_mesh)


@pytest.mark.parametrize("case", _params())
def test_compiled_collectives_are_the_planned_ones(case):
    report, _ = _planned(case)
    fidelity = tool.compare(tool.predicted_collectives(report), _compiled(case))
    assert fidelity.rate == 1.0, "\n".join(fidelity.notes)


@pytest.mark.parametrize("case", _params())
def test_merging_misses_the_optimum(case):
    """Alpa's merging (`merge=true`) solves a restriction of the program's ILP: its plan is
    one the default could choose, so never cheaper; on these cases 0.01 to 3.8 % dearer (MoE)."""
    report, _ = _planned(case)
    mesh = "x".join(map(str, case.mesh))
    merged = tool.plan(parse_module(case.program()), mesh, "cpu", f"{case.pass_options()} merge=true")
    assert (report["status"], merged["status"]) == ("OPTIMAL", "FEASIBLE")
    assert report["objective_s"] < merged["objective_s"] <= 1.04 * report["objective_s"]


# --- gradient accumulation (test_gradient_accumulation.py) -------------------------------------


def _loop_body_collectives(hlo: str, mesh_shape, axes) -> list:
    """The collectives of the computations that `while` loops run as their bodies."""
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo))
    found, current = [], None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
        elif current in bodies:
            found += tool.compiled_collectives(line, mesh_shape, axes)
    return found


@pytest.mark.parametrize(
    "mesh, loop", [((4,), "fori_loop"), ((2, 2), "fori_loop"), ((4,), "scan")], ids=["1d", "2d", "scan"]
)
def test_gradient_accumulation_syncs_once_per_step(mesh, loop):
    """Alpa's case: batch 256 in 2 microbatches, two dense layers of 16, momentum, alpha =
    beta = 1; it asserts the gradients' all-reduce(s) in the accumulation and none in the
    loop of microbatches. With partial-sum layouts (`partial-sums=true`, not yet the
    default: docs/auto_sharding.md) the gradients' sums stay pending through
    the loop and are reduced once, over every axis the batch is split over: four reductions
    (two weights, two biases; reduce-scattered for the update, which XLA's CPU backend
    compiles as all-reduces), as planned; the step equals one device's. The same with the
    microbatches in a `lax.scan` (its carry is the accumulator), as a Flax loop writes it."""
    links = ["latency=" + ",".join(["1e-09"] * len(mesh)), "bandwidth=" + ",".join(["1e+09"] * len(mesh))]
    options = " ".join([*links, "partial-sums=true"])
    module = parse_module(_accumulating_mlp(256, 2, 16, loop))
    report = tool.plan(module, "x".join(map(str, mesh)), "cpu", options)
    executable = compile_spmd(module, jax.devices()[: math.prod(mesh)])
    hlo = executable.executable.hlo_modules()[0].to_string()
    compiled = tool.compiled_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"])
    axes = tuple(report["mesh"]["axes"])
    reductions = [(axes_, nbytes) for kind, axes_, nbytes in compiled if kind in ("all-reduce", "reduce-scatter")]
    assert sorted(reductions) == [(axes, 64), (axes, 64), (axes, 1024), (axes, 1024)]
    assert tool.compare(tool.predicted_collectives(report), compiled).rate == 1.0
    assert _loop_body_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"]) == []
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    params = [(jax.random.normal(keys[2 * i], (16, 16)), jax.random.normal(keys[2 * i + 1], (16,))) for i in range(2)]
    x, y = jax.random.normal(keys[4], (256, 16)), jax.random.normal(keys[5], (256, 16))
    args = (params, MOMENTUM.init(params), x, y)
    expected = jax.jit(_accumulating_step(256, 2, 16, loop))(*args)
    outputs = executable(*jax.tree.leaves(args))
    actual = jax.tree.unflatten(jax.tree.structure(expected), [np.asarray(o) for o in outputs])
    # Each gradient summed over the devices' addends instead of at once: float32 rounding.
    assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_without_partial_sums_each_microbatch_is_reduced_in_the_loop():
    """The default (`partial-sums=false`): the accumulator is a reduced value, so each
    microbatch's gradients are reduced inside the loop."""
    module = parse_module(_accumulating_mlp(256, 2, 16))
    report = tool.plan(module, "4", "cpu", "latency=1e-09 bandwidth=1e+09")
    hlo = compile_spmd(module, jax.devices()[:4]).executable.hlo_modules()[0].to_string()
    inside = _loop_body_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"])
    assert len(inside) >= 4 and {kind for kind, _, _ in inside} <= {"all-reduce", "reduce-scatter"}


def test_partial_sums_reduce_a_tied_weight_once():
    """BERT MLM's word embedding is read twice, by the lookup and by the decoder, so its
    gradient is the sum of a scatter-add's and a product's, both summing over the batch
    (Alpa's case above, data parallel on 4). With partial-sum layouts both stay pending, are
    added, and the sum is reduced once, where Adam reads it (one conversion for its several
    readers): the plan meets Alpa's stated cost, which the default misses by 10.7 %
    (`KNOWN_DEARER`); predicted equals compiled; the step equals one device's."""
    case = next(c for c in CASES if c.name == "bert mlm data parallel")
    text = case.program()
    module = parse_module(text)
    report = tool.plan(module, "4", "cpu", f"{case.pass_options()} partial-sums=true")
    executable = compile_spmd(module, jax.devices()[:4])
    hlo = executable.executable.hlo_modules()[0].to_string()
    compiled = tool.compiled_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"])
    assert tool.compare(tool.predicted_collectives(report), compiled).rate == 1.0
    assert _communication(report, compiled, case.logical_mesh) <= 1.01 * case.alpa_cost(case.logical_mesh)
    assert "unreduced" in print_module(module)
    rng = np.random.default_rng(0)
    one = ModuleStep(text)
    # Token ids below the vocabulary; the rest positive (Adam's second moments are).
    args = [
        rng.integers(0, 16, size=a.shape).astype(a.dtype)
        if np.issubdtype(a.dtype, np.integer)
        else np.abs(0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        for a in one.in_info
    ]
    expected = one(*args)
    actual = executable(*args)
    assert len(actual) == len(expected) == 103
    # Gradients summed over 4 devices' addends in another order: float32 rounding.
    assert_trees_close([np.asarray(a) for a in actual], list(expected), rtol=1e-5, atol=1e-7)


def test_checkpointed_values_keep_their_planned_layout():
    """`jax.checkpoint`'s optimization barrier passes values through: each result is read in
    its operand's planned layout, through a sharding constraint, as XLA would otherwise
    propagate a layout of its own to it and convert it inside the recomputed forward (the
    remat case above compiled two all-gathers of 32 KiB the plan did not have)."""
    case = next(c for c in CASES if c.name == "bert layer model parallel remat")
    module = parse_module(case.program())
    tool.plan(module, "4", "cpu", case.pass_options())
    barriers = [
        op.mlir_op for op in FuncGraph.from_module(module).walk() if op.name == "stablehlo.optimization_barrier"
    ]
    assert len(barriers) == 2
    readers = {use.owner.name for barrier in barriers for result in barrier.results for use in result.uses}
    assert readers == {"sdy.sharding_constraint"}
