"""Adam (Kingma & Ba, ICLR 2015, Algorithm 1) as pure functions over pytrees.

One implementation shared by every model of the zoo, so that the optimizer part of each
training step lowers to the same StableHLO pattern: per parameter leaf, two moment updates,
the bias-corrected step and the parameter update (all elementwise ops, which the
auto-sharding pass can shard like the parameter they update).

    state = init_adam(params)
    params, state = adam_update(grads, state, params, lr=1e-3)

The step count is an int32 scalar; the bias corrections ``1 - b1**t`` and ``1 - b2**t`` are
computed in float32 and then applied in each leaf's own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class AdamState(NamedTuple):
    """Optimizer state: the step count and the first and second moments (same tree as params)."""

    count: jax.Array
    mu: PyTree
    nu: PyTree


@dataclass(frozen=True)
class AdamConfig:
    """Adam's hyper-parameters; the defaults are the paper's (Kingma & Ba, Algorithm 1)."""

    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8


def init_adam(params: PyTree) -> AdamState:
    """Zero moments shaped like `params`, and a zero step count.

    Works on real arrays and, under `jax.eval_shape`, on `jax.ShapeDtypeStruct` trees.
    """
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return AdamState(
        count=jnp.zeros((), jnp.int32),
        mu=zeros,
        nu=jax.tree_util.tree_map(jnp.zeros_like, params),
    )


def adam_update(
    grads: PyTree,
    state: AdamState,
    params: PyTree,
    lr: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> tuple[PyTree, AdamState]:
    """One Adam step with bias correction; returns ``(new_params, new_state)``.

    ``m_t = b1 m + (1-b1) g``, ``v_t = b2 v + (1-b2) g^2``,
    ``p_t = p - lr * (m_t / (1-b1^t)) / (sqrt(v_t / (1-b2^t)) + eps)``.
    """
    count = state.count + 1
    t = count.astype(jnp.float32)
    correction1 = 1.0 - jnp.asarray(b1, jnp.float32) ** t
    correction2 = 1.0 - jnp.asarray(b2, jnp.float32) ** t

    mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
    nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state.nu, grads)

    def update(p, m, v):
        m_hat = m / correction1.astype(m.dtype)
        v_hat = v / correction2.astype(v.dtype)
        return (p - lr * m_hat / (jnp.sqrt(v_hat) + eps)).astype(p.dtype)

    new_params = jax.tree_util.tree_map(update, params, mu, nu)
    return new_params, AdamState(count=count, mu=mu, nu=nu)
