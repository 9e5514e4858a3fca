"""Layer stacks under `scan` split into microbatches (issue 17, item 3): the backward loop sums
each layer's weight gradients over the batch and writes them into stacked carries; those are
sums, accumulated over microbatches like top-level gradients.

The models are `scan_steps`' (a plain-JAX `lax.scan` GPT with Adam or SGD, a Flax `nn.scan`
Transformer with a TrainState), with and without `jax.checkpoint` around each block. Each
runs 3 steps against single-device JAX: every step from the same arguments, compared by
`numerics.assert_adam_step_close` (updates to 1e-5 of each entry plus 1e-5 of the leaf's
largest, 1e-4 after the first step; Adam's noise masked), the losses with
single-device training from the start to 1e-5. Two ways: the split step run by the local
executor (`MicrobatchedStep`, no Ray: seconds), and `hlopar.parallelize` on 2 hosts x 4 CPU
devices with `method="shard"` and 4 microbatches (the loops stay loops: one stage; Ray,
about 45 s a case on 2 cores; the Flax models, the checkpointed twins and method="auto" `heavy`:
the GPT and the Flax scan stacks are pipelined in test/unit/runtime/test_scan_pipelines.py). Also: `lax.cond` inside the
scanned layer (branches that sum over the batch), and a batch statistic inside the loop,
refused at the user's line.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scan_steps
from microbatch_steps import imported, run_pipeline
from numerics import assert_adam_step_close, assert_updates_close
from oracles.microbatched import MicrobatchedStep

import hlopar
from hlopar.dialect.attributes import BATCH, SUM
from hlopar.dialect.split import op_kinds
from hlopar.ir.graph import FuncGraph

RTOL = 1e-5
# After the first step Adam divides moments of gradients that change sign between steps:
# their rounding (another order of float additions) is relative to the leaf's larger
# updates. Measured: 2.6e-5 of the largest update (GPT's fc1, step 2); pure JAX accumulating
# 4 microbatches' gradients differs from the full batch by 1.6e-5 there.
LATER_MAX_RTOL = 1e-4
STEPS = 3
MICROBATCHES = 4
CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")

MODELS = {
    "gpt": lambda: scan_steps.gpt_scan(),
    "gpt_remat": lambda: scan_steps.gpt_scan(remat=True),
    "gpt_sgd_remat": lambda: scan_steps.gpt_scan(optimizer="sgd", remat=True),
    "flax": lambda: scan_steps.flax_scan(),
    "flax_remat": lambda: scan_steps.flax_scan(remat=True),
}


def model(name: str):
    """(step, arguments as jax arrays: TrainState's step=0 an int32, as jax.jit sees it)."""
    step, args = MODELS[name]()
    return step, jax.tree_util.tree_map(jnp.asarray, args)


def train(step, args, run_step) -> None:
    """STEPS steps of `run_step(args) -> results`, each against `jax.jit(step)` from the same
    arguments, the losses against single-device training from the start."""
    reference, expected = jax.jit(step), []
    state = args
    for _ in range(STEPS):
        expected.append(reference(*state))
        state = scan_steps.next_args(state, expected[-1])
    for k in range(STEPS):
        results = run_step(args)
        assert_adam_step_close(
            results,
            reference(*args),
            scan_steps.params_of(args),
            scan_steps.params_of,
            rtol=RTOL,
            max_rtol=RTOL if k == 0 else LATER_MAX_RTOL,
        )
        np.testing.assert_allclose(
            float(scan_steps.loss_of(results)), float(scan_steps.loss_of(expected[k])), rtol=1e-5
        )
        args = scan_steps.next_args(args, results)


def split_module(step, args):
    text = jax.jit(step, keep_unused=True).lower(*args).as_text()
    return run_pipeline(imported(text), f"hlopar-split-microbatches{{microbatches={MICROBATCHES}}}")


def stacked_sums(module) -> tuple[int, int]:
    """(loops of kind batch, sums leaving a loop): the reshapes of kind sum reading a loop's result."""
    graph = FuncGraph.from_module(module)
    kinds = op_kinds(graph)
    loops = {i for i, op in enumerate(graph.ops) if op.name == "stablehlo.while" and kinds[i] == BATCH}
    leaving = [
        i
        for i, op in enumerate(graph.ops)
        if op.name == "stablehlo.reshape" and kinds[i] == SUM and graph.values[op.operands[0]].producer in loops
    ]
    return len(loops), len(leaving)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.heavy] if n == "flax_remat" else []) for n in MODELS]
)  # flax_remat heavy (20 s on CI's 2 cores): gpt_remat and flax cover checkpointing and the Flax scan
def test_split_step_equals_one_device(name):
    """The split program (4 microbatches) run by the local executor: the backward loop runs per
    microbatch, every stacked gradient leaves it as a sum, and 3 steps equal one device."""
    step, args = model(name)
    module = split_module(step, args)
    loops, leaving = stacked_sums(module)
    stacked = len(jax.tree_util.tree_leaves(scan_steps.params_of(args)["blocks"]))
    assert loops == 2 and leaving == stacked  # forward and backward loop; one sum per stacked parameter
    executor = MicrobatchedStep(module)
    treedef = jax.tree_util.tree_structure(jax.eval_shape(step, *args))

    def run_step(arguments):
        flat = [np.asarray(x) for x in jax.tree_util.tree_leaves(arguments)]
        return jax.tree_util.tree_unflatten(treedef, executor(flat))

    train(step, args, run_step)


