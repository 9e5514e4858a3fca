"""Random numbers and batch statistics under microbatching (issue 13, items 3 and 4).

- Dropout drawn with JAX's default threefry (partitionable): split into 4 microbatches, each
  microbatch draws exactly the whole batch's bits for its rows, so the step equals the
  full-batch step on one device up to the order of float additions (the masks are equal).
- Flax linen BatchNorm: one microbatch is the step as written; with 4, statistics are per
  microbatch (GPipe) and running statistics their mean, checked against that semantics
  written by hand.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from microbatch_steps import run_pipeline
from numerics import adam_noise_mask, assert_trees_close, assert_updates_close
from oracles.microbatched import MicrobatchedStep

from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.codegen.spmd import compile_spmd
from hlopar.dialect.split import read_index_arg, read_split, split_step
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.module import parse_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.runtime.local_executor import PipelinedStep

N, SEQ, D_IN, HIDDEN, OUT = 16, 3, 5, 8, 2
LR = 0.1

# Summation order only: the microbatches sum their gradients in another order than the
# whole batch (float32, a few hundred terms); with one microbatch, the two executables
# the step is cut into are fused and reassociated by XLA otherwise than the whole step.
RTOL = 2e-6


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _assert_close(actual, expected, rtol=RTOL) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def _main(module):
    return next(
        op.operation
        for op in module.regions[0].blocks[0].operations
        if op.operation.name == "func.func" and "main" in str(op.operation.attributes["sym_name"])
    )


def _split(step, args, microbatches: int, *, diagnostics: list | None = None, **options):
    """The step lowered, imported and split; returns the module and the pass's warnings."""
    module = parse_module(jax.jit(step).lower(*args).as_text(debug_info=True))
    context = PassContext()
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, context)
    SplitMicrobatchesPass(microbatches=microbatches, **options).run(module, context)
    if diagnostics is not None:
        diagnostics.extend(context.diagnostics)
    return module, [d.message for d in context.diagnostics]


# --------------------------------------------------------------------------- dropout


def _dropout_step(params, x, y, key):
    """x: (batch, seq, d_in). Dropout on an activation of shape (seq, batch, hidden) (batch
    not leading) and on one of shape (batch, hidden)."""

    def loss_fn(params):
        k1, k2 = jax.random.split(key)
        h = jnp.tanh(jnp.einsum("bsd,dh->sbh", x, params["w1"]))  # (seq, batch, hidden)
        keep = jax.random.bernoulli(k1, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0)
        pooled = jnp.tanh(h.sum(axis=0))  # (batch, hidden)
        keep2 = jax.random.bernoulli(k2, 0.7, pooled.shape)
        pooled = jnp.where(keep2, pooled / 0.7, 0.0)
        out = pooled @ params["w2"]
        return jnp.mean(jnp.square(out - y))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    new = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    return new, loss, grads


def _dropout_args(typed: bool):
    init = jax.random.split(jax.random.PRNGKey(7), 4)
    params = {"w1": jax.random.normal(init[0], (D_IN, HIDDEN)), "w2": jax.random.normal(init[1], (HIDDEN, OUT))}
    x = jax.random.normal(init[2], (N, SEQ, D_IN))
    y = jax.random.normal(init[3], (N, OUT))
    key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
    return params, x, y, key


def _host(args) -> list:
    return jax.tree_util.tree_leaves(args)


@pytest.mark.parametrize("typed", [False, True], ids=["raw-key", "typed-key"])
def test_dropout_draws_the_whole_batch_bits(typed):
    args = _dropout_args(typed)
    expected = _leaves(jax.jit(_dropout_step)(*args))
    module, warnings = _split(_dropout_step, args, 4)
    assert warnings == []
    main = _main(module)
    index = read_index_arg(main)
    assert index == 5  # w1, w2, x, y, key: the microbatch index follows the step's own arguments
    assert read_split(main) == (4, (2, 3, 5))
    step = MicrobatchedStep(module)
    assert step.split.index_arg == 5
    _assert_close(step(_host(args)), expected)
    # The dropout changes the result: a step without the global counters would not match.
    assert not np.allclose(
        expected[1], _leaves(jax.jit(_dropout_step)(args[0], args[1], args[2], jax.random.PRNGKey(4)))[1]
    )


