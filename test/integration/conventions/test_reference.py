"""The conventions suite's reference and comparison are right: the BatchNorm step cut in two
(`grads`, `apply`) is the step; per-microbatch statistics are another step than the full
batch's; `compare` fails on a wrong update, a wrong moment or a changed structure. One
device, no Ray."""

from __future__ import annotations

import jax
import numerics
import numpy as np
import pytest
from reference import compare, microbatch_mean, reference_step
from steps import CASES, mlp_loss


def test_batch_norm_cut_in_two_is_the_step():
    case = CASES["linen_batch_norm"]()
    whole = jax.jit(case.step)(*case.args)
    accumulated = microbatch_mean(case.grads, case.args, case.batch_argnums, 1)
    numerics.assert_trees_equal(jax.jit(case.apply)(case.args[0], *accumulated), whole)
    # Four microbatches of 8: other statistics, another step (what the suite must tell apart).
    with pytest.raises(AssertionError):
        compare(case, case.args, reference_step(case, case.args, 4), whole)


@pytest.mark.parametrize("name", ["jnp_adam", "optax_sgd_momentum", "nnx_optimizer", "typed_key"])
def test_compare_fails_on_wrong_results(name):
    case = CASES[name]()
    right = reference_step(case, case.args, 1)
    compare(case, case.args, right, right)
    # Two steps instead of one: the updates (and Adam's moments and count) differ.
    twice = reference_step(case, case.advance(case.args, right), 1)
    with pytest.raises(AssertionError):
        compare(case, case.args, twice, right)
    # Half the update of one parameter leaf.
    leaves, treedef = jax.tree_util.tree_flatten(right)
    first = jax.tree_util.tree_leaves(case.params_of(right))[0]
    old = jax.tree_util.tree_leaves(case.params(case.args))[0]
    halved = [old + (x - old) / 2 if x is first else x for x in leaves]
    with pytest.raises(AssertionError, match="update not within"):
        compare(case, case.args, jax.tree_util.tree_unflatten(treedef, halved), right)
    # A result missing from the tree.
    with pytest.raises(AssertionError):
        compare(case, case.args, right[:-1], right)


def test_linear_steps_accumulate_to_the_full_batch():
    """Why the full-batch step is the reference of a microbatched linear step: accumulating
    the gradients of 4 microbatches (the global 1/N) gives the same gradients to rounding."""
    case = CASES["optax_sgd_momentum"]()
    params, _, x, y = case.args
    grads = microbatch_mean(jax.grad(mlp_loss), (params, x, y), (1, 2), 4)
    full = jax.grad(mlp_loss)(params, x, y)
    numerics.assert_trees_close(grads, full, rtol=1e-5, max_rtol=1e-5)
    assert not np.allclose(jax.tree_util.tree_leaves(full)[0], 0)