def branching_scan_step(w, flag, x, y):
    """Layers under scan whose activation is chosen by `lax.cond`: the backward's branches
    (`stablehlo.case`) sum the weight gradients over the batch."""

    def loss_fn(w):
        def layer(h, wi):
            return jax.lax.cond(flag, lambda h: jnp.tanh(h @ wi), lambda h: jax.nn.relu(h @ wi), h), None

        h, _ = jax.lax.scan(layer, x, w)
        return jnp.mean((h - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(w)
    return w - 0.1 * grads, loss


@pytest.mark.parametrize("flag", [True, False])
def test_branch_inside_the_scan_equals_one_device(flag):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (
        jax.random.normal(keys[0], (3, 4, 4)) / 2,
        jnp.array(flag),
        jax.random.normal(keys[1], (8, 4)),
        jax.random.normal(keys[2], (8, 4)),
    )
    text = jax.jit(branching_scan_step).lower(*args).as_text()
    module = run_pipeline(imported(text), f"hlopar-split-microbatches{{microbatches={MICROBATCHES} batch-args=2,3}}")
    new_w, loss = MicrobatchedStep(module)([np.asarray(a) for a in args])
    want_w, want_loss = jax.jit(branching_scan_step)(*args)
    assert_updates_close(new_w, want_w, args[0], rtol=RTOL, max_rtol=RTOL)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)


def centred_scan_step(params, x, y):
    """A layer stack that centres its activations on the batch's mean in every layer: a batch
    statistic inside the loop."""

    def loss_fn(params):
        def layer(h, w):
            h = jnp.tanh(h @ w)
            return h - h.mean(0), None  # refused: a statistic of the batch inside the loop

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.mean((h - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return params - 0.1 * grads, loss


def test_statistic_inside_the_loop_is_refused_at_the_users_line():
    """Asked for 4 microbatches with the loop kept (method="shard"), parallelize refuses before
    any worker starts, at the user's line; with one microbatch (shard's default) it plans.
    (method="auto" unrolls the stack first, `hlopar-unstack-layer-scans`: the mean is then a
    top-level batch statistic, taken per microbatch as GPipe does, with a warning.)"""
    args = (jnp.ones((3, 4, 4)) / 4, jnp.ones((8, 4)), jnp.zeros((8, 4)))
    lines, first = inspect.getsourcelines(centred_scan_step)
    line = first + next(n for n, text in enumerate(lines) if "# refused" in text)
    why = "uses a sum over the batch .* per example inside a loop or branch"
    parallel = hlopar.parallelize(
        centred_scan_step, cluster=CLUSTER, method="shard", num_microbatches=MICROBATCHES, verbose=False
    )
    with pytest.raises(hlopar.api.PlanningError, match=rf"{__file__}:{line}:\d+: error: .*{why}"):
        parallel.plan(*args)
    planned, _ = hlopar.parallelize(centred_scan_step, cluster=CLUSTER, method="shard", verbose=False).plan(*args)
    assert planned.program.microbatches == 1


@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("gpt", "shard"),
        pytest.param("gpt", "auto", marks=pytest.mark.heavy),
        pytest.param("flax_remat", "shard", marks=pytest.mark.heavy),
        pytest.param("gpt_remat", "shard", marks=pytest.mark.heavy),
        pytest.param("flax", "shard", marks=pytest.mark.heavy),
    ],
)
def test_parallelize_equals_one_device(ray_cluster, name, method):
    """`hlopar.parallelize` with 4 microbatches, 3 steps equal to one device: method="shard"
    keeps the loops (one stage on the 8 devices); method="auto" unrolls the stack first
    (`hlopar-unstack-layer-scans`) and may pipeline it (GPT: a batch of 8 and a sequence of 8)."""
    step, args = model(name)
    parallel = hlopar.parallelize(step, cluster=CLUSTER, method=method, num_microbatches=MICROBATCHES, verbose=False)
    try:
        train(step, args, lambda arguments: parallel(*arguments))
        assert parallel.planned.program.microbatches == MICROBATCHES
    finally:
        parallel.shutdown()
