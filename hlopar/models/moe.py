"""GShard mixture-of-experts language model (Lepikhin et al., ICLR 2021), in jax.numpy.

A causal transformer LM like `hlopar.models.gpt` in which every other block (the odd ones,
``layer_1``, ``layer_3``, ...) replaces its MLP by a mixture-of-experts layer, as in Alpa
(Zheng et al., OSDI'22, §8.1: "mixture-of-experts layers are used to replace the MLP at the
end of a transformer, every two layers").

The MoE layer follows GShard's Algorithm 1 / Figure 2: tokens are cut into groups of
`group_size`; a softmax gate picks each token's top-2 experts; each expert takes at most
``capacity = ceil(capacity_factor * group_size / num_experts)`` tokens per group (GShard's
``2N/E`` with the default factor 2), tokens past capacity are dropped (their MoE output is
zero and the residual carries them); the ``dispatch`` and ``combine`` tensors
``[groups, group_size, experts, capacity]`` move tokens to the experts and back with einsums,
and each expert is a GELU feed-forward net. GShard routes the second expert at random with
probability proportional to its gate; here it is routed whenever it fits, so the step is
deterministic. The auxiliary load-balancing loss is GShard's ``mean_gate_e * frac_e`` term
(``frac_e``: the share of tokens whose first choice is expert e), as
``E * sum_e(mean_gate_e * frac_e)`` (the normalization of Switch Transformer, Fedus et al.,
2022: 1 for an even split), averaged over groups and MoE layers, weighted by
`aux_loss_weight`. With the default ``group_size = seq_len`` a group is one sequence, so the
whole loss stays a mean over the batch's sequences.

Configurations: Alpa, Appendix B, Table 7 (hidden size, #layers, #heads, #experts), sequence
length 1024 and vocabulary 32000 (Appendix B), global batch size 1024 (Table 4). Table 7
gives no FFN width; a feed-forward hidden size of 8x the model width (dense and expert FFNs
alike) is what reproduces its #params column: 380M -> 0.384B, 1.3B -> 1.348B, 2.4B -> 2.384B,
10B -> 10.17B, 27B -> 26.65B, 70B -> 70.42B (`param_count`). Table 4 lists FP16; the default
dtype here is float32 (``dtype`` is a config field).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from hlopar.models import layers as L
from hlopar.models.adam import AdamConfig
from hlopar.models.common import TrainStep, resolve_config, train_step_for


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_experts: int
    seq_len: int = 1024
    vocab_size: int = 32000
    batch_size: int = 1024
    ffn_multiplier: int = 8
    group_size: int = 1024
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01
    dtype: str = "float32"

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_multiplier * self.hidden_size

    @property
    def capacity(self) -> int:
        """Tokens each expert takes per group (GShard's expert capacity)."""
        return max(1, math.ceil(self.capacity_factor * self.group_size / self.num_experts))

    def is_moe_layer(self, i: int) -> bool:
        return i % 2 == 1


MOE_CONFIGS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_experts=4,
        seq_len=16,
        vocab_size=128,
        batch_size=4,
        ffn_multiplier=4,
        group_size=16,
    ),
    # Alpa, Table 7: #params, hidden size, #layers, #heads, #experts.
    "380M": MoEConfig(hidden_size=768, num_layers=8, num_heads=16, num_experts=8),
    "1.3B": MoEConfig(hidden_size=768, num_layers=16, num_heads=16, num_experts=16),
    "2.4B": MoEConfig(hidden_size=1024, num_layers=16, num_heads=16, num_experts=16),
    "10B": MoEConfig(hidden_size=1536, num_layers=16, num_heads=16, num_experts=32),
    "27B": MoEConfig(hidden_size=2048, num_layers=16, num_heads=32, num_experts=48),
    "70B": MoEConfig(hidden_size=2048, num_layers=32, num_heads=32, num_experts=64),
}


def init_moe_ffn(config: MoEConfig):
    """Gate and `num_experts` feed-forward experts, stacked on a leading expert axis."""
    e, d, h, dtype = config.num_experts, config.hidden_size, config.ffn_hidden, config.dtype
    return {
        "gate": L.normal((d, e), dtype),
        "wi": L.normal((e, d, h), dtype),
        "bi": L.constant((e, h), dtype),
        "wo": L.normal((e, h, d), dtype),
        "bo": L.constant((e, d), dtype),
    }