def test_dropout_split_step_and_functions_form():
    """split_step's two modules, run by hand, and the functions form (which makes the index
    itself) give the same bits."""
    args = _dropout_args(False)
    expected = _leaves(jax.jit(_dropout_step)(*args))
    module, _ = _split(_dropout_step, args, 4)
    split = split_step(module)
    assert split.index_arg in split.microbatch_args and split.index_arg not in split.update_args
    leaves = _host(args)
    full = leaves + [np.arange(4, dtype=np.int32)]
    micro = compile_spmd(split.microbatch.module, jax.devices()[:1])
    sums = None
    for k in range(4):
        inputs = [
            np.asarray(full[i])[k * split.argument_shapes[i][0] : (k + 1) * split.argument_shapes[i][0]]
            if i in split.batch_args
            else full[i]
            for i in split.microbatch_args
        ]
        parts = [np.asarray(p) for p in micro(*inputs)]
        sums = parts if sums is None else [s + p for s, p in zip(sums, parts)]
    update = compile_spmd(split.update.module, jax.devices()[:1])
    _assert_close(update(*[full[i] for i in split.update_args], *sums), expected)

    functions, _ = _split(_dropout_step, args, 4, functions=True)
    _assert_close(compile_spmd(functions, jax.devices()[:1])(*leaves), expected)


def test_one_microbatch_adds_no_index():
    args = _dropout_args(False)
    module, _ = _split(_dropout_step, args, 1)
    main = _main(module)
    assert read_index_arg(main) is None
    _assert_close(MicrobatchedStep(module)(_host(args)), _leaves(jax.jit(_dropout_step)(*args)))


def _rng_step(w, x):
    noise = jax.lax.rng_uniform(0.0, 1.0, x.shape)
    loss = jnp.mean(jnp.square(x * noise @ w))
    return w - LR * jax.grad(lambda w: jnp.mean(jnp.square(x * noise @ w)))(w), loss


def test_whole_shape_generator_needs_the_option():
    args = (jnp.ones((D_IN, OUT)), jnp.ones((N, D_IN)))
    with pytest.raises(DiagnosticError) as error:
        _split(_rng_step, args, 4)
    message = str(error.value)
    assert "draws random numbers for the whole batch at once" in message and "rng=per-microbatch" in message
    _, warnings = _split(_rng_step, args, 4, rng="per-microbatch")
    assert len(warnings) == 1 and "draws random numbers per microbatch" in warnings[0]
    _, warnings = _split(_rng_step, args, 1)  # one microbatch draws the whole batch's numbers
    assert warnings == []


