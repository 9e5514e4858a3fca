"""How tests compare a parallel run's numbers with one device's: exactly, closely, or by update.

Importable as ``numerics`` from every test folder: this folder, test/support, is on ``sys.path``
through pytest's ``pythonpath`` setting (pyproject.toml), so no test needs a path hack.

Every comparison first checks that both sides have the same pytree structure (so a missing or
extra output fails, which ``zip`` would hide), then per leaf the shape and dtype, then the values;
a failure names the leaf by its pytree path (``[0]['layers'][1]['attn']['qkv']['bias']``).

Why parameter *updates* and not parameters: one Adam step from zero moments moves every entry by
about the learning rate, ``lr * g / (|g| + eps)``, whatever the gradient's size. A tolerance of
``lr`` on the new parameters therefore passes a missing or sign-flipped update.
`assert_updates_close` compares ``new - old`` with ``reference_new - old`` to a relative `rtol`
of the reference update, plus one unit in the last place (ulp) of the parameter: both new
parameters are rounded to their dtype at the parameter's magnitude, so their difference from
``old`` carries up to half an ulp of rounding each. After the first step, an update also gets
`max_rtol` of its leaf's largest update (see `assert_updates_close`).

The noise mask (`adam_noise_mask`): where a gradient is zero in exact arithmetic (the key bias
of attention: softmax is invariant to it), a float32 run holds rounding noise instead, and Adam
normalizes that noise to a step of about ``±lr`` with an arbitrary sign. Such entries carry no
information and are excluded. They are found from the *reference's* first moment ``m`` (Adam's
own running gradient, ``(1 - b1) g`` after one step, so its scale cancels below), never from the
run under test, so a bug cannot widen its own mask:

    noise  <=>  |m| <= k * eps(dtype) * max|m|          (max over every leaf of the tree)

A reduction of terms up to ``S = max|g|`` has a rounding error of a few ``eps * S`` (measured on
the zoo's tiny MLP, GPT and MoE against float64: at most 2.5 ``eps * S``; exact zeros hold at
most 0.002 ``eps * S``). For an entry outside the mask, an error ``delta`` in ``g`` changes Adam's
first update by ``eps_adam * delta / g**2`` relative; with ``k = 1000``, ``delta = 5 eps S``
(two runs) and the zoo's ``S >= 0.1`` that is below 1e-5, under the update tolerance. It masks
about 5% of the entries of GPT and MoE (the smallest gradients) and 16% of the MLP's (exactly
zero gradients behind dead ReLUs, whose update is zero anyway). Masked entries are still checked
to be finite and to move no further than the reference's largest update.

After the first step an update moves with Adam's first moment alone, and where ``m`` is a
sum that nearly cancels, the same rounding of a few ``eps * max|m|`` is a large part of it:
`first_moment_slack` (from the reference's moments, like the mask) allows each entry that
relative error, ``5 * eps * max|m| / |m|`` of its update.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

PyTree = Any

NOISE_K = 1000.0
MOMENT_ROUNDING_K = 5.0  # a reduction's rounding over two runs, in eps * max|term| (below)


def _leaves(actual: PyTree, expected: PyTree) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(path, actual, expected) per leaf, after checking structure, shapes and dtypes."""
    have, have_def = jax.tree_util.tree_flatten_with_path(actual)
    want, want_def = jax.tree_util.tree_flatten_with_path(expected)
    if have_def != want_def:
        raise AssertionError(
            f"tree structures differ ({len(have)} leaves vs {len(want)} expected):\n"
            f"  actual:   {have_def}\n  expected: {want_def}"
        )
    out = []
    for (path, a), (_, e) in zip(have, want, strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            raise AssertionError(f"{name}: shape {a.shape}, expected {e.shape}")
        if a.dtype != e.dtype:
            raise AssertionError(f"{name}: dtype {a.dtype}, expected {e.dtype}")
        out.append((name, a, e))
    return out


def _fail(name: str, bad: np.ndarray, actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    index = np.unravel_index(int(np.argmax(bad)), bad.shape) if bad.ndim else ()
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {bad.size} entries {what}; first at {tuple(int(i) for i in index)}: "
        f"{actual[index]!r} vs expected {expected[index]!r}"
    )


def assert_trees_equal(actual: PyTree, expected: PyTree) -> None:
    """Bit-exact equality (NaNs equal where both are NaN) of two pytrees of arrays."""
    for name, a, e in _leaves(actual, expected):
        both_nan = np.isnan(a) & np.isnan(e) if a.dtype.kind in "fc" else False
        bad = ~((a == e) | both_nan)
        if np.any(bad):
            _fail(name, np.atleast_1d(bad), np.atleast_1d(a), np.atleast_1d(e), "differ")


def assert_trees_close(
    actual: PyTree, expected: PyTree, *, rtol: float, atol: float = 0.0, max_rtol: float = 0.0
) -> None:
    """Per entry ``|a - e| <= atol + rtol * |e| + max_rtol * max|e of that leaf|``.

    `max_rtol` is for leaves whose small entries are sums that cancel (Adam's moments of a
    near-zero gradient): their error is relative to the leaf's largest terms, not to themselves.
    Integer and boolean leaves must be equal.
    """
    for name, a, e in _leaves(actual, expected):
        a1, e1 = np.atleast_1d(a), np.atleast_1d(e)
        if a.dtype.kind not in "fc":
            bad = a1 != e1
        else:
            scale = float(np.max(np.abs(e1))) if e1.size else 0.0
            bound = atol + rtol * np.abs(e1) + max_rtol * scale
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(a1 - e1) <= bound)
            bad &= ~(np.isnan(a1) & np.isnan(e1))
        if np.any(bad):
            _fail(name, bad, a1, e1, f"not within rtol={rtol} atol={atol} max_rtol={max_rtol}")


