"""Training steps written the way each library's documentation writes them, with tiny sizes.

Each `case_*` function builds a `Case`: the step exactly as a user would hand it to
`jax.jit`, its first arguments, which arguments hold the batch, and how the next step's
arguments follow from a step's results. Nothing here is written for hlopar: the orders of
arguments and results, the nesting (dicts, `TrainState`, NNX states, Equinox modules) and
the way keys and counters are threaded are the libraries' own.

Sizes: a batch of 8 examples (32 for BatchNorm) of 4 features (images of 6x6x2 for the CNN),
hidden width 8, 3 classes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state
from reference import Case

BATCH, FEATURES, HIDDEN, CLASSES = 8, 4, 8, 3
LR = 0.05


def data(seed: int = 1, size: int = BATCH):
    """(x, integer labels): a batch the classifier can learn."""
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (size, FEATURES), jnp.float32)
    y = jax.random.randint(ky, (size,), 0, CLASSES)
    return x, y


def init_mlp(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / 2,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / 3,
        "b2": jnp.zeros(CLASSES),
    }


def mlp(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mlp_loss(params, x, y):
    return cross_entropy(mlp(params, x), y)


# ----------------------------------------------------------------- plain jax.numpy


def case_jnp_loss_first() -> Case:
    """SGD by hand, `return loss, new_params` (the loss first)."""

    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
        return loss, params

    x, y = data()
    return Case(
        "jnp_loss_first",
        train_step,
        (init_mlp(), x, y),
        (1, 2),
        advance=lambda a, r: (r[1], a[1], a[2]),
        loss=lambda r: r[0],
        params=lambda a: a[0],
        params_of=lambda r: r[1],
    )


def case_jnp_adam() -> Case:
    """`(params, opt_state, loss)` with `optax.adam`, as optax's quick start."""
    optimizer = optax.adam(LR)

    def train_step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = init_mlp()
    return Case(
        "jnp_adam",
        train_step,
        (params, optimizer.init(params), data()),
        (2,),
        advance=lambda a, r: (r[0], r[1], a[2]),
        loss=lambda r: r[2],
        params=lambda a: a[0],
        params_of=lambda r: r[0],
    )


def case_jnp_metrics() -> Case:
    """The state as one dict in and out, and a dict of metrics."""
    optimizer = optax.adam(LR)

    def train_step(state, batch):
        def loss_fn(params):
            logits = mlp(params, batch["x"])
            return cross_entropy(logits, batch["y"]), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}
        return state, metrics

    params = init_mlp()
    x, y = data()
    return Case(
        "jnp_metrics",
        train_step,
        ({"params": params, "opt_state": optimizer.init(params)}, {"x": x, "y": y}),
        (1,),
        advance=lambda a, r: (r[0], a[1]),
        loss=lambda r: r[1]["loss"],
        params=lambda a: a[0]["params"],
        params_of=lambda r: r[0]["params"],
    )


# ----------------------------------------------------------------- Flax linen


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN)(x))
        return nn.Dense(CLASSES)(x)


def linen_batch(seed: int = 1, size: int = BATCH) -> dict:
    x, y = data(seed, size)
    return {"image": x, "label": y}


def case_linen_train_state() -> Case:
    """`TrainState.create` + `apply_gradients` with `optax.adamw`, as the Flax quick start."""
    model = LinenMLP()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, FEATURES)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(LR, weight_decay=1e-2))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        grad_fn = jax.value_and_grad(loss_fn)
        loss, grads = grad_fn(state.params)
        state = state.apply_gradients(grads=grads)
        return state, loss

    return Case(
        "linen_train_state",
        train_step,
        (state, linen_batch()),
        (1,),
        advance=lambda a, r: (r[0], a[1]),
        loss=lambda r: r[1],
        params=lambda a: a[0].params,
        params_of=lambda r: r[0].params,
    )


class LinenBatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(HIDDEN)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        return nn.Dense(CLASSES)(x)


class BatchNormTrainState(train_state.TrainState):
    batch_stats: Any


def batch_norm_grads(state, batch):
    """The Flax BatchNorm guide's loss and gradients: (loss, accuracy, grads, batch_stats)."""

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x=batch["image"], train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (logits, updates)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (logits, updates)), grads = grad_fn(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss, accuracy, grads, updates["batch_stats"]


def batch_norm_apply(state, loss, accuracy, grads, batch_stats):
    state = state.apply_gradients(grads=grads)
    state = state.replace(batch_stats=batch_stats)
    return state, {"loss": loss, "accuracy": accuracy}


def case_linen_batch_norm() -> Case:
    """`nn.BatchNorm` with the `batch_stats` collection, `mutable=["batch_stats"]`, as the Flax
    BatchNorm guide. A batch of 32: normalizing microbatches of 2 examples would leave
    gradients that only the epsilon of the variance makes (all rounding)."""
    model = LinenBatchNormMLP()
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, FEATURES)), train=False)
    state = BatchNormTrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=optax.adam(LR)
    )

    def train_step(state, batch):
        return batch_norm_apply(state, *batch_norm_grads(state, batch))

    return Case(
        "linen_batch_norm",
        train_step,
        (state, linen_batch(size=4 * BATCH)),
        (1,),
        advance=lambda a, r: (r[0], a[1]),
        loss=lambda r: r[1]["loss"],
        params=lambda a: a[0].params,
        params_of=lambda r: r[0].params,
        grads=batch_norm_grads,
        apply=batch_norm_apply,
        microbatch_semantics=True,
    )


class LinenBatchNormCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def case_linen_batch_norm_cnn() -> Case:
    """The BatchNorm guide's step on a CNN with max pooling (`reduce_window`, and
    `select_and_scatter` in its gradient), images of 6x6x2, a batch of 32."""
    model = LinenBatchNormCNN()
    kx, ky = jax.random.split(jax.random.PRNGKey(2))
    batch = {
        "image": jax.random.normal(kx, (4 * BATCH, 6, 6, 2)),
        "label": jax.random.randint(ky, (4 * BATCH,), 0, CLASSES),
    }
    variables = model.init(jax.random.PRNGKey(0), batch["image"][:1], train=False)
    state = BatchNormTrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=optax.adam(LR)
    )

    def train_step(state, batch):
        return batch_norm_apply(state, *batch_norm_grads(state, batch))

    return Case(
        "linen_batch_norm_cnn",
        train_step,
        (state, batch),
        (1,),
        advance=lambda a, r: (r[0], a[1]),
        loss=lambda r: r[1]["loss"],
        params=lambda a: a[0].params,
        params_of=lambda r: r[0].params,
        grads=batch_norm_grads,
        apply=batch_norm_apply,
        microbatch_semantics=True,
    )


class LinenDropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, training: bool):
        x = nn.relu(nn.Dense(HIDDEN)(x))
        x = nn.Dropout(rate=0.5, deterministic=not training)(x)
        return nn.Dense(CLASSES)(x)


class DropoutTrainState(train_state.TrainState):
    key: jax.Array


def case_linen_dropout() -> Case:
    """`nn.Dropout` with `rngs={"dropout": key}`, the key folded with the step count, as the
    Flax dropout guide."""
    model = LinenDropoutMLP()
    root_key = jax.random.PRNGKey(seed=0)
    main_key, params_key, dropout_key = jax.random.split(key=root_key, num=3)
    params = model.init(params_key, jnp.ones((1, FEATURES)), training=False)["params"]
    state = DropoutTrainState.create(apply_fn=model.apply, params=params, key=dropout_key, tx=optax.adam(LR))

    def train_step(state, batch, dropout_key):
        dropout_train_key = jax.random.fold_in(key=dropout_key, data=state.step)

        def loss_fn(params):
            logits = state.apply_fn(
                {"params": params}, x=batch["image"], training=True, rngs={"dropout": dropout_train_key}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()

        grad_fn = jax.value_and_grad(loss_fn)
        loss, grads = grad_fn(state.params)
        state = state.apply_gradients(grads=grads)
        return state, loss

    return Case(
        "linen_dropout",
        train_step,
        (state, linen_batch(), state.key),
        (1,),
        advance=lambda a, r: (r[0], a[1], a[2]),
        loss=lambda r: r[1],
        params=lambda a: a[0].params,
        params_of=lambda r: r[0].params,
    )


# ----------------------------------------------------------------- Flax NNX


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.linear1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.linear2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.linear1(x))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.linear2(x)


def nnx_case(name: str, dropout: float) -> Case:
    """`nnx.Optimizer` through `nnx.split`/`nnx.merge` around a pure step, the functional
    pattern of the NNX documentation."""
    model = NNXMLP(nnx.Rngs(0), dropout)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(graphdef, state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        _, state = nnx.split((model, optimizer))
        return loss, state

    def params(state):
        return nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)

    return Case(
        name,
        functools.partial(train_step, graphdef),
        (state, linen_batch()),
        (1,),
        advance=lambda a, r: (r[1], a[1]),
        loss=lambda r: r[0],
        params=lambda a: params(a[0]),
        params_of=lambda r: params(r[1]),
    )


def case_nnx_optimizer() -> Case:
    return nnx_case("nnx_optimizer", 0.0)


def case_nnx_dropout() -> Case:
    """The same with `nnx.Dropout`: the dropout key lives in the model's `Rngs` state and
    advances inside the step."""
    return nnx_case("nnx_dropout", 0.5)


# ----------------------------------------------------------------- Optax


