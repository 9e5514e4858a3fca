"""Training steps whose layers run under `scan`, the style of large-model code bases.

Two tiny decoder-only Transformers (token embedding, a stack of pre-LayerNorm blocks with
causal self-attention and an MLP, a final LayerNorm and an output projection, a mean
cross-entropy loss), their per-layer parameters stacked along a leading layer axis and the
blocks run by one loop (`stablehlo.while`, forward and backward):

- `gpt_scan`: plain JAX, `jax.lax.scan` over the stacked parameters, optax Adam (or SGD);
- `flax_scan`: Flax linen, `nn.scan(Block, variable_axes={"params": 0}, ...)` and a
  `flax.training.train_state.TrainState`, as the Flax documentation writes a scanned stack.

`remat=True` wraps each block in `jax.checkpoint` (`nn.remat` for Flax), as large models do.

Importable as ``scan_steps`` from every test folder (test/support is on ``sys.path``, pyproject's
pytest ``pythonpath``). Each builder returns ``(step, args)``: `step` exactly as a user hands it to
`jax.jit`, `args` its first arguments. The convention of both: the batch is the LAST argument
(a dict of int32 ``tokens`` and ``targets``, `BATCH` x `SEQ`), the step returns the new training
state (the arguments before the batch, in order) followed by the loss, so
`next_args(args, results)` gives the next step's arguments, `loss_of(results)` the loss and
`params_of(args or results)` the parameters.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

BATCH, SEQ, VOCAB, WIDTH, HEADS, LAYERS = 8, 8, 16, 16, 2, 3
LR = 0.01


def batch(seed: int = 1, size: int = BATCH) -> dict:
    """Next-token prediction on random tokens: ``targets`` are ``tokens`` shifted by one."""
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (size, SEQ + 1), 0, VOCAB, jnp.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def next_args(args: tuple, results: tuple) -> tuple:
    """The next step's arguments: the returned state, the same batch."""
    return (*results[:-1], args[-1])


def loss_of(results: tuple) -> jax.Array:
    return results[-1]


def params_of(tree: tuple):
    """The parameters among a step's arguments or results: the first, or a TrainState's."""
    return tree[0].params if hasattr(tree[0], "params") else tree[0]


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ----------------------------------------------------------------- plain JAX, lax.scan


def init_gpt(seed: int = 0, layers: int = LAYERS) -> dict:
    """GPT parameters; `blocks` holds every layer's, stacked along axis 0."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))

    def normal(*shape, scale=0.2):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = {
        "ln1_scale": jnp.ones((layers, WIDTH)),
        "ln1_bias": jnp.zeros((layers, WIDTH)),
        "qkv": normal(layers, WIDTH, 3 * WIDTH),
        "qkv_bias": jnp.zeros((layers, 3 * WIDTH)),
        "proj": normal(layers, WIDTH, WIDTH),
        "proj_bias": jnp.zeros((layers, WIDTH)),
        "ln2_scale": jnp.ones((layers, WIDTH)),
        "ln2_bias": jnp.zeros((layers, WIDTH)),
        "fc1": normal(layers, WIDTH, 4 * WIDTH),
        "fc1_bias": jnp.zeros((layers, 4 * WIDTH)),
        "fc2": normal(layers, 4 * WIDTH, WIDTH),
        "fc2_bias": jnp.zeros((layers, WIDTH)),
    }
    return {
        "embed": normal(VOCAB, WIDTH),
        "pos": normal(SEQ, WIDTH),
        "blocks": blocks,
        "ln_f_scale": jnp.ones(WIDTH),
        "ln_f_bias": jnp.zeros(WIDTH),
        "head": normal(WIDTH, VOCAB),
    }


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _block(x, p):
    """One pre-LayerNorm Transformer block on (batch, seq, width), `p` one layer's parameters."""
    b, t, d = x.shape
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q, k, v = jnp.split(h @ p["qkv"] + p["qkv_bias"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
    causal = jnp.tril(jnp.ones((t, t), bool))
    attention = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(b, t, d)
    x = x + y @ p["proj"] + p["proj_bias"]
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["fc1"] + p["fc1_bias"]) @ p["fc2"] + p["fc2_bias"]


def gpt_loss(params: dict, tokens: jax.Array, targets: jax.Array, *, remat: bool = False) -> jax.Array:
    block = jax.checkpoint(_block) if remat else _block

    def layer(x, p):
        return block(x, p), None

    x = params["embed"][tokens] + params["pos"]
    x, _ = jax.lax.scan(layer, x, params["blocks"])
    x = _layer_norm(x, params["ln_f_scale"], params["ln_f_bias"])
    return _cross_entropy(x @ params["head"], targets)


def gpt_scan(*, remat: bool = False, optimizer: str = "adam", layers: int = LAYERS, seed: int = 0):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with optax Adam, as optax's
    quick start writes it (``optimizer="sgd"``: ``step(params, batch) -> (params, loss)``, SGD by
    hand), and its first arguments."""
    params = init_gpt(seed, layers)
    if optimizer == "sgd":

        def sgd_step(params, batch):
            loss, grads = jax.value_and_grad(gpt_loss)(params, batch["tokens"], batch["targets"], remat=remat)
            return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), loss

        return sgd_step, (params, batch())
    tx = optax.adam(LR)

    def adam_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(gpt_loss)(params, batch["tokens"], batch["targets"], remat=remat)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return adam_step, (params, tx.init(params), batch())


# ----------------------------------------------------------------- Flax linen, nn.scan


class Block(nn.Module):
    """A pre-LayerNorm block; `__call__(carry, mask) -> (carry, None)`, the form `nn.scan` takes."""

    @nn.compact
    def __call__(self, x, mask):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=mask)
        x = x + y
        y = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(y)), None


class ScannedTransformer(nn.Module):
    layers: int = LAYERS
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.2), (SEQ, WIDTH))
        block = nn.remat(Block) if self.remat else Block
        stack = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast, length=self.layers
        )
        x, _ = stack(name="blocks")(x, nn.make_causal_mask(tokens))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def flax_scan(*, remat: bool = False, layers: int = LAYERS, seed: int = 0):
    """``train_step(state, batch) -> (state, loss)`` with a `TrainState` and `optax.adam`, as the
    Flax quick start writes it, and its first arguments."""
    model = ScannedTransformer(layers=layers, remat=remat)
    params = model.init(jax.random.PRNGKey(seed), jnp.ones((1, SEQ), jnp.int32))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["tokens"])
            return _cross_entropy(logits, batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step, (state, batch())
