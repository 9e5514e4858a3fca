"""GPT-3 style decoder-only language model (Brown et al., 2020), in jax.numpy.

Token and learned position embeddings, `num_layers` pre-LN transformer blocks (causal
multi-head self-attention, GELU MLP with a 4x hidden size), a final LayerNorm and logits by
the tied token embedding; softmax cross-entropy by gather (`take_along_axis`), averaged over
batch and positions.

Configurations: Alpa (Zheng et al., OSDI'22), Appendix B, Table 6 (hidden size, #layers,
#heads), with sequence length 1024 and vocabulary 51200 for all models (Appendix B) and the
global batch size 1024 of Table 4. Table 4 lists FP16 for GPT-3; the default dtype here is
float32 (``dtype`` is a config field), and ``<name>-fp16`` (for the Table 6 names) is the same
model in Alpa's precision, mixed precision as Alpa's benchmarks train it (Micikevicius et al.,
ICLR 2018): float16 parameters, activations and gradients for the forward and backward, a
float32 master copy of the weights and float32 Adam moments for the update (``master_dtype``;
16 bytes per parameter with the gradients, see `hlopar.models.adam`), no loss scaling. A custom
config with ``dtype="float16"`` and no ``master_dtype`` keeps everything in float16 (8 bytes).
The parameter counts these give (`param_count`):
350M -> 0.356B, 1.3B -> 1.316B, 2.6B -> 2.651B, 6.7B -> 6.658B, 15B -> 15.37B, 39B -> 39.09B.

The layers are a Python loop (unrolled, no `lax.scan`) inside ``jax.named_scope("layer_<i>")``,
so each layer is its own run of ops in the IR and its ops' locations carry its name. With
``scan_layers=True`` (configurations ``<name>-scan``) the layers' parameters are stacked along a
leading layer axis and the blocks run under ``jax.lax.scan``, the style of large-model code
bases: the IR holds one block, inside a ``stablehlo.while``, whatever the depth
(``<name>-fp16-scan`` in mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hlopar.models import layers as L
from hlopar.models.adam import AdamConfig
from hlopar.models.common import TrainStep, resolve_config, train_step_for


@dataclass(frozen=True)
class GPTConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int = 1024
    vocab_size: int = 51200
    batch_size: int = 1024
    dtype: str = "float32"
    scan_layers: bool = False  # stacked layer parameters, blocks under lax.scan
    master_dtype: str | None = None  # mixed precision: Adam's master weights and moments' dtype

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.hidden_size


GPT_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(hidden_size=64, num_layers=2, num_heads=4, seq_len=16, vocab_size=128, batch_size=4),
    # Alpa, Table 6: #params, hidden size, #layers, #heads.
    "350M": GPTConfig(hidden_size=1024, num_layers=24, num_heads=16),
    "1.3B": GPTConfig(hidden_size=2048, num_layers=24, num_heads=32),
    "2.6B": GPTConfig(hidden_size=2560, num_layers=32, num_heads=32),
    "6.7B": GPTConfig(hidden_size=4096, num_layers=32, num_heads=32),
    "15B": GPTConfig(hidden_size=5120, num_layers=48, num_heads=32),
    "39B": GPTConfig(hidden_size=8192, num_layers=48, num_heads=64),
}
GPT_CONFIGS.update(
    {
        f"{name}-fp16": replace(config, dtype="float16", master_dtype="float32")  # Alpa's, Table 4
        for name, config in list(GPT_CONFIGS.items())
        if name != "tiny"
    }
)
GPT_CONFIGS.update({f"{name}-scan": replace(config, scan_layers=True) for name, config in list(GPT_CONFIGS.items())})


def param_specs(config: GPTConfig):
    """The parameters as a tree of `ParamSpec`."""
    dtype, d = config.dtype, config.hidden_size
    block = L.init_transformer_block(d, config.ffn_hidden, dtype)
    if config.scan_layers:
        layers = jax.tree_util.tree_map(lambda s: replace(s, shape=(config.num_layers,) + s.shape), block)
    else:
        layers = [block] * config.num_layers
    return {
        "embed": {
            "tokens": L.normal((config.vocab_size, d), dtype),
            "positions": L.normal((config.seq_len, d), dtype),
        },
        "layers": layers,
        "final_ln": L.init_layer_norm(d, dtype),
    }


def forward(config: GPTConfig, params, tokens: jax.Array) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` for ``tokens: int32[batch, seq]``."""
    with jax.named_scope("embed"):
        x = jnp.take(params["embed"]["tokens"], tokens, axis=0)
        x = x + params["embed"]["positions"][None, : tokens.shape[1]]
    if config.scan_layers:

        def block(x, layer):
            return L.transformer_block(layer, x, config.num_heads, causal=True), None

        with jax.named_scope("layers"):
            x, _ = jax.lax.scan(block, x, params["layers"])
    else:
        for i, layer in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = L.transformer_block(layer, x, config.num_heads, causal=True)
    with jax.named_scope("head"):
        x = L.layer_norm(params["final_ln"], x)
        return jnp.einsum("bsd,vd->bsv", x, params["embed"]["tokens"])


def loss_fn(config: GPTConfig, params, batch) -> jax.Array:
    """Next-token cross-entropy, mean over batch and positions."""
    logits = forward(config, params, batch["tokens"])
    with jax.named_scope("loss"):
        return L.softmax_cross_entropy(logits, batch["labels"])


def make_batch(config: GPTConfig, rng: jax.Array):
    """Random tokens; the labels are the tokens shifted by one (next-token prediction)."""
    seq = jax.random.randint(rng, (config.batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:]}


def train_step(config: str | GPTConfig = "tiny", optimizer: AdamConfig | None = None) -> TrainStep:
    """The GPT training step of a named configuration (see `GPT_CONFIGS`) or a `GPTConfig`."""
    cfg = resolve_config("gpt", GPT_CONFIGS, GPTConfig, config)
    optimizer = replace(optimizer or AdamConfig(), master_dtype=cfg.master_dtype)
    return train_step_for(
        "gpt", GPT_CONFIGS, cfg, param_specs=param_specs, loss_fn=loss_fn, make_batch=make_batch, optimizer=optimizer
    )
