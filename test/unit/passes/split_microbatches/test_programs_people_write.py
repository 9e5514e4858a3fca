"""Programs people write, split into 4 microbatches (issue 27, items 1, 2, 3 and 7), each run
by the microbatch oracle against the step on one device:

- pooling and cumulative sums (windowed reductions over dims other than the batch; max
  pooling's gradient is a `select_and_scatter`) split like elementwise ops; a window along the
  batch is refused, at the user's line;
- gathers by the batch's own positions (`logp[jnp.arange(B), labels]`, Flax
  `nn.RNN(seq_lengths=...)` picking each sequence's last carry) are batched gathers; a table
  that does not carry the batch, indexed by the example's position, reads the whole batch's
  rows;
- losses normalized over the whole batch (`sum(loss * weights) / sum(weights)`): the
  normalizer, of the batch only, is factored out of the microbatches; one computed from the
  parameters is refused as before;
- a BatchNorm CNN with max pooling: statistics per microbatch (GPipe), against that semantics
  computed on one device.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from microbatch_steps import assert_leaves_close, run_pipeline, run_split, split_jax_step

from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.runtime.local_executor import PipelinedStep

N, CLASSES, LR = 8, 3, 0.1
# Summation order only: the microbatches sum their gradients in another order than the
# whole batch (float32; measured at most 2.3e-7 of a leaf's largest magnitude here).
RTOL = 2e-6


def _sgd(loss_fn):
    def step(params, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), loss

    return step


def _assert_splits_exactly(step, args, **options):
    module, warnings = split_jax_step(step, args, 4, **options)
    assert warnings == []
    assert_leaves_close(run_split(module, args), jax.jit(step)(*args), RTOL)
    return str(module)


def _images(channels: int = 2):
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    return jax.random.normal(keys[0], (N, 6, 6, channels)), jax.random.randint(keys[1], (N,), 0, CLASSES)


# --------------------------------------------------------------------------- windows (item 1)


class _PoolCNN(nn.Module):
    pool: str

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        if self.pool == "max":
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        elif self.pool == "avg":
            x = nn.avg_pool(x, (2, 2), strides=(2, 2), padding="SAME")
        else:
            x = jnp.cumsum(x, axis=1)  # along the image's rows, per example
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("pool", ["max", "avg", "cumsum"])
def test_windows_over_other_dims_split_like_elementwise_ops(pool):
    model = _PoolCNN(pool)
    x, labels = _images()
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def loss_fn(params, x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), labels).mean()

    text = _assert_splits_exactly(_sgd(loss_fn), (params, x, labels))
    assert "stablehlo.reduce_window" in text
    if pool == "max":  # the gradient of max pooling
        assert "stablehlo.select_and_scatter" in text


def _cumsum_over_batch_step(w, x):
    def loss_fn(w):
        return jnp.mean(jnp.cumsum(x @ w, axis=0) ** 2)  # along the batch

    return w - LR * jax.grad(loss_fn)(w)


def test_window_along_the_batch_is_refused_at_the_users_line():
    with pytest.raises(DiagnosticError) as error:
        split_jax_step(_cumsum_over_batch_step, (jnp.ones((5, 3)), jnp.ones((N, 5))), 4, batch_args=(1,))
    message = str(error.value)
    assert f"{__file__}:" in message
    assert (
        "'stablehlo.reduce_window' slides a window along the batch (dim 0: size 8, padding 7, 0): its windows "
        "would hold examples of several microbatches" in message
    )


# --------------------------------------------------------------------------- positions (item 2)


def _linear_data():
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    return (
        jax.random.normal(keys[0], (5, CLASSES)),
        jax.random.normal(keys[1], (N, 5)),
        jax.random.randint(keys[2], (N,), 0, CLASSES),
    )


def test_arange_indexing_is_a_batched_gather():
    def loss_fn(w, x, labels):
        logp = jax.nn.log_softmax(x @ w)
        return -logp[jnp.arange(x.shape[0]), labels].mean()

    text = _assert_splits_exactly(_sgd(loss_fn), _linear_data())
    assert "operand_batching_dims = [0]" in text and "input_batching_dims = [0]" in text  # the gather and its gradient


class _LastCarry(nn.Module):
    @nn.compact
    def __call__(self, x, lengths):
        (_, hidden), _ = nn.RNN(nn.LSTMCell(4), return_carry=True)(x, seq_lengths=lengths)
        return nn.Dense(CLASSES)(hidden)


def test_rnn_with_sequence_lengths():
    """`nn.RNN(seq_lengths=...)` picks each sequence's last carry at (its length - 1, its row)."""
    model = _LastCarry()
    keys = jax.random.split(jax.random.PRNGKey(9), 2)
    x = jax.random.normal(keys[0], (N, 5, 2))
    lengths = jnp.array([5, 3, 4, 1, 5, 2, 3, 4])
    labels = jax.random.randint(keys[1], (N,), 0, CLASSES)
    params = model.init(jax.random.PRNGKey(0), x, lengths)["params"]

    def loss_fn(params, x, lengths, labels):
        logits = model.apply({"params": params}, x, lengths)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    text = _assert_splits_exactly(_sgd(loss_fn), (params, x, lengths, labels))
    assert "operand_batching_dims = [1]" in text  # time-major carries: the batch is dim 1


def test_a_table_indexed_by_position_reads_the_whole_batchs_rows():
    """Per-example weights kept in a table the step does not split: the position counts the
    whole batch (microbatch k reads rows 2k and 2k + 1). Wrong rows would change the loss."""
    w, x, labels = _linear_data()
    table = jnp.arange(1.0, N + 1.0)

    def loss_fn(w, x, labels, table):
        nll = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
        return jnp.mean(nll * table[jnp.arange(x.shape[0])])

    _assert_splits_exactly(_sgd(loss_fn), (w, x, labels, table), batch_args=(1, 2))


