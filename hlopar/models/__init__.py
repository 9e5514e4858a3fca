"""The model zoo: training steps of MLP, GPT, GShard MoE, Wide-ResNet and U-Transformer.

Every model is written with jax.numpy alone, and every named configuration lowers its full
training step (loss, `jax.value_and_grad`, an Adam update) to StableHLO text with abstract
shapes, which is what ``hlopar-opt`` and the passes take:

    from hlopar.models import get_train_step, list_configs
    ts = get_train_step("gpt", "1.3B")
    text = ts.lower()              # "module @jit_step ... func.func public @main ..."
    ts.param_count()               # 1_315_557_376

Small configurations (``"tiny"``) also run for real: ``ts.init(rng)``, ``ts.make_batch(rng)``,
``ts.jitted_step(params, ts.init_opt_state(params), batch)``.

Configurations come from the papers: GPT (Alpa, Table 6), MoE (Alpa, Table 7), Wide-ResNet
(Alpa, Table 8), U-Transformer (cross-mesh resharding paper, Table 3); see each module.
"""

from __future__ import annotations

from hlopar.models import gpt, mlp, moe, u_transformer, wide_resnet
from hlopar.models.adam import AdamConfig, AdamState, adam_update, init_adam
from hlopar.models.common import ModelFamily, TrainStep, UnknownModelError, count_ops

MODELS: dict[str, ModelFamily] = {
    "mlp": ModelFamily("mlp", mlp.MLP_CONFIGS, mlp.train_step, mlp.MLPConfig),
    "gpt": ModelFamily("gpt", gpt.GPT_CONFIGS, gpt.train_step, gpt.GPTConfig),
    "moe": ModelFamily("moe", moe.MOE_CONFIGS, moe.train_step, moe.MoEConfig),
    "wide_resnet": ModelFamily(
        "wide_resnet",
        wide_resnet.WIDE_RESNET_CONFIGS,
        wide_resnet.train_step,
        wide_resnet.WideResNetConfig,
    ),
    "u_transformer": ModelFamily(
        "u_transformer",
        u_transformer.U_TRANSFORMER_CONFIGS,
        u_transformer.train_step,
        u_transformer.UTransformerConfig,
    ),
}


def _family(model: str) -> ModelFamily:
    try:
        return MODELS[model]
    except KeyError:
        raise UnknownModelError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def list_configs(model: str) -> list[str]:
    """Names of `model`'s configurations, smallest first."""
    return list(_family(model).configs)


def get_train_step(model: str, config: str) -> TrainStep:
    """The `TrainStep` of a model family and one of its named configurations.

    Raises `UnknownModelError` (a `LookupError`) naming the valid choices.
    """
    return _family(model).get(config)


__all__ = [
    "MODELS",
    "AdamConfig",
    "AdamState",
    "ModelFamily",
    "TrainStep",
    "UnknownModelError",
    "adam_update",
    "count_ops",
    "get_train_step",
    "init_adam",
    "list_configs",
]