# --------------------------------------------------------------------------- batch normalization


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(6, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = nn.relu(x)
        return nn.Dense(OUT)(x)


_MODEL = _CNN()


def _bn_loss(params, batch_stats, x, y, divisor):
    logits, updates = _MODEL.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy(logits, y).sum() / divisor, updates["batch_stats"]


def _bn_step(params, batch_stats, x, y):
    """As the Flax docs write it: batch_stats threaded through the step (a mean loss)."""
    (loss, new_stats), grads = jax.value_and_grad(_bn_loss, has_aux=True)(params, batch_stats, x, y, x.shape[0])
    new_params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    return new_params, new_stats, loss


def _bn_args():
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    x = jax.random.normal(keys[0], (N, 6, 6, 3))
    y = jax.nn.one_hot(jax.random.randint(keys[1], (N,), 0, OUT), OUT)
    variables = _MODEL.init(keys[2], x, train=False)
    # Non-trivial running statistics, so that the combination is visible.
    stats = jax.tree_util.tree_map(lambda s: s + 0.5, variables["batch_stats"])
    return variables["params"], stats, x, y


def _per_microbatch_reference(params, batch_stats, x, y, microbatches):
    """GPipe's semantics by hand: each microbatch normalized by its own statistics, loss
    with the global 1/N, gradients summed, running statistics averaged over microbatches."""
    n = x.shape[0] // microbatches
    loss, grads, stats = 0.0, None, []
    for k in range(microbatches):
        part = slice(k * n, (k + 1) * n)
        (l, s), g = jax.value_and_grad(_bn_loss, has_aux=True)(params, batch_stats, x[part], y[part], x.shape[0])
        loss = loss + l
        grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        stats.append(s)
    new_params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    new_stats = jax.tree_util.tree_map(lambda *s: sum(s) / microbatches, *stats)
    return new_params, new_stats, loss


def test_batchnorm_one_microbatch_is_the_step():
    args = _bn_args()
    module, warnings = _split(_bn_step, args, 1)
    assert warnings == []
    _assert_close(MicrobatchedStep(module)(_host(args)), _leaves(jax.jit(_bn_step)(*args)))


def test_batchnorm_statistics_per_microbatch():
    args = _bn_args()
    diagnostics = []
    module, warnings = _split(_bn_step, args, 4, diagnostics=diagnostics)
    # Located at the user's line that calls the layer, not inside Flax.
    assert diagnostics[0].location.file == __file__ and diagnostics[0].severity == "warning"
    assert warnings == [
        "hlopar-split-microbatches: batch statistics are computed per microbatch of 4 examples "
        "(GPipe), not over the batch of 16; running statistics are the mean over microbatches"
    ]
    actual = MicrobatchedStep(module)(_host(args))
    expected = _leaves(jax.jit(_per_microbatch_reference, static_argnums=4)(*args, 4))
    # Summation order only (the statistics' sums over 4 examples are the same sums).
    _assert_close(actual, expected, rtol=1e-5)
    # ... and not the whole batch's statistics.
    whole = _leaves(jax.jit(_bn_step)(*args))
    assert not np.allclose(actual[-1], whole[-1], rtol=1e-3)


# --------------------------------------------------------------------------- pipelined


PLAN = "hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 workers=1}"


# Two stages on 2 x 4 (`stages=2`: one stage over all 8 devices would fit any memory two
# stages fit, its state split 8 ways). The BatchNorm step's layers (`hlopar-cluster-operators`)
# go 0-1 | 2 (stage construction's report checks it): activations kept (remat=never); stage 0
# marked rematerialized where only that fits (remat=auto, 12 KiB), run as written (marked, no
# hlopar-rematerialize) and rematerialized; both stages rematerialized (remat=always).
_BN_PLAN = (
    "hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 workers=1 "
    "stages=2 remat={remat} report={report}}"
)
TWO_STAGES = {
    "dropout": (
        "hlopar-cluster-operators{layers=2},hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 "
        "workers=1 stages=2}",
        None,
    ),
    "batchnorm-keep": (_BN_PLAN.replace("{remat}", "never"), [([0, 1], False), ([2, 2], False)]),
    "batchnorm-marked": (
        _BN_PLAN.replace("{remat}", "auto memory-per-device=12KiB"),
        [([0, 1], True), ([2, 2], False)],
    ),
    "batchnorm-remat": (
        _BN_PLAN.replace("{remat}", "auto memory-per-device=12KiB") + ",hlopar-rematerialize",
        [([0, 1], True), ([2, 2], False)],
    ),
    "batchnorm-remat-all": (
        _BN_PLAN.replace("{remat}", "always") + ",hlopar-rematerialize",
        [([0, 1], True), ([2, 2], True)],
    ),
}


def _planned(module, plan: str, names: bool):
    """The split module planned; `names`: with its locations (JAX's name stacks, as
    `parallelize` lowers it), else as text without them (an exported module)."""
    if not names:
        return run_pipeline(str(module), plan)
    planned = module.clone()
    Pipeline.parse(f"builtin.module({plan})", planned.context).run(planned, PassContext())
    return planned


def _assert_step_close(actual, expected, params, rtol: float) -> None:
    """SGD steps' results (new parameters first): the parameters by update, where the
    reference's update (``-LR * g``) is not rounding noise (`numerics.adam_noise_mask`, whose
    rule holds for any gradient sum: the scale cancels); everything else to `rtol` of each
    entry and of its leaf's largest. Noise: the bias before a BatchNorm has a zero gradient in
    exact arithmetic (the normalization subtracts it), ~1e-7 in float32, which another
    summation order (another split into stages, another fusion) changes by its own size."""
    treedef = jax.tree_util.tree_structure(expected)
    actual = jax.tree_util.tree_unflatten(treedef, _leaves(actual))
    params = jax.tree_util.tree_map(np.asarray, params)
    noise = adam_noise_mask(jax.tree_util.tree_map(np.subtract, params, expected[0]))
    assert_updates_close(actual[0], expected[0], params, rtol=rtol, max_rtol=rtol, noise_mask=noise)
    assert_trees_close(actual[1:], expected[1:], rtol=rtol, max_rtol=rtol)


@pytest.mark.parametrize(
    "which, names",
    [
        ("dropout", False),
        ("batchnorm-keep", False),
        ("batchnorm-marked", False),
        ("batchnorm-remat", False),
        ("batchnorm-remat-all", False),
        ("dropout", True),
        ("batchnorm", True),
    ],
)
def test_pipelined_runs_the_same(which, names, tmp_path):
    """Planned into a pipeline on 2 x 4 CPU devices and run by `PipelinedStep`: the index
    argument reaches the stages that read it; the results are the microbatched step's.
    Stage construction puts BatchNorm's running statistics in the forward with name stacks
    (inside `jvp`), in the update without: the split follows either. Both splits of the
    BatchNorm step compute the microbatched step's values (the float64 test below)."""
    dropout = which == "dropout"
    step, args = (_dropout_step, _dropout_args(True)) if dropout else (_bn_step, _bn_args())
    module, _ = _split(step, args, 4)
    expected = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(jax.eval_shape(step, *args)),
        _leaves(MicrobatchedStep(module.clone())(_host(args))),
    )
    # With name stacks the clustering differs and no memory limit makes these tiny steps two
    # stages: one stage, where the roles of the running statistics are what is checked.
    plan, stages = (PLAN, None) if names else TWO_STAGES[which]
    report = tmp_path / "plan.json"
    program = pipeline_program(_planned(module, plan.replace("{report}", str(report)), names))
    assert program.index_arg == (5 if dropout else None)
    assert names or len(program.meshes) == 2, "the plan does not pipeline: the test would prove less"
    if stages is not None:
        planned = [(s["layers"], s["remat"]) for s in json.loads(report.read_text())["stages"]]
        assert planned == stages, f"the plan is not the split this case is for: {planned}"
    _assert_step_close(PipelinedStep(program)(_host(args), "1f1b"), expected, args[0], rtol=1e-5)