def optax_case(name: str, optimizer: optax.GradientTransformation) -> Case:
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = init_mlp()
    x, y = data()
    return Case(
        name,
        train_step,
        (params, optimizer.init(params), x, y),
        (2, 3),
        advance=lambda a, r: (r[0], r[1], a[2], a[3]),
        loss=lambda r: r[2],
        params=lambda a: a[0],
        params_of=lambda r: r[0],
    )


def case_optax_clip_adam() -> Case:
    """`optax.chain(clip_by_global_norm(1.0), adam)`: the norm of every gradient at once."""
    return optax_case("optax_clip_adam", optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)))


def case_optax_sgd_momentum() -> Case:
    return optax_case("optax_sgd_momentum", optax.sgd(LR, momentum=0.9))


def case_optax_schedule() -> Case:
    """Adam with a warmup-cosine learning-rate schedule: the rate reads an integer count."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=LR, warmup_steps=2, decay_steps=10, end_value=LR / 10
    )
    return optax_case("optax_schedule", optax.adam(learning_rate=schedule))


# ----------------------------------------------------------------- Equinox


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(FEATURES, HIDDEN, key=k1), eqx.nn.Linear(HIDDEN, CLASSES, key=k2)]

    def __call__(self, x):
        x = jax.nn.relu(self.layers[0](x))
        return self.layers[1](x)


def case_equinox() -> Case:
    """`eqx.filter_value_and_grad` over a model of `eqx.nn.Linear` layers, as Equinox's
    training examples (per-example model, `jax.vmap` over the batch)."""
    optim = optax.adam(LR)
    model = EqxMLP(jax.random.PRNGKey(0))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return cross_entropy(pred_y, y)

    def make_step(model, opt_state, x, y):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    x, y = data()
    return Case(
        "equinox",
        make_step,
        (model, optim.init(eqx.filter(model, eqx.is_array)), x, y),
        (2, 3),
        advance=lambda a, r: (r[1], r[2], a[2], a[3]),
        loss=lambda r: r[0],
        params=lambda a: a[0],
        params_of=lambda r: r[1],
    )


class EqxClassifier(eqx.Module):
    """An `eqx.nn.MLP` (its activations are fields) and a string: non-array leaves."""

    mlp: eqx.nn.MLP
    pooling: str

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(FEATURES, CLASSES, HIDDEN, depth=2, activation=jax.nn.relu, key=key)
        self.pooling = "none"

    def __call__(self, x):
        return self.mlp(x)


def case_equinox_whole_model() -> Case:
    """The model passed whole, functions and strings included, as `eqx.filter_jit` takes it."""
    optim = optax.sgd(LR)
    model = EqxClassifier(jax.random.PRNGKey(0))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        return cross_entropy(jax.vmap(model)(x), y)

    def make_step(model, opt_state, x, y):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return loss, eqx.apply_updates(model, updates), opt_state

    x, y = data()
    return Case(
        "equinox_whole_model",
        make_step,
        (model, optim.init(eqx.filter(model, eqx.is_array)), x, y),
        (2, 3),
        advance=lambda a, r: (r[1], r[2], a[2], a[3]),
        loss=lambda r: r[0],
        params=lambda a: a[0],
        params_of=lambda r: r[1],
        exported=False,
    )


class EqxStatefulModel(eqx.Module):
    """BatchNorm and SpectralNorm keeping their state in `eqx.nn.State`, as Equinox's
    stateful-layers example."""

    norm: eqx.nn.BatchNorm
    spectral: eqx.nn.SpectralNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm = eqx.nn.BatchNorm(FEATURES, axis_name="batch", mode="ema")
        self.spectral = eqx.nn.SpectralNorm(eqx.nn.Linear(FEATURES, HIDDEN, key=k1), "weight", key=k2)
        self.head = eqx.nn.Linear(HIDDEN, CLASSES, key=k3)

    def __call__(self, x, state):
        x, state = self.norm(x, state)
        x, state = self.spectral(x, state)
        return self.head(jax.nn.relu(x)), state


def eqx_stateful_grads(model, state, opt_state, x, y):
    """The stateful example's gradients and new state (`eqx.filter_grad(..., has_aux=True)`)."""

    def compute_loss(model, state, x, y):
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        logits, state = batched(x, state)
        return cross_entropy(logits, y), state

    return eqx.filter_grad(compute_loss, has_aux=True)(model, state, x, y)


EQX_STATEFUL_OPTIM = optax.adam(LR)


def eqx_stateful_apply(model, state, opt_state, grads, new_state):
    updates, opt_state = EQX_STATEFUL_OPTIM.update(grads, opt_state)
    return eqx.apply_updates(model, updates), new_state, opt_state


