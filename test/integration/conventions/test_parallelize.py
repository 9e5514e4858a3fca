"""The conventions suite: training steps as JAX, Flax, Optax and Equinox users write them
(`steps.py`), through `hlopar.parallelize` on 2 hosts x 4 CPU devices for 3 steps, against
single-device JAX (`reference.py`: what the reference is and the tolerances).

`method="auto"` runs with the default number of microbatches (4 for these batches of 8 and
32), `method="shard"` with one, and then saves and restores the state (`fn.save`,
`fn.restore`: bit for bit, in the step's own pytree, a Flax `TrainState` included). Three steps also run under every schedule (two of them
`heavy`: `test_every_schedule`). No `batch_argnums`: hlopar finds the batch itself. Cost:
3.5 to 8 minutes for the default cases (2 cores, lightly to heavily shared), the
Flax steps the dearest.

One Ray cluster and one plan cache for the module (conftest's `ray_cluster`: Ray starts slowly on 2 cores).
"""

from __future__ import annotations

import inspect
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_trees_equal
from reference import compare, reference_step, trajectory
from steps import CASES, cross_entropy, data, init_mlp, mlp

import hlopar

CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")
STEPS = 3


def _key_data(tree):
    """Typed keys as their key data (numpy reads no key arrays)."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.random.key_data(x) if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        tree,
    )


def train(name: str, method: str, schedule: str = "eager-1f1b") -> None:
    """3 steps through parallelize, each compared with the reference from the same arguments,
    the losses with single-device training from the start."""
    case = CASES[name]()
    # Four microbatches asked for where the method splits: hlopar's own count would be one for
    # these one-stage plans, and the cases are here to check the microbatch semantics.
    parallel = hlopar.parallelize(
        case.step,
        cluster=CLUSTER,
        method=method,
        schedule=schedule,
        verbose=False,
        num_microbatches=1 if method == "shard" else 4,
    )
    args = case.args
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [parallel(*args)]
        microbatches = parallel.planned.program.microbatches
        assert microbatches == (1 if method == "shard" else 4)
        if case.microbatch_semantics and microbatches > 1:  # said once, as a Python warning
            said = [str(w.message) for w in caught if issubclass(w.category, hlopar.api.HloparWarning)]
            assert any("per microbatch" in m for m in said), [str(w.message) for w in caught]
        expected = trajectory(case, STEPS, microbatches)
        for k in range(STEPS):
            if k:
                results.append(parallel(*args))
            compare(case, args, results[k], reference_step(case, args, microbatches))
            if case.loss is not None:
                np.testing.assert_allclose(float(case.loss(results[k])), float(case.loss(expected[k])), rtol=1e-5)
            args = case.advance(args, results[k])
        if method == "shard":  # the state saved and restored as the step left it, in fn's own pytree
            with tempfile.TemporaryDirectory() as directory:
                parallel.save(directory)
                assert_trees_equal(_key_data(parallel.restore(directory)), _key_data(results[-1]))
    finally:
        parallel.shutdown()


@pytest.mark.parametrize("method", ["auto", "shard"])
@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_one_device(ray_cluster, name, method):
    train(name, method)


def on_every_schedule(name: str, *marks):
    return [pytest.param(name, s, id=f"{name}-{s}", marks=marks) for s in ("gpipe", "1f1b", "eager-1f1b-wd")]


@pytest.mark.parametrize(
    ("name", "schedule"),
    on_every_schedule("optax_clip_adam")
    + on_every_schedule("linen_train_state", pytest.mark.heavy)
    + on_every_schedule("linen_dropout", pytest.mark.heavy),
)
def test_every_schedule(ray_cluster, name, schedule):
    """The default schedule (eager-1f1b) is test_step_equals_one_device's. The Flax steps are
    heavy here (about 15 s each on 2 busy cores, 6 cases): the default suite keeps one step
    under every schedule, the one whose update reads every stage's gradients."""
    train(name, "auto", schedule)


def test_later_calls_keep_the_plan_and_the_workers(ray_cluster):
    """`flax.training.train_state.TrainState.create` starts the count at the Python int 0; the
    next step passes the int32 array the step returned. Same step, same plan, same workers."""
    case = CASES["linen_train_state"]()
    parallel = hlopar.parallelize(case.step, cluster=CLUSTER, method="shard", verbose=False)
    args, seen = case.args, []
    try:
        for _ in range(STEPS):
            args = case.advance(args, parallel(*args))
            seen.append((parallel.planned, parallel.runtime))
    finally:
        parallel.shutdown()
    assert all(planned is seen[0][0] and runtime is seen[0][1] for planned, runtime in seen)


def log_of_mean_step(params, key, x, y):
    def loss_fn(p):
        return jnp.log(cross_entropy(mlp(p, x), y))  # refused: not a mean

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


def whole_shape_dropout_step(params, key, x, y):
    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2 * h, 0.0)  # refused: rbg draws the whole shape
        return cross_entropy(h @ p["w2"] + p["b2"], y)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


@pytest.mark.parametrize(
    ("step", "impl", "why"),
    [
        (log_of_mean_step, "threefry2x32", "not a sum or a mean"),
        (whole_shape_dropout_step, "rbg", r"rng_bit_generator.*rng=\"per-microbatch\""),
    ],
    ids=["log_of_mean", "rbg_dropout"],
)
def test_refusals_name_the_users_line(step, impl, why):
    """What docs/training_step.md says is refused with microbatches, raised as PlanningError at
    the line of the user's code that does it, before any worker starts, when the user asks
    for microbatches; with hlopar's own count (a schedule given: the policy's count split
    first), planned with one microbatch and said as a warning at the same line."""
    line = next(
        n
        for n, text in enumerate(inspect.getsourcelines(step)[0], inspect.getsourcelines(step)[1])
        if "# refused" in text
    )
    parallel = hlopar.parallelize(step, cluster=CLUSTER, num_microbatches=4, verbose=False)
    with pytest.raises(hlopar.api.PlanningError, match=rf"{__file__}:{line}:\d+: error: .*{why}"):
        parallel(init_mlp(), jax.random.key(0, impl=impl), *data())
    assert parallel.runtime is None
    with pytest.warns(hlopar.HloparWarning, match=rf"{__file__}:{line}:\d+: warning: .*{why}.*one microbatch"):
        planned, _ = hlopar.parallelize(step, cluster=CLUSTER, schedule="eager-1f1b", verbose=False).plan(
            init_mlp(), jax.random.key(0, impl=impl), *data()
        )
    assert planned.program.microbatches == 1