def test_pipelined_batchnorm_split_is_exact_in_float64(tmp_path):
    """The 0-1 | 2 split (stage 0 marked rematerialized, run as written) in float64 on the
    same data: every leaf is the microbatched step's to float64's rounding, the biases before
    a BatchNorm (zero gradient, ~1e-17 here) too; so what float32 shows for those biases is
    rounding, not a split computing otherwise. (float64 doubles every byte: 24KiB per device
    plans what 12KiB plans in float32.)"""
    args32 = jax.tree_util.tree_map(np.asarray, _bn_args())
    with jax.enable_x64(True):
        args = jax.tree_util.tree_map(lambda a: a.astype(np.float64), args32)
        module, _ = _split(_bn_step, args, 4)
        expected = MicrobatchedStep(module.clone())(_host(args))
        report = tmp_path / "plan.json"
        plan = _BN_PLAN.replace("{remat}", "auto memory-per-device=24KiB").replace("{report}", str(report))
        program = pipeline_program(_planned(module, plan, False))
        planned = [(s["layers"], s["remat"]) for s in json.loads(report.read_text())["stages"]]
        assert planned == [([0, 1], True), ([2, 2], False)], planned
        actual = PipelinedStep(program)(_host(args), "1f1b")
    assert all(np.asarray(a).dtype == np.float64 for a in actual)
    assert_trees_close(_leaves(actual), _leaves(expected), rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------- one microbatch splits nothing


def _odd_step(w, x, y):
    """What only a split would forbid: a statistic that is not a mean (x minus its batch
    sum), a sum over the batch inside a loop; and per-example predictions returned (concatenated
    over microbatches since)."""

    def loss_fn(w):
        h = x @ w
        h = h - jnp.sum(h, axis=0)
        total = jax.lax.fori_loop(0, 2, lambda i, acc: acc + jnp.sum(jnp.square(h - y)), 0.0)
        return total / x.shape[0], h

    (loss, predictions), grad = jax.value_and_grad(loss_fn, has_aux=True)(w)
    return w - LR * grad, loss, predictions


def _odd_args():
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    return (
        jax.random.normal(keys[0], (D_IN, OUT)),
        jax.random.normal(keys[1], (N, D_IN)),
        jax.random.normal(keys[2], (N, OUT)),
    )


def test_one_microbatch_refuses_nothing():
    args = _odd_args()
    module, warnings = _split(_odd_step, args, 1, batch_args=(1, 2))
    assert warnings == []
    expected = _leaves(jax.jit(_odd_step)(*args))
    _assert_close(MicrobatchedStep(module.clone())(_host(args)), expected)
    # The same as a one-stage program (what method="shard" plans).
    program = pipeline_program(run_pipeline(str(module), PLAN))
    _assert_close(PipelinedStep(program)(_host(args), "1f1b"), expected)


def _sum_statistic_step(w, x, y):
    def loss_fn(w):
        h = x @ w
        return jnp.mean(jnp.square(h - jnp.sum(h, axis=0) - y))

    loss, grad = jax.value_and_grad(loss_fn)(w)
    return w - LR * grad, loss


def test_several_microbatches_name_what_needs_the_split():
    args = _odd_args()
    with pytest.raises(DiagnosticError) as error:
        _split(_odd_step, args, 2, batch_args=(1, 2))
    # The predictions are concatenated over microbatches (test_per_example_outputs.py): not what is refused.
    assert "hlopar-split-microbatches:" in str(error.value) and "result 2" not in str(error.value)
    with pytest.raises(DiagnosticError) as error:
        _split(_sum_statistic_step, args, 2, batch_args=(1, 2))
    assert "a batch statistic that is not a mean over the batch" in str(error.value)
    assert "(with microbatches=1 the step runs as written)" in str(error.value)
