"""The comparison helpers of `numerics` fail on the wrong answers they exist to catch."""

import jax
import numpy as np
import pytest
from numerics import adam_noise_mask, assert_trees_close, assert_trees_equal, assert_updates_close

from hlopar.models import get_train_step


def test_structure_shape_dtype_and_values_are_all_checked():
    tree = {"a": np.arange(3, dtype=np.float32), "b": [np.ones((2, 2), np.float32)]}
    assert_trees_equal(tree, jax.tree_util.tree_map(np.copy, tree))
    with pytest.raises(AssertionError, match="structures differ"):
        assert_trees_equal({"a": tree["a"]}, tree)
    with pytest.raises(AssertionError, match=r"\['b'\]\[0\]: shape"):
        assert_trees_close({"a": tree["a"], "b": [np.ones(4, np.float32)]}, tree, rtol=1)
    with pytest.raises(AssertionError, match="dtype"):
        assert_trees_equal({"a": tree["a"].astype(np.float64), "b": tree["b"]}, tree)
    off = {"a": tree["a"] + np.float32(1e-3), "b": tree["b"]}
    with pytest.raises(AssertionError, match=r"\['a'\]: 3 of 3 entries"):
        assert_trees_close(off, tree, rtol=1e-5)
    assert_trees_close(off, tree, rtol=0, atol=2e-3)
    assert_trees_close(off, tree, rtol=0, max_rtol=1e-3)  # 1e-3 of the leaf's largest value, 2


def _one_step():
    step = get_train_step("gpt", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    new, state, _ = step.jitted_step(params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    return params, new, state


def test_updates_catch_missing_flipped_and_stale_steps_but_not_noise():
    old, new, state = _one_step()
    mask = adam_noise_mask(state.mu)
    fraction = sum(m.sum() for m in jax.tree_util.tree_leaves(mask)) / sum(
        m.size for m in jax.tree_util.tree_leaves(mask)
    )
    assert 0.0 < fraction < 0.06  # the key bias (exact-zero gradient) and the smallest gradients
    assert_updates_close(new, new, old, rtol=1e-6, noise_mask=mask)
    flipped = jax.tree_util.tree_map(lambda n, o: 2 * o - n, new, old)
    for wrong in (old, flipped, jax.tree_util.tree_map(lambda n, o: n + (n - o), new, old)):
        with pytest.raises(AssertionError, match="update not within"):
            assert_updates_close(wrong, new, old, rtol=1e-5, noise_mask=mask)
    # A parameter tolerance of the learning rate (what this replaces) passes the flipped step.
    assert_trees_close(flipped, new, rtol=0, atol=2 * 1e-3 + 1e-6)


def test_masked_entries_are_bounded_and_max_rtol_is_relative_to_the_leaf():
    old = {"w": np.zeros(4, np.float32)}
    reference = {"w": np.array([1e-3, -1e-3, 1e-3, 1e-5], np.float32)}
    mask = {"w": np.array([False, False, True, False])}
    new = {"w": np.array([1e-3, -1e-3, -1e-3, 1e-5], np.float32)}  # the masked entry's sign is noise
    assert_updates_close(new, reference, old, rtol=1e-6, noise_mask=mask)
    new["w"][2] = 1.0  # far beyond the largest reference update
    with pytest.raises(AssertionError, match=r"\['w'\]: 1 of 4 entries"):
        assert_updates_close(new, reference, old, rtol=1e-6, noise_mask=mask)
    small = {"w": reference["w"] + np.array([0, 0, 0, 5e-9], np.float32)}  # 5e-4 of the small entry
    with pytest.raises(AssertionError, match="update not within"):
        assert_updates_close(small, reference, old, rtol=1e-5)
    assert_updates_close(small, reference, old, rtol=1e-5, max_rtol=1e-5)  # 5e-6 of the leaf's largest


def test_first_moment_slack_covers_rounding_of_a_small_moment_after_the_first_step():
    from numerics import first_moment_slack

    eps = float(np.finfo(np.float32).eps)
    params = {"w": np.zeros(3, np.float32)}
    mu = np.array([0.028, -0.01, 3.0e-5], np.float32)  # the last: 1.1e-3 of the largest

    def results(count):
        return (params, {"count": np.int32(count), "mu": {"w": mu}, "nu": {"w": mu**2}})

    assert first_moment_slack(results(1), params) is None  # the first step: no slack
    slack = first_moment_slack(results(2), params)["w"]
    np.testing.assert_allclose(slack, 5 * eps * 0.028 / np.abs(mu.astype(np.float64)), rtol=1e-6)
    old = {"w": np.zeros(3, np.float32)}
    reference = {"w": np.array([-0.05, 0.05, -0.0128010], np.float32)}
    rounded = {"w": reference["w"] + np.array([0, 0, 9.3e-7], np.float32)}  # m off by 0.58 eps max|m|
    with pytest.raises(AssertionError, match=r"1 of 3 entries"):
        assert_updates_close(rounded, reference, old, rtol=1e-5, max_rtol=1e-5)
    assert_updates_close(rounded, reference, old, rtol=1e-5, max_rtol=1e-5, slack={"w": slack})
    wrong = {"w": reference["w"] * np.float32(1.01)}  # 1 % off: no rounding explains it
    with pytest.raises(AssertionError, match=r"3 of 3 entries"):
        assert_updates_close(wrong, reference, old, rtol=1e-5, max_rtol=1e-5, slack={"w": slack})
