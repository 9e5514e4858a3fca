"""Training steps the tests share: the zoo's tiny models with their data, a small MLP
with `jax.checkpoint` around each layer or not, and a step with a typed key."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hlopar.models import get_train_step


@functools.cache
def tiny_step_data(model: str):
    """The zoo's tiny `model`: its step's lowered StableHLO text, its flat arguments, its
    parameters and one device's ``(params, state, loss)``."""
    step = get_train_step(model, "tiny")
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    arguments = [np.asarray(a) for a in jax.tree_util.tree_leaves((params, state, batch))]
    return step.lower(), arguments, params, step.jitted_step(params, state, batch)


def mlp_step(layer: Callable, checkpointed: bool) -> Callable:
    """`step(ws, x, y) -> (ws - 0.1 * grads, loss)` of an MLP applying `layer(w, h)` once per
    weight, each application under `jax.checkpoint` if `checkpointed`."""
    block = jax.checkpoint(layer) if checkpointed else layer

    def loss_fn(ws, x, y):
        h = x
        for w in ws:
            h = block(w, h)
        return jax.numpy.mean((h - y) ** 2)

    def step(ws, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(ws, x, y)
        return [w - 0.1 * g for w, g in zip(ws, grads)], loss

    return step


def keyed_step(w, key, x):
    """A step that draws with a typed key and returns the next one."""
    key, draw = jax.random.split(key)
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2 * jax.random.uniform(draw, ())))(w)
    return {"w": w - 0.1 * grad}, key, loss
