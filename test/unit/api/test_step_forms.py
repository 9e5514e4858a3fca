"""Steps as their libraries write them that `parallelize` takes beyond a jitted function of
arrays returning its loss: a step dropping its loss (`hlopar.step_loss`), the loss named by
the user (`loss=`), and non-array leaves kept static (`hlopar.static_leaves`). One host of 2
CPU devices: the plans of one mesh and one microbatch run in this process, no Ray."""

from __future__ import annotations

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlopar
from hlopar.runtime.in_process import InProcessRuntime
from hlopar.static_leaves import StaticLeaves, is_static, static_mask
from hlopar.step_loss import returning_loss, unreturned_loss

CLUSTER = hlopar.Cluster.local(num_hosts=1, devices_per_host=2, device_kind="cpu")


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 3))}


def _batch():
    return jax.random.normal(jax.random.PRNGKey(1), (8, 4)), jax.random.normal(jax.random.PRNGKey(2), (8, 3))


def _loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def _grad_only_step(params, x, y):
    grads = jax.grad(_loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def _aux_dropped_step(params, x, y):
    def loss_fn(params):
        loss = _loss(params, x, y)
        return loss, jnp.max(x @ params["w1"])  # a metric, dropped with the loss

    grads, _ = jax.grad(loss_fn, has_aux=True)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def _loss_returned_step(params, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss, "mean": jnp.mean(y)}


def _forward_only(params, x, y):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


@pytest.mark.parametrize("step", [_grad_only_step, _aux_dropped_step])
def test_a_dropped_loss_is_found_in_jaxs_trace(step):
    """The scalar the gradients are taken of, not a metric dropped beside it; the step that
    also returns it computes it as jax does."""
    params, (x, y) = _params(), _batch()
    traced = jax.jit(step).trace(params, x, y)
    loss = unreturned_loss(traced.jaxpr)
    assert loss is not None
    with_loss = returning_loss(step, traced.jaxpr, loss, jax.tree_util.tree_structure(traced.out_info))
    assert inspect.signature(with_loss) == inspect.signature(step)  # jax names @main's arguments by it
    out, value = jax.jit(with_loss)(params, x, y)
    assert float(value) == float(jax.jit(_loss)(params, x, y))
    expected = jax.jit(step)(params, x, y)
    assert all(
        bool(jnp.all(a == b)) for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected))
    )


@pytest.mark.parametrize("step", [_loss_returned_step, _forward_only])
def test_nothing_is_found_where_the_loss_is_returned_or_no_gradient_taken(step):
    assert unreturned_loss(jax.jit(step).trace(_params(), *_batch()).jaxpr) is None


def test_a_step_dropping_its_loss_is_planned_as_training_and_runs_here():
    """Forward, backward and update stages, the batch sharded: not a forward-only plan. One
    mesh, one microbatch: in this process, and the call returns what the step returns."""
    params, (x, y) = _params(), _batch()
    step = hlopar.parallelize(_grad_only_step, cluster=CLUSTER, method="shard", cache=False, verbose=False)
    out = step(params, x, y)
    assert isinstance(step.runtime, InProcessRuntime)
    assert [f.name for f in step.planned.program.fragments] == ["stage0_forward", "stage0_backward", "stage0_update"]
    expected = jax.jit(_grad_only_step)(params, x, y)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)  # one device against two
    forward = hlopar.parallelize(
        _forward_only, cluster=CLUSTER, method="shard", batch_argnums=(1, 2), cache=False, verbose=False
    )
    # Outputs near 1, sums of 8 products split over 2 devices: float32 rounding, about 3e-7.
    np.testing.assert_allclose(np.asarray(forward(params, x, y)), jax.jit(_forward_only)(params, x, y), atol=1e-6)
    assert isinstance(forward.runtime, InProcessRuntime)


@pytest.mark.parametrize("loss", ["[1]['loss']", lambda out: out[1]["loss"]])
def test_loss_names_a_result_by_its_path_or_a_function(loss):
    step = hlopar.parallelize(_loss_returned_step, cluster=CLUSTER, loss=loss, cache=False, verbose=False)
    planned, _ = step.plan(_params(), *_batch())
    assert planned.plan["split"]["loss_result"] == 2  # leaves: [0]['w1'], [0]['w2'], [1]['loss'], [1]['mean']