def assert_updates_close(
    new: PyTree,
    reference_new: PyTree,
    old: PyTree,
    *,
    rtol: float,
    max_rtol: float = 0.0,
    noise_mask: PyTree | None = None,
    slack: PyTree | None = None,
) -> None:
    """Compare the updates ``new - old`` with ``reference_new - old`` (see the module docstring):
    per entry within ``rtol * |u| + max_rtol * max|u of the leaf| + 1 ulp``.

    `max_rtol` is for steps after the first: Adam's update is ``lr * m / sqrt(v)``, and where the
    first moment ``m`` is a sum that cancels (a gradient changing sign between steps), its error
    is relative to the leaf's larger moments, not to itself.

    `noise_mask` (a tree of booleans shaped like the parameters, e.g. from `adam_noise_mask`)
    marks entries whose update is rounding noise: those are only checked to be finite and no
    larger than the largest reference update. `slack` (a tree of floats shaped like the
    parameters, e.g. from `first_moment_slack`) adds that fraction of each entry's update.
    """
    leaves = _leaves(new, reference_new)
    olds = _leaves(old, reference_new)
    masks = (
        [None] * len(leaves) if noise_mask is None else [m for _, m, _ in _leaves(noise_mask, _bools(reference_new))]
    )
    slacks = [None] * len(leaves) if slack is None else [x for _, x, _ in _leaves(slack, reference_new)]
    largest = max((float(np.max(np.abs(r - o))) for (_, _, r), (_, o, _) in zip(leaves, olds) if r.size), default=0.0)
    for (name, a, r), (_, o, _), mask, extra in zip(leaves, olds, masks, slacks, strict=True):
        a1, r1, o1 = (np.atleast_1d(x).astype(np.float64) for x in (a, r, o))
        got, want = a1 - o1, r1 - o1
        ulp = np.spacing(np.maximum(np.abs(np.atleast_1d(a)), np.abs(np.atleast_1d(r)))).astype(np.float64)
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        allowed = rtol * np.abs(want) + max_rtol * scale + ulp
        if extra is not None:
            allowed = allowed + np.atleast_1d(extra) * np.abs(want)
        bad = ~(np.abs(got - want) <= allowed)
        if mask is not None:
            m = np.atleast_1d(mask)
            wild = ~(np.abs(got) <= largest * (1 + rtol) + ulp)
            bad = np.where(m, wild, bad)
        if np.any(bad):
            _fail(name, bad, got, want, f"update not within rtol={rtol} (+1 ulp)")