def top2_gating(logits: jax.Array, capacity: int):
    """GShard top-2 gating on ``logits: [G, S, E]``.

    Returns ``(combine [G,S,E,C], dispatch [G,S,E,C], aux_loss)``.
    """
    g, s, e = logits.shape
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

    index1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(index1, e, dtype=jnp.float32)
    index2 = jnp.argmax(gates * (1.0 - mask1), axis=-1)
    mask2 = jax.nn.one_hot(index2, e, dtype=jnp.float32)

    # Load-balancing loss from the first choice, before capacity drops tokens.
    mean_gate = jnp.mean(gates, axis=1)  # [G, E]
    frac = jnp.mean(mask1, axis=1)  # [G, E]
    aux_loss = jnp.mean(jnp.sum(mean_gate * frac, axis=-1)) * e

    # Position of each token in its expert's buffer: an inclusive prefix sum over the group,
    # written as a product with a lower-triangular matrix (a dot, which shards like one).
    prefix = jnp.tril(jnp.ones((s, s), jnp.float32))
    loc1 = jnp.einsum("ts,gse->gte", prefix, mask1) - 1.0
    mask1 = mask1 * (loc1 < capacity)
    taken1 = jnp.sum(mask1, axis=1, keepdims=True)  # [G, 1, E]
    loc2 = jnp.einsum("ts,gse->gte", prefix, mask2) - 1.0 + taken1
    mask2 = mask2 * (loc2 < capacity)

    gate1 = jnp.sum(gates * mask1, axis=-1)  # [G, S]
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(gate1 + gate2, jnp.finfo(jnp.float32).eps)
    gate1, gate2 = gate1 / denom, gate2 / denom

    pos1 = jnp.sum(loc1 * mask1, axis=-1).astype(jnp.int32)  # [G, S]
    pos2 = jnp.sum(loc2 * mask2, axis=-1).astype(jnp.int32)
    slot1 = jax.nn.one_hot(pos1, capacity, dtype=jnp.float32)  # [G, S, C]
    slot2 = jax.nn.one_hot(pos2, capacity, dtype=jnp.float32)
    combine = (
        gate1[..., None, None] * mask1[..., None] * slot1[..., None, :]
        + gate2[..., None, None] * mask2[..., None] * slot2[..., None, :]
    )
    dispatch = (combine > 0).astype(jnp.float32)
    return combine, dispatch, aux_loss


def moe_ffn(params, x: jax.Array, config: MoEConfig):
    """Mixture-of-experts feed-forward on ``x: [batch, seq, d]``; returns ``(y, aux_loss)``."""
    b, s, d = x.shape
    tokens = b * s
    if tokens % config.group_size:
        raise ValueError(f"batch*seq = {tokens} is not a multiple of group_size {config.group_size}")
    groups = x.reshape(tokens // config.group_size, config.group_size, d)
    logits = jnp.einsum("gsd,de->gse", groups, params["gate"])
    combine, dispatch, aux_loss = top2_gating(logits, config.capacity)
    combine, dispatch = combine.astype(x.dtype), dispatch.astype(x.dtype)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, groups)
    h = jnp.einsum("egcd,edh->egch", expert_in, params["wi"]) + params["bi"][:, None, None, :]
    h = jax.nn.gelu(h)
    expert_out = jnp.einsum("egch,ehd->egcd", h, params["wo"]) + params["bo"][:, None, None, :]
    y = jnp.einsum("gsec,egcd->gsd", combine, expert_out)
    return y.reshape(b, s, d), aux_loss


def moe_block(params, x: jax.Array, config: MoEConfig):
    """A pre-LN transformer block whose feed-forward part is `moe_ffn`; ``(x, aux_loss)``."""
    h = L.layer_norm(params["ln1"], x)
    x = x + L.attention(params["attn"], h, config.num_heads, causal=True)
    y, aux_loss = moe_ffn(params["moe"], L.layer_norm(params["ln2"], x), config)
    return x + y, aux_loss


def param_specs(config: MoEConfig):
    """The parameters as a tree of `ParamSpec`."""
    dtype, d = config.dtype, config.hidden_size
    blocks = []
    for i in range(config.num_layers):
        moe = config.is_moe_layer(i)
        block = L.init_transformer_block(d, config.ffn_hidden, dtype, with_mlp=not moe)
        if moe:
            block["moe"] = init_moe_ffn(config)
        blocks.append(block)
    return {
        "embed": {
            "tokens": L.normal((config.vocab_size, d), dtype),
            "positions": L.normal((config.seq_len, d), dtype),
        },
        "layers": blocks,
        "final_ln": L.init_layer_norm(d, dtype),
    }


def forward(config: MoEConfig, params, tokens: jax.Array):
    """``(logits [batch, seq, vocab], aux_loss)``; aux_loss is the mean over MoE layers."""
    with jax.named_scope("embed"):
        x = jnp.take(params["embed"]["tokens"], tokens, axis=0)
        x = x + params["embed"]["positions"][None, : tokens.shape[1]]
    aux_losses = []
    for i, block in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            if "moe" in block:
                x, aux = moe_block(block, x, config)
                aux_losses.append(aux)
            else:
                x = L.transformer_block(block, x, config.num_heads, causal=True)
    with jax.named_scope("head"):
        x = L.layer_norm(params["final_ln"], x)
        logits = jnp.einsum("bsd,vd->bsv", x, params["embed"]["tokens"])
    aux = sum(aux_losses) / len(aux_losses) if aux_losses else jnp.float32(0.0)
    return logits, aux


def loss_fn(config: MoEConfig, params, batch) -> jax.Array:
    """Next-token cross-entropy (mean over batch and positions) + weighted auxiliary loss."""
    logits, aux = forward(config, params, batch["tokens"])
    with jax.named_scope("loss"):
        return L.softmax_cross_entropy(logits, batch["labels"]) + config.aux_loss_weight * aux


def make_batch(config: MoEConfig, rng: jax.Array):
    seq = jax.random.randint(rng, (config.batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:]}


def train_step(config: str | MoEConfig = "tiny", optimizer: AdamConfig | None = None) -> TrainStep:
    """The MoE training step of a named configuration (see `MOE_CONFIGS`) or a `MoEConfig`."""
    cfg = resolve_config("moe", MOE_CONFIGS, MoEConfig, config)
    return train_step_for(
        "moe", MOE_CONFIGS, cfg, param_specs=param_specs, loss_fn=loss_fn, make_batch=make_batch, optimizer=optimizer
    )
