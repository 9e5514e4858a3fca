"""The model garden: the kinds of models the Flax and Equinox example galleries train
(`garden_linen.py`, `garden_equinox.py`), each step through `hlopar.parallelize` for 3 steps and
compared with single-device JAX as the conventions suite compares (`reference.py`: the
reference and the tolerances, and why).

- `method="auto"`, `num_microbatches=4` on `Cluster.local(2, 4)`: the step split into
  microbatches and pipelined (issue 27), run in this process (`runtime="auto"` on a local
  cluster: every mesh's stream here, issue 28).
  The BatchNorm models against the single-device reference of GPipe's semantics
  (docs/training_step.md, "BatchNorm and other state computed in the forward pass").
- `method="shard"` (one microbatch) on `Cluster.local(1, 8)` with `runtime="process"`: one mesh,
  one microbatch, so the plan runs in this process as `jax.jit` does whatever the step
  returns (issue 27 item 4); Ray is not under test there, and no worker starts.

Models with non-array leaves (the Equinox ones) are compared by their array leaves; their
other leaves (functions, strings, flags) must come back as the step returned them on one
device. Steps that return no loss are compared by their state alone.

Cases that today's hlopar refuses or gets wrong are `xfail(strict=True)` with the issue 27 item
that covers them: they turn into failures when fixed, so that the mark is removed.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import garden_equinox
import garden_linen
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from reference import Case, compare, microbatch_mean, reference_step, trajectory

import hlopar
from hlopar.runtime.remote_array import RemoteArray

TWO_HOSTS = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")
ONE_HOST = hlopar.Cluster.local(num_hosts=1, devices_per_host=8, device_kind="cpu")
STEPS, MICROBATCHES = 3, 4

CASES = {
    "resnet": garden_linen.case_resnet,
    "cnn": garden_linen.case_cnn,
    "transformer_lm": garden_linen.case_transformer_lm,
    "lstm": garden_linen.case_lstm,
    "gru": garden_linen.case_gru,
    "vae": garden_linen.case_vae,
    "eqx_cnn": garden_equinox.case_eqx_cnn,
    "eqx_stateful": garden_equinox.case_eqx_stateful,
}

# What today's hlopar does not do yet: (case, method) -> the issue 27 item and what happens.
KNOWN: dict[tuple[str, str], str] = {}


def is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def arrays(tree):
    """`tree` with its non-array leaves (functions, strings, Python flags) blanked."""
    return jax.tree_util.tree_map(lambda x: x if is_array(x) else None, tree)


def others(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if not is_array(x)]


def on_host(tree):
    """Results as the reference takes them: a Ray plan's as jax arrays (`eqx.filter_jit` takes
    only jax arrays as traced), a pipelined plan's moved to one device (they live on several
    meshes' devices, which one jax computation does not take together)."""

    def read(x):
        if isinstance(x, RemoteArray):
            return jnp.asarray(x)
        if isinstance(x, jax.Array) and x.sharding.device_set != {jax.devices()[0]}:
            return jax.device_put(x, jax.devices()[0])
        return x

    return jax.tree_util.tree_map(read, tree)


def train(case: Case, method: str) -> None:
    """3 steps through parallelize, each compared with the reference from the same arguments,
    the losses with single-device training from the start."""
    microbatches = MICROBATCHES if method == "auto" else 1
    parallel = hlopar.parallelize(
        case.step,
        cluster=TWO_HOSTS if method == "auto" else ONE_HOST,
        method=method,
        num_microbatches=microbatches,
        runtime="auto" if method == "auto" else "process",
        verbose=False,
    )
    args = case.args
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = parallel(*args)
        assert parallel.planned.program.microbatches == microbatches
        if case.microbatch_semantics and microbatches > 1:  # said once, as a Python warning
            said = [str(w.message) for w in caught if issubclass(w.category, hlopar.HloparWarning)]
            assert any("per microbatch" in m for m in said), said
        expected = trajectory(case, STEPS, microbatches)
        for k in range(STEPS):
            if k:
                results = parallel(*args)
            want = reference_step(case, on_host(args), microbatches)
            assert others(results) == others(want)
            compare(case, arrays(args), arrays(results), arrays(want))
            if case.loss is not None:
                np.testing.assert_allclose(float(case.loss(results)), float(case.loss(expected[k])), rtol=1e-5)
            args = case.advance(args, results)
    finally:
        parallel.shutdown()


def params(method: str):
    for name in CASES:
        known = KNOWN.get((name, method))
        marks = () if known is None else pytest.mark.xfail(strict=True, reason=known)
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(params("auto")))
def test_pipelined_with_microbatches(name):
    train(CASES[name](), "auto")


@pytest.mark.parametrize("name", list(params("shard")))
def test_sharded_in_this_process(name):
    train(CASES[name](), "shard")


@pytest.mark.parametrize("name", ["resnet", "eqx_stateful"])
def test_batch_norm_cut_in_two_is_the_step(name):
    """The reference of the BatchNorm models under microbatches is their step cut in two
    (`Case.grads`, `Case.apply`): with one microbatch the cut computes the step."""
    case = CASES[name]()
    whole = eqx.filter_jit(case.step)(*case.args)
    accumulated = microbatch_mean(case.grads, case.args, case.batch_argnums, 1)
    rest = [a for i, a in enumerate(case.args) if i not in case.batch_argnums]
    numerics.assert_trees_equal(arrays(eqx.filter_jit(case.apply)(*rest, *accumulated)), arrays(whole))