def _bools(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x), bool), tree)


def adam_noise_mask(first_moment: PyTree, *, k: float = NOISE_K) -> PyTree:
    """Entries whose gradient is rounding noise, from the reference run's Adam first moment ``m``.

    ``|m| <= k * eps * max|m|`` with the max over all leaves; the derivation and the measured
    numbers behind ``k = 1000`` are in the module docstring.
    """
    leaves = [np.asarray(m) for m in jax.tree_util.tree_leaves(first_moment)]
    scale = max((float(np.max(np.abs(m))) for m in leaves if m.size), default=0.0)

    def mask(m):
        m = np.asarray(m)
        return np.abs(m) <= k * float(np.finfo(m.dtype).eps) * scale

    return jax.tree_util.tree_map(mask, first_moment)


def assert_step_close(
    outputs, reference: PyTree, params: PyTree, *, rtol: float, update_max_rtol: float | None = None
) -> None:
    """A compiled training step's flat `outputs` against one device's ``(new_params, adam_state, loss)``.

    The outputs must be as many as the reference's leaves; parameters are compared by update
    (noise masked by the reference's first moment), updates, Adam's state and the loss to `rtol`
    of each entry plus `rtol` of the leaf's largest entry (sums that cancel; for the updates
    `update_max_rtol` instead, where given), the step count exactly.
    """
    leaves, treedef = jax.tree_util.tree_flatten(reference)
    if len(outputs) != len(leaves):
        raise AssertionError(f"{len(outputs)} outputs, expected {len(leaves)}")
    new_params, state, loss = jax.tree_util.tree_unflatten(treedef, [np.asarray(o) for o in outputs])
    want_params, want_state, want_loss = reference
    assert_updates_close(
        new_params,
        want_params,
        params,
        rtol=rtol,
        max_rtol=rtol if update_max_rtol is None else update_max_rtol,
        noise_mask=adam_noise_mask(want_state.mu),
    )
    assert_trees_close((state, loss), (want_state, want_loss), rtol=rtol, max_rtol=rtol)


def assert_adam_step_close(
    actual: PyTree, expected: PyTree, params_before: PyTree, params_of, *, rtol: float, max_rtol: float | None = None
) -> None:
    """A training step's results against the reference's from the same arguments: the same
    pytree; the parameters (``params_of(results)``) by update, Adam's noise masked by the
    reference's first moment (where the step runs Adam); everything else (Adam's moments, whose
    masked entries are left out too, the loss, metrics, the step count exactly, typed keys by
    their key data) to `rtol` of each entry plus `max_rtol` (default `rtol`) of its leaf's largest."""
    max_rtol = rtol if max_rtol is None else max_rtol
    have, want = jax.tree_util.tree_structure(actual), jax.tree_util.tree_structure(expected)
    assert have == want, f"results {have}, expected {want}"
    want_params = params_of(expected)
    mask = first_moment_mask(expected, want_params)
    noise = None if mask is None else jax.tree_util.tree_leaves(mask)
    have_params = {id(x) for x in jax.tree_util.tree_leaves(params_of(actual))}
    assert_trees_close(
        _comparable(actual, have_params, noise),
        _comparable(expected, {id(x) for x in jax.tree_util.tree_leaves(want_params)}, noise),
        rtol=rtol,
        max_rtol=max_rtol,
    )
    assert_updates_close(
        params_of(actual),
        want_params,
        params_before,
        rtol=rtol,
        max_rtol=max_rtol,
        noise_mask=mask,
        slack=first_moment_slack(expected, want_params),
    )


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)


