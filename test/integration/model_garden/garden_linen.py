"""The model garden's Flax linen models and their training steps, written as the Flax examples
write such models (ResNet, MNIST CNN, LM, sequence classifiers, VAE): `TrainState`, Optax,
`batch_stats` and `rngs={"dropout": ...}` where the examples use them. Tiny sizes (a batch of 8,
images of 8x8, sequences of 6 to 8): the suite checks semantics, not scale.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from reference import Case

BATCH, CLASSES, LR = 8, 4, 0.05


def images(seed: int, channels: int, size: int = BATCH) -> dict:
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "image": jax.random.normal(kx, (size, 8, 8, channels), jnp.float32),
        "label": jax.random.randint(ky, (size,), 0, CLASSES),
    }


def state_case(name, step, state, *rest, batch_argnums=(1,), loss=lambda r: r[1]["loss"], **cut) -> Case:
    """A step of `(state, batch, ...) -> (state, metrics)` run on the same batch every step."""
    return Case(
        name,
        step,
        (state, *rest),
        batch_argnums,
        advance=lambda a, r: (r[0], *a[1:]),
        loss=loss,
        params=lambda a: a[0].params,
        params_of=lambda r: r[0].params,
        **cut,
    )


# ----------------------------------------------------------------- ResNet (BatchNorm, max-pooling)


class ResNetBlock(nn.Module):
    filters: int
    norm: Any

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm()(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A stem (conv, BatchNorm, 3x3 max-pool of stride 2), one residual block, global average."""

    num_filters: int = 8
    num_classes: int = CLASSES

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = ResNetBlock(self.num_filters, norm)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class BatchStatsState(train_state.TrainState):
    batch_stats: Any


def resnet_grads(state, batch):
    """The loss, its gradients and the new batch statistics (the ImageNet example's loss_fn)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"], mutable=["batch_stats"]
        )
        one_hot = jax.nn.one_hot(batch["label"], CLASSES)
        loss = optax.softmax_cross_entropy(logits, one_hot).mean()
        return loss, (new_model_state, logits)

    (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss, accuracy, grads, new_model_state["batch_stats"]


def resnet_apply(state, loss, accuracy, grads, batch_stats):
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, {"loss": loss, "accuracy": accuracy}


def case_resnet() -> Case:
    """SGD with Nesterov momentum, as the ImageNet example."""
    model = ResNet()
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)
    state = BatchStatsState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(LR, momentum=0.9, nesterov=True),
    )

    def train_step(state, batch):
        return resnet_apply(state, *resnet_grads(state, batch))

    return state_case(
        "resnet",
        train_step,
        state,
        images(1, 3),
        grads=resnet_grads,
        apply=resnet_apply,
        microbatch_semantics=True,
    )


# ----------------------------------------------------------------- CNN (max and average pooling)


class CNN(nn.Module):
    """The MNIST example's shape of network, one pooling of each kind."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x))
        x = nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=16)(x))
        return nn.Dense(features=CLASSES)(x)


def case_cnn() -> Case:
    model = CNN()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 1)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["label"], CLASSES)).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        return state, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}

    return state_case("cnn", train_step, state, images(1, 1))


# ----------------------------------------------------------------- Transformer LM (dropout, padding weights)

VOCAB, WIDTH, LENGTH = 16, 16, 8


class DecoderBlock(nn.Module):
    dropout_rate: float

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=2)(y, y, mask=mask)
        x = x + nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)
        y = nn.LayerNorm()(x)
        y = nn.Dense(2 * WIDTH)(y)
        y = nn.Dense(WIDTH)(nn.gelu(y))
        return x + nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)


