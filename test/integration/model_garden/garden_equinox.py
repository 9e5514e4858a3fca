"""The model garden's Equinox models and steps, written as the Equinox examples write them: a
CNN whose layer list holds activation functions and `jnp.ravel` beside its layers (the model is
passed whole, non-array leaves included, as `eqx.filter_jit` takes it), and a stateful model
(`eqx.nn.BatchNorm` + `eqx.nn.SpectralNorm`, `eqx.nn.make_with_state`) whose step returns the new
model, state and optimizer state but no loss. Both need `eqx.filter_jit` on one device (plain
`jax.jit` cannot trace a function or a string), so the reference compiles with it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from reference import Case

BATCH, CLASSES, LR = 8, 4, 0.05


# ----------------------------------------------------------------- CNN with non-array leaves


class CNN(eqx.Module):
    layers: list
    name: str  # a plain string field: a non-array leaf

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(4 * 5 * 5, 16, key=k2),
            jax.nn.sigmoid,
            eqx.nn.Linear(16, CLASSES, key=k3),
            jax.nn.log_softmax,
        ]
        self.name = "garden-cnn"

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def log_likelihood_loss(model, x, y):
    """Minus the mean log-probability of the labels (`take_along_axis`), as the MNIST example."""
    log_probs = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(log_probs, jnp.expand_dims(y, 1), axis=1))


def case_eqx_cnn() -> Case:
    optim = optax.adamw(LR)
    model = CNN(jax.random.PRNGKey(0))

    def make_step(model, opt_state, x, y):
        loss_value, grads = eqx.filter_value_and_grad(log_likelihood_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (BATCH, 1, 8, 8))
    y = jax.random.randint(ky, (BATCH,), 0, CLASSES)
    return Case(
        "eqx_cnn",
        make_step,
        (model, optim.init(eqx.filter(model, eqx.is_array)), x, y),
        (2, 3),
        advance=lambda a, r: (r[0], r[1], a[2], a[3]),
        loss=lambda r: r[2],
        params=lambda a: a[0],
        params_of=lambda r: r[0],
        exported=False,
    )


# ----------------------------------------------------------------- BatchNorm + SpectralNorm in eqx.nn.State

STATEFUL_BATCH, FEATURES, HIDDEN = 32, 4, 8


class StatefulModel(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.linear = eqx.nn.Linear(FEATURES, HIDDEN, key=k1)
        self.norm = eqx.nn.BatchNorm(HIDDEN, axis_name="batch", momentum=0.9, mode="ema")
        self.spectral_linear = eqx.nn.SpectralNorm(eqx.nn.Linear(HIDDEN, HIDDEN, key=k2), weight_name="weight", key=k3)
        self.head = eqx.nn.Linear(HIDDEN, CLASSES, key=k4)

    def __call__(self, x, state):
        x = self.linear(x)
        x, state = self.norm(x, state)
        x = jax.nn.relu(x)
        x, state = self.spectral_linear(x, state)
        return self.head(jax.nn.relu(x)), state


def stateful_loss(model, state, xs, ys):
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batch_model(xs, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean(), state


def case_eqx_stateful() -> Case:
    """The stateful example's step: `filter_grad(..., has_aux=True)` for the gradients and the
    new state, returning (model, state, opt_state). A batch of 32: BatchNorm over microbatches
    of 2 would leave gradients that only the variance's epsilon makes."""
    optim = optax.adam(LR)
    model, state = eqx.nn.make_with_state(StatefulModel)(jax.random.PRNGKey(0))

    def grads(model, state, opt_state, xs, ys):
        return eqx.filter_grad(stateful_loss, has_aux=True)(model, state, xs, ys)

    def apply(model, state, opt_state, grads, new_state):
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), new_state, opt_state

    def make_step(model, state, opt_state, xs, ys):
        grads, state = eqx.filter_grad(stateful_loss, has_aux=True)(model, state, xs, ys)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        return model, state, opt_state

    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    xs = jax.random.normal(kx, (STATEFUL_BATCH, FEATURES))
    ys = jax.random.randint(ky, (STATEFUL_BATCH,), 0, CLASSES)
    return Case(
        "eqx_stateful",
        make_step,
        (model, state, optim.init(eqx.filter(model, eqx.is_inexact_array)), xs, ys),
        (3, 4),
        advance=lambda a, r: (*r, a[3], a[4]),
        loss=None,
        params=lambda a: a[0],
        params_of=lambda r: r[0],
        grads=grads,
        apply=apply,
        microbatch_semantics=True,
        exported=False,
    )
