"""Adam (Kingma & Ba, ICLR 2015, Algorithm 1) as pure functions over pytrees.

One implementation shared by every model of the zoo, so that the optimizer part of each
training step lowers to the same StableHLO pattern: per parameter leaf, two moment updates,
the bias-corrected step and the parameter update (all elementwise ops, which the
auto-sharding pass can shard like the parameter they update).

    state = init_adam(params)
    params, state = adam_update(grads, state, params, lr=1e-3)

The step count is an int32 scalar; the bias corrections ``1 - b1**t`` and ``1 - b2**t`` are
computed in float32 and then applied in each leaf's own dtype.

Mixed precision (Micikevicius et al., "Mixed Precision Training", ICLR 2018): with
``init_adam(params, master_dtype="float32")`` for float16 `params` the state also holds a
float32 master copy of the weights, and the moments are float32. The step then takes the
float16 gradients, casts them to float32, updates the master copy and the moments in float32
and returns the master copy rounded to float16 as the new parameters: per parameter 2 bytes
of float16 weights, 2 of float16 gradients, 4 of master weights and 4 + 4 of moments, 16 in
all, as in the paper and as Alpa's benchmarks hold it (its `model_util.TrainState` keeps float16
`params` beside a float32 `master_copy` that the optimizer state is made of). No loss scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class AdamState(NamedTuple):
    """Optimizer state: the step count and the first and second moments (same tree as params),
    and under mixed precision the master weights (None otherwise: the params are the weights)."""

    count: jax.Array
    mu: PyTree
    nu: PyTree
    master: PyTree = None


@dataclass(frozen=True)
class AdamConfig:
    """Adam's hyper-parameters; the defaults are the paper's (Kingma & Ba, Algorithm 1)."""

    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    master_dtype: str | None = None  # mixed precision: master weights and moments in this dtype


def init_adam(params: PyTree, master_dtype: str | None = None) -> AdamState:
    """Zero moments shaped like `params`, and a zero step count; with `master_dtype`, a master
    copy of `params` in that dtype, and the moments in that dtype (mixed precision).

    Works on real arrays and, under `jax.eval_shape`, on `jax.ShapeDtypeStruct` trees.
    """
    master = None
    if master_dtype is not None:
        master = jax.tree_util.tree_map(lambda p: p.astype(master_dtype), params)
    weights = params if master is None else master
    zeros = jax.tree_util.tree_map(jnp.zeros_like, weights)
    return AdamState(
        count=jnp.zeros((), jnp.int32),
        mu=zeros,
        nu=jax.tree_util.tree_map(jnp.zeros_like, weights),
        master=master,
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

    With a master copy in `state` (mixed precision) ``p`` is the master copy, the gradients
    are cast to its dtype first, and the new params are the new master copy in the params'
    dtype. They also read the old params (``+ 0 * p``, exact for finite params), which is how
    a step's data flow says that a result is the new value of an argument
    (`hlopar.analysis.step_io.state_pairs`); Alpa's `TrainState` adds the same zero term
    (there for buffer donation).
    """
    mixed = state.master is not None
    if mixed:
        grads = jax.tree_util.tree_map(lambda g, w: g.astype(w.dtype), grads, state.master)
    weights = state.master if mixed else params
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

    new_weights = jax.tree_util.tree_map(update, weights, mu, nu)
    if not mixed:
        return new_weights, AdamState(count=count, mu=mu, nu=nu)
    new_params = jax.tree_util.tree_map(lambda w, p: w.astype(p.dtype) + 0 * p, new_weights, params)
    return new_params, AdamState(count=count, mu=mu, nu=nu, master=new_weights)
