"""Building blocks shared by the zoo's models, as pure functions over dicts of arrays.

Each block has an ``init_*(...)`` giving its parameters as a tree of `ParamSpec` (shapes,
dtypes and initializers; see `hlopar.models.common.materialize`) and an apply function
``*(params, x)``. Parameters are plain nested dicts (and lists for stacks of layers), so that
their order in the lowered ``@main`` signature is predictable: `jax.tree_util` flattens dict
keys sorted and lists in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hlopar.models.common import ParamSpec

# GPT-2/GPT-3 style initialization scale for weight matrices (Radford et al., 2019).
INIT_STD = 0.02


def at_least_f32(x):
    """`x` in float32, or in its own dtype where that is wider (float64 stays float64).

    Normalization statistics, softmaxes and losses are computed this way, so that float16
    models stay stable and float64 models (gradient checks) lose no precision.
    """
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def normal(shape, dtype: str, std: float = INIT_STD) -> ParamSpec:
    """A parameter drawn from normal(0, std)."""
    return ParamSpec(tuple(shape), dtype, std=std)


def constant(shape, dtype: str, value: float = 0.0) -> ParamSpec:
    """A parameter initialized to `value`."""
    return ParamSpec(tuple(shape), dtype, value=value)


def init_dense(d_in: int, d_out: int, dtype: str, *, bias: bool = True, std=INIT_STD):
    params = {"kernel": normal((d_in, d_out), dtype, std)}
    if bias:
        params["bias"] = constant((d_out,), dtype)
    return params


def dense(params, x):
    y = jnp.dot(x, params["kernel"])
    if "bias" in params:
        y = y + params["bias"]
    return y


def init_layer_norm(d: int, dtype: str):
    return {"scale": constant((d,), dtype, 1.0), "bias": constant((d,), dtype)}


def layer_norm(params, x, eps: float = 1e-5):
    """LayerNorm over the last axis (Ba et al., 2016); statistics in at least float32."""
    x32 = at_least_f32(x)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return y * params["scale"] + params["bias"]


def init_attention(d: int, dtype: str):
    return {"qkv": init_dense(d, 3 * d, dtype), "out": init_dense(d, d, dtype)}


def attention(params, x, num_heads: int, *, causal: bool):
    """Multi-head self-attention (Vaswani et al., 2017) on ``x: [batch, seq, d]``."""
    b, s, d = x.shape
    head_dim = d // num_heads
    qkv = dense(params["qkv"], x).reshape(b, s, 3, num_heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = at_least_f32(jnp.einsum("bqhd,bkhd->bhqk", q, k)) / jnp.sqrt(head_dim)
    if causal:
        mask = jnp.tril(jnp.ones((s, s), jnp.bool_))
        scores = jnp.where(mask, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return dense(params["out"], ctx)


def init_mlp_block(d: int, hidden: int, dtype: str):
    return {"fc1": init_dense(d, hidden, dtype), "fc2": init_dense(hidden, d, dtype)}


def mlp_block(params, x):
    return dense(params["fc2"], jax.nn.gelu(dense(params["fc1"], x)))


def init_transformer_block(d: int, ffn_hidden: int, dtype: str, *, with_mlp: bool = True):
    """A pre-LN block's parameters; ``with_mlp=False`` leaves the feed-forward part out
    (the MoE model puts its expert layer there)."""
    params = {
        "ln1": init_layer_norm(d, dtype),
        "attn": init_attention(d, dtype),
        "ln2": init_layer_norm(d, dtype),
    }
    if with_mlp:
        params["mlp"] = init_mlp_block(d, ffn_hidden, dtype)
    return params


def transformer_block(params, x, num_heads: int, *, causal: bool):
    """Pre-LN block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (GPT-2/3 ordering)."""
    x = x + attention(params["attn"], layer_norm(params["ln1"], x), num_heads, causal=causal)
    return x + mlp_block(params["mlp"], layer_norm(params["ln2"], x))


def softmax_cross_entropy(logits, labels):
    """Mean over all leading positions of ``-log softmax(logits)[label]`` (at least float32)."""
    logp = jax.nn.log_softmax(at_least_f32(logits), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)