# --------------------------------------------------------------------------- normalizers (item 3)


def _token_data():
    keys = jax.random.split(jax.random.PRNGKey(13), 4)
    w = jax.random.normal(keys[0], (5, CLASSES))
    x = jax.random.normal(keys[1], (N, 6, 5))  # 8 sequences of 6 tokens
    targets = jax.random.randint(keys[2], (N, 6), 0, CLASSES)
    lengths = jax.random.randint(keys[3], (N,), 1, 7)
    mask = (jnp.arange(6)[None, :] < lengths[:, None]).astype(jnp.float32)  # padding: microbatches differ
    return w, x, targets, mask


def _padded_lm_loss(w, x, targets, mask):
    """The padding-aware language-model loss: the mean over real tokens of the whole batch."""
    logp = jax.nn.log_softmax(x @ w)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)


def test_a_loss_normalized_by_the_whole_batchs_weights(tmp_path):
    w, x, targets, mask = _token_data()
    step = _sgd(_padded_lm_loss)
    report = tmp_path / "split.json"
    module, warnings = split_jax_step(step, (w, x, targets, mask), 4, report=str(report))
    assert warnings == [] and json.loads(report.read_text())["scales_factored"] == 1
    assert_leaves_close(run_split(module, (w, x, targets, mask)), jax.jit(step)(w, x, targets, mask), RTOL)
    # Each microbatch normalized by its own tokens would be another step: the test can tell.
    per_microbatch = sum(
        jax.grad(_padded_lm_loss)(w, *(jnp.split(a, 4)[k] for a in (x, targets, mask))) / 4 for k in range(4)
    )
    assert not np.allclose(per_microbatch, jax.grad(_padded_lm_loss)(w, x, targets, mask), rtol=1e-3)


def test_a_normalized_loss_pipelined_on_two_stages():
    """Planned into two stages on 2 x 4 CPU devices and run by `PipelinedStep`: the loss (the
    quotient of two sums) and the gradients' scaling run once, in update fragments (ops of
    kind `step` are the update's, whatever the data flow says)."""
    args = _token_data()
    step = _sgd(_padded_lm_loss)
    module, _ = split_jax_step(step, args, 4)
    plan = (
        "hlopar-cluster-operators{layers=2},hlopar-stage-construction{schedule=1f1b num-hosts=2 "
        "devices-per-host=4 workers=1 stages=2}"
    )
    program = pipeline_program(run_pipeline(str(module), plan))
    assert len(program.meshes) == 2, "the plan does not pipeline: the test would prove less"
    assert_leaves_close(PipelinedStep(program)(jax.tree_util.tree_leaves(args), "1f1b"), jax.jit(step)(*args), RTOL)


def test_a_normalizer_computed_from_the_parameters_is_refused():
    w, x, targets, mask = _token_data()

    def loss_fn(w, x, targets, mask):
        probs = jax.nn.softmax(x @ w)
        return jnp.sum(probs[..., 0] * mask) / jnp.sum(probs[..., 1] * mask)

    with pytest.raises(DiagnosticError) as error:
        split_jax_step(_sgd(loss_fn), (w, x, targets, mask), 4)
    assert "is not a sum or a mean over the batch" in str(error.value)


# --------------------------------------------------------------------------- BatchNorm CNN (item 7)


class _BatchNormCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


_BN_MODEL = _BatchNormCNN()


def _bn_grads(params, batch_stats, x, labels, count):
    """Loss (a sum over `count` examples), gradients and new running statistics."""

    def loss_fn(params):
        logits, updates = _BN_MODEL.apply(
            {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum() / count, updates["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, stats


def _bn_step(params, batch_stats, x, labels):
    loss, grads, stats = _bn_grads(params, batch_stats, x, labels, x.shape[0])
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), stats, loss


def _gpipe_reference(params, batch_stats, x, labels, microbatches: int):
    """GPipe's semantics on one device: each microbatch normalized by its own statistics, the
    loss's global 1/N, gradients summed, running statistics averaged over microbatches."""
    parts = [
        _bn_grads(params, batch_stats, xs, ls, x.shape[0])
        for xs, ls in zip(jnp.split(x, microbatches), jnp.split(labels, microbatches))
    ]
    loss = sum(p[0] for p in parts)
    grads = jax.tree_util.tree_map(lambda *g: sum(g), *(p[1] for p in parts))
    stats = jax.tree_util.tree_map(lambda *s: sum(s) / microbatches, *(p[2] for p in parts))
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), stats, loss


def test_batchnorm_cnn_with_pooling_has_gpipe_statistics():
    x, labels = _images()
    x = jnp.concatenate([x, 2.0 * x + 1.0])  # 16 examples: microbatches of 4
    labels = jnp.concatenate([labels, labels])
    variables = _BN_MODEL.init(jax.random.PRNGKey(0), x, train=False)
    stats = jax.tree_util.tree_map(lambda s: s + 0.5, variables["batch_stats"])
    args = (variables["params"], stats, x, labels)
    module, warnings = split_jax_step(_bn_step, args, 4)
    assert len(warnings) == 1 and "computed per microbatch of 4 examples (GPipe)" in warnings[0]
    actual = run_split(module, args)
    # Summation order only (the statistics' sums over 4 examples are the same sums).
    assert_leaves_close(actual, jax.jit(_gpipe_reference, static_argnums=4)(*args, 4), rtol=1e-5)
    whole = [np.asarray(v) for v in jax.tree_util.tree_leaves(jax.jit(_bn_step)(*args))]
    assert not np.allclose(actual[-1], whole[-1], rtol=1e-3)  # ... and not the whole batch's statistics
