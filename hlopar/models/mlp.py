"""A multi-layer perceptron regressor: dense + ReLU layers and a mean-squared-error loss.

The smallest model of the zoo, for unit tests of the passes: every hidden layer is a
``jax.named_scope("layer_<i>")``, the output layer is linear, and the loss is the MSE
against random targets (mean over batch and output features).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from hlopar.models import layers as L
from hlopar.models.adam import AdamConfig
from hlopar.models.common import TrainStep, dtype_of, keys, resolve_config, train_step_for


@dataclass(frozen=True)
class MLPConfig:
    in_dim: int
    hidden_dims: tuple[int, ...]
    out_dim: int
    batch_size: int
    dtype: str = "float32"

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.in_dim, *self.hidden_dims, self.out_dim)


MLP_CONFIGS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(in_dim=8, hidden_dims=(16, 16), out_dim=4, batch_size=8),
    "small": MLPConfig(in_dim=1024, hidden_dims=(4096, 4096, 4096), out_dim=1024, batch_size=1024),
    # Shapes that call for textbook plans (the auto-sharding tests pin them): activations
    # far larger than weights favour data parallelism; weights far larger than activations
    # favour Megatron-style operator parallelism; both large favour a 2-D mix.
    "large-batch": MLPConfig(in_dim=1024, hidden_dims=(1024, 1024, 1024), out_dim=1024, batch_size=16384),
    "large-hidden": MLPConfig(in_dim=4096, hidden_dims=(16384, 4096, 16384), out_dim=4096, batch_size=64),
    "large-both": MLPConfig(in_dim=4096, hidden_dims=(16384, 4096, 16384), out_dim=4096, batch_size=8192),
}


def param_specs(config: MLPConfig):
    """The parameters as a list of `ParamSpec` dicts, one per layer; He-normal kernels
    (He et al., ICCV 2015) for the ReLU layers."""
    dims = config.dims
    return [
        L.init_dense(d_in, d_out, config.dtype, std=(2.0 / d_in) ** 0.5) for d_in, d_out in zip(dims[:-1], dims[1:])
    ]


def forward(config: MLPConfig, params, x: jax.Array) -> jax.Array:
    x = x.astype(dtype_of(config.dtype))
    for i, layer in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            x = L.dense(layer, x)
            if i < len(params) - 1:
                x = jax.nn.relu(x)
    return x


def loss_fn(config: MLPConfig, params, batch) -> jax.Array:
    pred = forward(config, params, batch["x"])
    with jax.named_scope("loss"):
        diff = L.at_least_f32(pred) - L.at_least_f32(batch["y"])
        return jnp.mean(jnp.square(diff))


def make_batch(config: MLPConfig, rng: jax.Array):
    kx, ky = keys(rng, 2)
    dtype = dtype_of(config.dtype)
    return {
        "x": jax.random.normal(kx, (config.batch_size, config.in_dim), dtype),
        "y": jax.random.normal(ky, (config.batch_size, config.out_dim), dtype),
    }


def train_step(config: str | MLPConfig = "tiny", optimizer: AdamConfig | None = None) -> TrainStep:
    """The MLP training step of a named configuration (see `MLP_CONFIGS`) or an `MLPConfig`."""
    cfg = resolve_config("mlp", MLP_CONFIGS, MLPConfig, config)
    return train_step_for(
        "mlp", MLP_CONFIGS, cfg, param_specs=param_specs, loss_fn=loss_fn, make_batch=make_batch, optimizer=optimizer
    )
