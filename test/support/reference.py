"""Training-step cases, their single-device references, and the comparison of a parallel run
with them: shared by the conventions suite and the model garden (test/integration).

Reference: `jax.jit(step)` on one device, from the same arguments as the parallel step
(so that differences do not compound over steps). Where the step is linear in the batch (a
mean loss, sums as metrics) and its random draws are exact under microbatching, gradient
accumulation over B microbatches computes the full-batch step up to the order of float
additions, so the full-batch step is the reference for every B; dropout included, since a
microbatch draws the full batch's bits for its rows. Where microbatches change what the step
computes (BatchNorm's batch statistics), `accumulated_step` is the reference: the case's
`grads` on each microbatch, averaged (the global 1/N of a mean: each microbatch's mean
counts 1/B), then its `apply` once; running statistics are the mean over microbatches.

Comparison (`compare`), with the project's shared helpers (`test/support/numerics.py`): every
result but the parameters to 1e-5 relative per entry plus 1e-5 of the leaf's largest
magnitude (float32 sums in another order; Adam's moments of cancelling gradients), integers
and keys exactly. The parameters by their UPDATE (new - old), so that a small update of a
large weight is not hidden in the weight's magnitude: to 1e-5 relative per entry plus 1e-5
of the leaf's largest update plus one ulp of the parameter (`numerics.assert_updates_close`).
Per entry alone is too tight here: a bias's gradient is a sum over the batch whose terms
cancel, its rounding error is relative to the largest terms, and SGD carries it into the
update as it is (measured: 4e-5 relative on one entry of `jnp_loss_first`), Adam after
two steps nearly so (1.1e-5 in `optax_schedule`). Where the step runs Adam, entries whose
gradient is rounding noise (zero in exact arithmetic, e.g. the bias of a Dense layer
before BatchNorm) are masked by the reference's first moment (`numerics.adam_noise_mask`):
Adam normalizes noise to a step of about the learning rate with an arbitrary sign, and its
moments there are noise too (zeroed on both sides); masked updates are only checked to be
no larger than the largest update of any parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numerics

from hlopar.static_leaves import static_mask

RTOL = 1e-5


@dataclass(frozen=True)
class Case:
    """A step and how to drive it for a few steps.

    `advance(args, results)`: the next step's arguments. `grads`/`apply`: the step cut in
    two where microbatches change its semantics (BatchNorm), for the reference
    (`reference_step`); None where the microbatched step is the full-batch step.
    `params(args)`/`params_of(results)`: the trained parameters, compared as updates.
    `loss(results)`: the loss, None for a step that returns none.
    """

    name: str
    step: Callable
    args: tuple
    batch_argnums: tuple[int, ...]
    advance: Callable[[tuple, Any], tuple]
    loss: Callable[[Any], jax.Array] | None
    params: Callable[[tuple], Any]
    params_of: Callable[[Any], Any]
    grads: Callable | None = None
    apply: Callable | None = None
    microbatch_semantics: bool = False  # several microbatches change the result (batch statistics)
    # Whether `jax.jit(step).lower(*args)` exports it for hlopar-compile: not where the
    # arguments hold non-array leaves (jax.jit refuses them) or the loss is not returned
    # (only `parallelize` finds it, in jax's trace).
    exported: bool = True


def split_batch(args: tuple, batch_argnums, microbatches: int) -> list[tuple]:
    """The arguments of each microbatch: every leaf of a batch argument cut along dim 0."""

    def part(k):
        return tuple(
            jax.tree_util.tree_map(lambda x: jnp.split(x, microbatches)[k], a) if i in batch_argnums else a
            for i, a in enumerate(args)
        )

    return [part(k) for k in range(microbatches)]


def microbatch_mean(fn, args: tuple, batch_argnums, microbatches: int):
    """Gradient accumulation on one device: `fn` on each microbatch, every floating result
    leaf averaged over the microbatches (others, flags and counters, are every microbatch's
    alike: the first's)."""
    outs = [eqx.filter_jit(fn)(*a) for a in split_batch(args, batch_argnums, microbatches)]

    def mean(*xs):
        return sum(xs[1:], xs[0]) / len(xs) if jnp.issubdtype(xs[0].dtype, jnp.floating) else xs[0]

    return jax.tree_util.tree_map(mean, *outs)


def reference_step(case: Case, args: tuple, microbatches: int):
    """What the step must compute on these arguments with `microbatches` microbatches
    (`eqx.filter_jit`, which takes a model whole; hlopar's results read as jax arrays on one
    device, Python numbers as the arrays jax.jit traces them as)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    args = jax.tree_util.tree_unflatten(
        tree, [x if fixed else _traced_as_jax_jit_traces(x) for x, fixed in zip(leaves, static_mask(args), strict=True)]
    )
    if case.grads is None or microbatches == 1:
        return eqx.filter_jit(case.step)(*args)
    accumulated = microbatch_mean(case.grads, args, case.batch_argnums, microbatches)
    rest = [a for i, a in enumerate(args) if i not in case.batch_argnums]
    return eqx.filter_jit(case.apply)(*rest, *accumulated)


def _traced_as_jax_jit_traces(x):
    if hasattr(x, "__jax_array__") and not isinstance(x, jax.Array):
        return x.__jax_array__()
    if isinstance(x, jax.Array) and x.sharding.device_set != {jax.devices()[0]}:
        # A result of a plan run in this process, on its mesh's devices: moved to the
        # reference's one device (two meshes' arrays do not mix; typed keys included).
        return jax.device_put(x, jax.devices()[0])
    return jnp.asarray(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def trajectory(case: Case, steps: int, microbatches: int = 1) -> list:
    """The results of `steps` steps of single-device training from the case's arguments."""
    args, results = case.args, []
    for _ in range(steps):
        results.append(reference_step(case, args, microbatches))
        args = case.advance(args, results[-1])
    return results


def compare(case: Case, args: tuple, actual, expected) -> None:
    """`actual` (a parallel step's results) against `expected` (the reference): same pytree,
    then every leaf (module docstring; `numerics.assert_adam_step_close`). Leaves that are no
    arrays (an Equinox model's functions and strings, `hlopar.static_leaves`) are equal."""
    actual, expected = _arrays(actual, expected)
    params = case.params(args)
    leaves, tree = jax.tree_util.tree_flatten(params)
    params = jax.tree_util.tree_unflatten(
        tree, [None if s else x for x, s in zip(leaves, static_mask(params), strict=True)]
    )
    numerics.assert_adam_step_close(actual, expected, params, case.params_of, rtol=RTOL)


def _arrays(actual, expected):
    """Both pytrees with their non-array leaves, checked equal, replaced by None."""
    have, tree = jax.tree_util.tree_flatten(actual)
    want, want_tree = jax.tree_util.tree_flatten(expected)
    assert tree == want_tree, f"results {tree}, expected {want_tree}"
    fixed, want_fixed = static_mask(actual), static_mask(expected)
    for a, b, s, t in zip(have, want, fixed, want_fixed, strict=True):
        assert s == t and (not s or a == b), (a, b)
    return tuple(
        jax.tree_util.tree_unflatten(tree, [None if s else x for x, s in zip(leaves, fixed, strict=True)])
        for leaves in (have, want)
    )