def test_loss_naming_no_scalar_result_is_refused_in_the_users_terms():
    line = inspect.getsourcelines(_loss_returned_step)[1]
    where = f"hlopar cannot parallelize _loss_returned_step ({__file__}:{line}):\n"
    with pytest.raises(hlopar.PlanningError) as refused:
        hlopar.parallelize(_loss_returned_step, cluster=CLUSTER, loss="[2]", verbose=False).plan(_params(), *_batch())
    assert str(refused.value) == (
        f"{where}loss='[2]' names no result leaf of _loss_returned_step; its results are "
        "[0]['w1'], [0]['w2'], [1]['loss'], [1]['mean']"
    )
    with pytest.raises(hlopar.PlanningError) as refused:
        hlopar.parallelize(_loss_returned_step, cluster=CLUSTER, loss=lambda out: out[0]["w1"], verbose=False).plan(
            _params(), *_batch()
        )
    assert str(refused.value) == (
        f"{where}loss=<lambda> names _loss_returned_step's result [0]['w1'], a float32[4, 8]: the loss is a "
        "floating-point scalar"
    )
    with pytest.raises(TypeError, match="^loss must be a result's path"):
        hlopar.parallelize(_loss_returned_step, loss=2)
    with pytest.raises(ValueError, match="^loss and loss_result both name the loss"):
        hlopar.parallelize(_loss_returned_step, loss="[1]['loss']", loss_result=2)


def test_no_loss_and_no_gradient_under_microbatches_is_refused_naming_loss():
    line = inspect.getsourcelines(_forward_only)[1]
    with pytest.raises(hlopar.PlanningError) as refused:
        hlopar.parallelize(
            _forward_only, cluster=CLUSTER, num_microbatches=2, batch_argnums=(1, 2), verbose=False
        ).plan(_params(), *_batch())
    assert str(refused.value) == (
        f"hlopar cannot parallelize _forward_only ({__file__}:{line}):\n"
        "error: hlopar-split-microbatches: no loss found: _forward_only returns no floating-point scalar that "
        "it takes gradients of: microbatches split a training step (name the loss with loss=..., a result's "
        "path such as \"[2]['loss']\" or a function of the results)"
    )


# ----------------------------------------------------------------- non-array leaves


class _Model(eqx.Module):
    linear: eqx.nn.Linear
    activation: object
    name: str

    def __call__(self, x):
        return self.activation(jax.vmap(self.linear)(x))


def _model(activation=jax.nn.relu):
    return _Model(eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(0)), activation, "model")


def _model_step(model, x, y):
    @eqx.filter_value_and_grad
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = loss_fn(model)
    return loss, eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))


def test_non_array_leaves_are_static_and_part_of_the_signature():
    x, y = _batch()
    relu, tanh = StaticLeaves.of((_model(), x), "step"), StaticLeaves.of((_model(jnp.tanh), x), "step")
    assert relu.key != tanh.key and relu.key == StaticLeaves.of((_model(), x * 2), "step").key
    assert relu.paths() == ["[0].linear.weight", "[0].linear.bias", "[1]"]
    assert relu.positions() == [0, 0, 1]
    assert [is_static(v) for v in (1, 1.5, True, "a", jax.nn.relu, np.float32(1), x)] == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
    ]
    with pytest.raises(TypeError) as refused:
        StaticLeaves.of(({"w": x, "names": _Unhashable()},), "step")
    assert str(refused.value) == (
        "step's argument [0]['names'] is a _Unhashable, not an array: hlopar keeps such leaves static, as "
        "eqx.filter_jit does, which needs them hashable (unhashable type: '_Unhashable'); make it an array, "
        "or a hashable value"
    )


def test_python_numbers_of_an_equinox_module_are_static_as_eqx_filter_jit_keeps_them():
    """MaxPool2d's `init = -inf` traced would be differentiated as the pool's init value (jax
    refuses); a Python number outside a module (a TrainState's `step`) is traced, as jax.jit
    traces it."""
    pool, x = eqx.nn.MaxPool2d(2), jnp.ones((1, 4, 4))
    assert static_mask((pool, {"step": 0, "x": x})) == [True, True, False, False]  # init, operation
    split = StaticLeaves.of((pool, x), "step")
    assert split.static == {0: -jnp.inf, 1: jax.lax.max} and split.paths() == ["[1]"]
    step, results = split.traced(lambda pool, x: (pool, pool(x)))
    out = jax.jit(step)(*split.dynamic)
    back = results.rebuild(jax.tree_util.tree_leaves(out), jax.tree_util.tree_structure(out))
    assert back[0].init == -jnp.inf and isinstance(back[0].init, float) and back[1].shape == (1, 3, 3)


class _Unhashable:
    __hash__ = None


def test_a_model_passed_whole_runs_as_eqx_filter_jit_runs_it():
    """Functions and strings in the arguments and the results: static, given back as they
    are; another activation is another signature."""
    x, y = _batch()
    step = hlopar.parallelize(_model_step, cluster=CLUSTER, method="shard", cache=False, verbose=False)
    for model in (_model(), _model(jnp.tanh)):
        loss, new = step(model, x, y)
        want_loss, want = eqx.filter_jit(_model_step)(model, x, y)
        assert new.activation is model.activation and new.name == "model"
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new.linear.weight), want.linear.weight, rtol=1e-6, atol=1e-7)
    assert len(step._signatures) == 2 and isinstance(step.runtime, InProcessRuntime)
