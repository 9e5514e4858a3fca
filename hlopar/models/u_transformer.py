"""U-Transformer: a stack of transformer layers with U-Net-style long skip connections.

The cross-mesh resharding paper (Zhuang et al., MLSys'23, §5.2) evaluates a U-Transformer
(Petit et al., 2021), a U-Net that inserts attention layers after its convolutions: "the i-th
layer sends its output activation to not only the next layer, but also the i-th layer from
last". These long skips are what make cross-mesh communication the bottleneck once the model
is cut into pipeline stages, and they are the part of the model this file keeps: a stack of
`num_layers` (even) pre-LN transformer layers at a constant width, where layer
``L-1-i`` (for ``i < L/2``) receives, besides the previous layer's output ``x``, the output
``s_i`` of layer ``i``, merged U-Net style by concatenation and a linear projection,
``x' = [x, s_i] W_skip + b`` (``W_skip: [2d, d]``), before its transformer block. For the
middle pair (``i = L/2-1``, ``L-1-i = L/2``) the skip comes from the adjacent layer, as the
literal rule says. The convolutions and the resolution changes of the original U-Net are not
modelled: the input is a sequence of patch features (``in_dim`` each) mapped to the model width
by a linear layer, and the output is mapped back and trained with a mean-squared error
against targets of the same shape, the regression objective of a diffusion U-Net.

Configuration: the paper's Table 3 gives only batch size 2048, 2.1B parameters and FP32 for
"U-Trans case1"; the width, depth, heads and sequence length here (d=2048, 38 layers,
16 heads, 256 patches of 64 features) are hlopar's choice to reach that size:
``param_count`` = 2.07B.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from hlopar.models import layers as L
from hlopar.models.adam import AdamConfig
from hlopar.models.common import TrainStep, dtype_of, keys, resolve_config, train_step_for


@dataclass(frozen=True)
class UTransformerConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    in_dim: int
    batch_size: int
    ffn_multiplier: int = 4
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_layers % 2:
            raise ValueError(f"num_layers must be even, got {self.num_layers}")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_multiplier * self.hidden_size

    def skip_source(self, layer: int) -> int | None:
        """The layer whose output `layer` receives as a long skip, or None."""
        if layer < self.num_layers // 2:
            return None
        return self.num_layers - 1 - layer


U_TRANSFORMER_CONFIGS: dict[str, UTransformerConfig] = {
    "tiny": UTransformerConfig(hidden_size=32, num_layers=4, num_heads=4, seq_len=8, in_dim=8, batch_size=4),
    # Cross-mesh resharding paper, Table 3 ("U-Trans case1": batch 2048, 2.1B, FP32).
    "2.1B": UTransformerConfig(hidden_size=2048, num_layers=38, num_heads=16, seq_len=256, in_dim=64, batch_size=2048),
}


def param_specs(config: UTransformerConfig):
    """The parameters as a tree of `ParamSpec`."""
    dtype, d = config.dtype, config.hidden_size
    layers = []
    for i in range(config.num_layers):
        layer = {"block": L.init_transformer_block(d, config.ffn_hidden, dtype)}
        if config.skip_source(i) is not None:
            layer["skip"] = L.init_dense(2 * d, d, dtype)
        layers.append(layer)
    return {
        "in_proj": L.init_dense(config.in_dim, d, dtype),
        "layers": layers,
        "final_ln": L.init_layer_norm(d, dtype),
        "out_proj": L.init_dense(d, config.in_dim, dtype),
    }


def forward(config: UTransformerConfig, params, inputs: jax.Array) -> jax.Array:
    """Predictions ``[batch, seq, in_dim]`` for ``inputs: [batch, seq, in_dim]``."""
    with jax.named_scope("in_proj"):
        x = L.dense(params["in_proj"], inputs.astype(dtype_of(config.dtype)))
    outputs = []
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            source = config.skip_source(i)
            if source is not None:
                x = L.dense(layer["skip"], jnp.concatenate([x, outputs[source]], axis=-1))
            x = L.transformer_block(layer["block"], x, config.num_heads, causal=False)
        outputs.append(x)
    with jax.named_scope("head"):
        return L.dense(params["out_proj"], L.layer_norm(params["final_ln"], x))


def loss_fn(config: UTransformerConfig, params, batch) -> jax.Array:
    """Mean-squared error, mean over batch, positions and features."""
    pred = forward(config, params, batch["inputs"])
    with jax.named_scope("loss"):
        diff = L.at_least_f32(pred) - L.at_least_f32(batch["targets"])
        return jnp.mean(jnp.square(diff))


def make_batch(config: UTransformerConfig, rng: jax.Array):
    k_in, k_tgt = keys(rng, 2)
    shape = (config.batch_size, config.seq_len, config.in_dim)
    dtype = dtype_of(config.dtype)
    return {
        "inputs": jax.random.normal(k_in, shape, dtype),
        "targets": jax.random.normal(k_tgt, shape, dtype),
    }


def train_step(config: str | UTransformerConfig = "tiny", optimizer: AdamConfig | None = None) -> TrainStep:
    """The U-Transformer training step of a named configuration (`U_TRANSFORMER_CONFIGS`)."""
    cfg = resolve_config("u_transformer", U_TRANSFORMER_CONFIGS, UTransformerConfig, config)
    return train_step_for(
        "u_transformer",
        U_TRANSFORMER_CONFIGS,
        cfg,
        param_specs=param_specs,
        loss_fn=loss_fn,
        make_batch=make_batch,
        optimizer=optimizer,
    )