def _moment(path) -> str | None:
    """ "mu" or "nu" for a leaf of Adam's moments (optax's `ScaleByAdamState`, the zoo's
    `AdamState`, NNX's `opt_state[...]['mu']`), else None."""
    name = jax.tree_util.keystr(path)
    return next((m for m in ("mu", "nu") if f".{m}" in name or f"['{m}']" in name), None)


def _comparable(tree: PyTree, params: set[int], noise: list | None) -> PyTree:
    """`tree` with typed keys as their key data, the parameters (by id) blanked, and the
    entries of Adam's moments that `noise` masks (leaves in the parameters' order) zeroed."""
    count = {"mu": 0, "nu": 0}

    def leaf(path, x):
        if id(x) in params:
            return np.zeros((), np.float32)
        if _is_key(x):
            return jax.random.key_data(x)
        moment = _moment(path)
        if moment is None or noise is None:
            return x
        mask = noise[count[moment]]
        count[moment] += 1
        return np.where(mask, np.zeros((), np.asarray(x).dtype), x)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def first_moment_slack(results: PyTree, params: PyTree, *, k: float = MOMENT_ROUNDING_K) -> PyTree | None:
    """Per parameter entry, the relative error of its update that rounding in Adam's first
    moment explains after the first step, from the reference's `results`; None where the
    step runs no Adam or is its first.

    After the first step ``u = lr * m / (sqrt(v) + eps)`` moves with ``m`` alone (``v`` is a
    sum of squares, which does not cancel), and ``m`` is a sum of gradients that may cancel:
    its rounding is ``k * eps * max|m|`` (a reduction's, two runs: module docstring), so
    ``|du| / |u| <= k * eps * max|m| / |m|``. Where ``m`` is small next to the tree's largest
    that exceeds `rtol` (measured: the zoo's transformer LM pipelined over 4 microbatches,
    an entry of ``pos_embedding`` with ``|m| = 1.1e-3 max|m|``, its ``m`` off by 0.58
    ``eps * max|m|``, its update by 7.3e-5 relative). At the first step ``u = lr * g / (|g| +
    eps)`` hardly moves with ``g`` (the noise mask's derivation), so no slack is given there.
    """
    leaves = [x for path, x in jax.tree_util.tree_flatten_with_path(results)[0] if _moment(path) == "mu"]
    counts = [
        int(np.max(np.asarray(x)))
        for path, x in jax.tree_util.tree_flatten_with_path(results)[0]
        if jax.tree_util.keystr(path).endswith((".count", "['count']"))
    ]
    if not leaves or not counts or max(counts) <= 1:
        return None
    treedef = jax.tree_util.tree_structure(params)
    assert len(leaves) == treedef.num_leaves
    scale = max((float(np.max(np.abs(np.asarray(m)))) for m in leaves if np.asarray(m).size), default=0.0)

    def relative(m):
        dtype = np.asarray(m).dtype
        m = np.abs(np.asarray(m, np.float64))
        # |m| = 0: the noise mask's (it holds every |m| <= NOISE_K * eps * max|m|).
        out = np.where(m > 0, k * float(np.finfo(dtype).eps) * scale / np.where(m > 0, m, 1.0), 0.0)
        return out.astype(dtype)  # shaped and typed as the parameter it is compared beside

    return jax.tree_util.tree_unflatten(treedef, [relative(m) for m in leaves])


def first_moment_mask(results: PyTree, params: PyTree) -> PyTree | None:
    """The Adam noise mask of `params` from the first moment in `results` (its leaves in the
    parameters' order), or None where the step runs no Adam."""
    leaves = [x for path, x in jax.tree_util.tree_flatten_with_path(results)[0] if _moment(path) == "mu"]
    if not leaves:
        return None
    treedef = jax.tree_util.tree_structure(params)
    assert len(leaves) == treedef.num_leaves
    return adam_noise_mask(jax.tree_util.tree_unflatten(treedef, leaves))