def case_equinox_state() -> Case:
    """`eqx.nn.make_with_state`, a step returning `(model, state, opt_state)` and no loss: the
    spectral norm's power-iteration vectors are state no elementwise rule updates."""
    model, state = eqx.nn.make_with_state(EqxStatefulModel)(jax.random.PRNGKey(0))

    def make_step(model, state, opt_state, x, y):
        return eqx_stateful_apply(model, state, opt_state, *eqx_stateful_grads(model, state, opt_state, x, y))

    x, y = data(size=4 * BATCH)
    return Case(
        "equinox_state",
        make_step,
        (model, state, EQX_STATEFUL_OPTIM.init(eqx.filter(model, eqx.is_array)), x, y),
        (3, 4),
        advance=lambda a, r: (r[0], r[1], r[2], a[3], a[4]),
        loss=None,
        params=lambda a: a[0],
        params_of=lambda r: r[0],
        grads=eqx_stateful_grads,
        apply=eqx_stateful_apply,
        microbatch_semantics=True,
        exported=False,
    )


# ----------------------------------------------------------------- a VAE returning no loss


class LinenVAE(nn.Module):
    """An encoder to a mean and a log-variance, a reparameterized draw, a decoder."""

    @nn.compact
    def __call__(self, x, z_rng):
        h = nn.relu(nn.Dense(HIDDEN)(x))
        mean, logvar = nn.Dense(2)(h), nn.Dense(2)(h)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(z_rng, logvar.shape)
        return nn.Dense(FEATURES)(nn.relu(nn.Dense(HIDDEN)(z))), mean, logvar


def case_linen_vae() -> Case:
    """The VAE example's step: `jax.grad` of the ELBO, only the new `TrainState` returned."""
    model = LinenVAE()
    x = jax.nn.sigmoid(data()[0])
    params = model.init(jax.random.PRNGKey(0), x, jax.random.PRNGKey(1))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    def train_step(state, batch, z_rng):
        def loss_fn(params):
            logits, mean, logvar = model.apply({"params": params}, batch, z_rng)
            bce = optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()
            kld = (-0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), -1)).mean()
            return bce + kld

        grads = jax.grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads)

    return Case(
        "linen_vae",
        train_step,
        (state, x, jax.random.PRNGKey(2)),
        (1,),
        advance=lambda a, r: (r, a[1], jax.random.fold_in(a[2], 1)),
        loss=None,
        params=lambda a: a[0].params,
        params_of=lambda r: r.params,
        exported=False,
    )


# ----------------------------------------------------------------- has_aux, typed keys


def case_has_aux() -> Case:
    """`value_and_grad(..., has_aux=True)` with metrics in the aux, the batch before the state."""
    optimizer = optax.adam(LR)

    def loss_fn(params, x, y):
        logits = mlp(params, x)
        loss = cross_entropy(logits, y)
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y), "logit_mean": jnp.mean(logits)}

    def train_step(batch, params, opt_state):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **aux}

    params = init_mlp()
    return Case(
        "has_aux",
        train_step,
        (data(), params, optimizer.init(params)),
        (0,),
        advance=lambda a, r: (a[0], r[0], r[1]),
        loss=lambda r: r[2]["loss"],
        params=lambda a: a[1],
        params_of=lambda r: r[0],
    )


def case_typed_key() -> Case:
    """Dropout drawn by hand from a typed key (`jax.random.key`), split in the step and the new
    key returned."""
    optimizer = optax.adam(LR)

    def loss_fn(params, x, y, key):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        h = jnp.where(keep, h / 0.5, 0.0)
        return cross_entropy(h @ params["w2"] + params["b2"], y)

    def train_step(params, opt_state, key, x, y):
        key, dropout_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, loss

    params = init_mlp()
    x, y = data()
    return Case(
        "typed_key",
        train_step,
        (params, optimizer.init(params), jax.random.key(0), x, y),
        (3, 4),
        advance=lambda a, r: (r[0], r[1], r[2], a[3], a[4]),
        loss=lambda r: r[3],
        params=lambda a: a[0],
        params_of=lambda r: r[0],
    )


CASES: dict[str, Callable[[], Case]] = {
    "jnp_loss_first": case_jnp_loss_first,
    "jnp_adam": case_jnp_adam,
    "jnp_metrics": case_jnp_metrics,
    "linen_train_state": case_linen_train_state,
    "linen_batch_norm": case_linen_batch_norm,
    "linen_batch_norm_cnn": case_linen_batch_norm_cnn,
    "linen_dropout": case_linen_dropout,
    "nnx_optimizer": case_nnx_optimizer,
    "optax_clip_adam": case_optax_clip_adam,
    "optax_sgd_momentum": case_optax_sgd_momentum,
    "optax_schedule": case_optax_schedule,
    "equinox": case_equinox,
    "has_aux": case_has_aux,
    "typed_key": case_typed_key,
    "nnx_dropout": case_nnx_dropout,
    "equinox_whole_model": case_equinox_whole_model,
    "equinox_state": case_equinox_state,
    "linen_vae": case_linen_vae,
}