class TransformerLM(nn.Module):
    """Token and learned position embeddings, one pre-norm decoder block with dropout on its
    two residual branches (not on the attention weights: each dropout site is a threefry
    hash in the program, and the suite's time is compile time); token 0 is padding."""

    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool):
        mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        position = self.param("pos_embedding", nn.initializers.normal(0.02), (1, LENGTH, WIDTH))
        x = x + position[:, : tokens.shape[1]]
        x = DecoderBlock(self.dropout_rate)(x, mask, deterministic=not train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class DropoutState(train_state.TrainState):
    dropout_key: jax.Array


def token_batch(seed: int = 1) -> jax.Array:
    """Sequences of LENGTH + 1 tokens, each padded with 0 after its own length (2 to 9)."""
    kt, kl = jax.random.split(jax.random.PRNGKey(seed))
    tokens = jax.random.randint(kt, (BATCH, LENGTH + 1), 1, VOCAB)
    lengths = jax.random.randint(kl, (BATCH, 1), 2, LENGTH + 2)
    return jnp.where(jnp.arange(LENGTH + 1) < lengths, tokens, 0)


def case_transformer_lm() -> Case:
    """Next-token loss weighted by the non-padding targets, sum(loss * w) / sum(w), as the lm1b
    example; dropout keyed by the state's key folded with the step."""
    model = TransformerLM()
    params_key, dropout_key = jax.random.split(jax.random.PRNGKey(0))
    params = model.init(params_key, jnp.ones((1, LENGTH), jnp.int32), train=False)["params"]
    state = DropoutState.create(apply_fn=model.apply, params=params, tx=optax.adamw(LR), dropout_key=dropout_key)

    def train_step(state, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        weights = jnp.where(targets > 0, 1.0, 0.0)
        step_key = jax.random.fold_in(state.dropout_key, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs, train=True, rngs={"dropout": step_key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return jnp.sum(loss * weights) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return state_case("transformer_lm", train_step, state, token_batch())


# ----------------------------------------------------------------- LSTM (nn.RNN with seq_lengths)


def sequences(seed: int = 1, steps: int = 6, features: int = 4) -> dict:
    kx, kl, ky = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "x": jax.random.normal(kx, (BATCH, steps, features)),
        "lengths": jax.random.randint(kl, (BATCH,), 1, steps + 1),
        "label": jax.random.randint(ky, (BATCH,), 0, CLASSES),
    }


class LSTMClassifier(nn.Module):
    """Classifies each sequence from the LSTM's carry at the sequence's own last step."""

    @nn.compact
    def __call__(self, x, seq_lengths):
        (_, h), _ = nn.RNN(nn.OptimizedLSTMCell(16), return_carry=True)(x, seq_lengths=seq_lengths)
        return nn.Dense(CLASSES)(h)


def case_lstm() -> Case:
    model = LSTMClassifier()
    batch = sequences()
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1], batch["lengths"][:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"], batch["lengths"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return state_case("lstm", train_step, state, batch)


# ----------------------------------------------------------------- GRU under nn.scan


class GRUClassifier(nn.Module):
    """A GRU cell scanned over time with `nn.scan` (parameters broadcast), as the seq2seq
    example scans its cells; the last carry classifies."""

    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        scan_gru = nn.scan(nn.GRUCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1)
        carry = jnp.zeros((x.shape[0], self.hidden))
        carry, _ = scan_gru(features=self.hidden)(carry, x)
        return nn.Dense(CLASSES)(carry)


def case_gru() -> Case:
    model = GRUClassifier()
    batch = sequences(2)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(LR, momentum=0.9))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return state_case("gru", train_step, state, batch)


# ----------------------------------------------------------------- VAE (the step returns the state only)

FEATURES, LATENTS = 16, 2


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="fc1")(x))
        return nn.Dense(LATENTS, name="fc2_mean")(x), nn.Dense(LATENTS, name="fc2_logvar")(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        z = nn.relu(nn.Dense(16, name="fc1")(z))
        return nn.Dense(FEATURES, name="fc2")(z)


class VAE(nn.Module):
    def setup(self):
        self.encoder = Encoder()
        self.decoder = Decoder()

    def __call__(self, x, z_rng):
        mean, logvar = self.encoder(x)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(z_rng, logvar.shape)
        return self.decoder(z), mean, logvar


def case_vae() -> Case:
    """The VAE example's step: `train_step(state, batch, z_rng)` returns the new state only (no
    loss); the caller splits a new key every step."""
    model = VAE()
    init_key, data_key, z_key = jax.random.split(jax.random.PRNGKey(0), 3)
    batch = jax.random.bernoulli(data_key, 0.3, (BATCH, FEATURES)).astype(jnp.float32)
    params = model.init(init_key, batch[:1], z_key)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    def train_step(state, batch, z_rng):
        def loss_fn(params):
            logits, mean, logvar = state.apply_fn({"params": params}, batch, z_rng)
            bce = optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()
            kld = jnp.mean(-0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), axis=-1))
            return bce + kld

        grads = jax.grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads)

    return Case(
        "vae",
        train_step,
        (state, batch, z_key),
        (1,),
        advance=lambda a, r: (r, a[1], jax.random.split(a[2])[0]),
        loss=None,
        params=lambda a: a[0].params,
        params_of=lambda r: r.params,
    )
