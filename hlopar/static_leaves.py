"""Non-array leaves of a step's arguments and results, kept static as `eqx.filter_jit` keeps
them (`hlopar.parallelize`).

An Equinox model is passed whole: beside its arrays it holds activation functions, strings
(a BatchNorm's `axis_name`) and bools (`inference`). `jax.jit` refuses such leaves;
`eqx.filter_jit` traces the arrays and keeps every other leaf as a Python value, baked into
the program and part of its cache key. hlopar does the same, with jax.jit's rule for Python
numbers (traced, weakly typed: `TrainState.create`'s `step=0` and the int32 the step returns
are one signature):

- **dynamic** (traced, an argument of `@main`): arrays (anything with a shape and a dtype:
  jax and numpy arrays, numpy scalars, hlopar's `RemoteArray`) and Python ints, floats and
  complex numbers outside Equinox modules;
- **static**: every other leaf (functions, strings, bools, other objects, and Python numbers
  held by an Equinox module: `eqx.nn.MaxPool2d`'s `init = -inf`, which `eqx.filter_jit` keeps
  static and jax could not differentiate through a pool's init value), hashed into the
  call's signature as jax hashes static arguments; an unhashable one is refused with its
  pytree path. A result leaf that is not traced (the model's functions and strings coming
  back) is returned as the Python value the step returned.

The step is lowered with the static leaves replaced by `None` (an empty subtree, so that
every array keeps its pytree path, which names `@main`'s arguments and results).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

__all__ = ["StaticLeaves", "is_static", "static_mask"]

# fn -> {static leaves' key: (the callable jax lowers, its StaticResults)}: one callable per
# step and static leaves, so that jax's trace cache serves a second lowering of the step (as
# it serves `jax.jit(fn)` twice). A trace made anew would differ in its locations (they hold
# the caller's frames), and so would the plan cache's key, the program text.
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_static(leaf: Any) -> bool:
    """Whether a leaf stays a Python value (module docstring)."""
    if isinstance(leaf, bool):
        return True
    if isinstance(leaf, (jax.Array, np.ndarray, int, float, complex)):  # the common leaves first: every call asks
        return False
    return not (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _is_equinox_module(x: Any) -> bool:
    """Whether `x` is an `equinox.Module` (found by its classes: equinox is not a dependency)."""
    return _is_equinox_class(type(x))


@functools.cache
def _is_equinox_class(cls: type) -> bool:
    # Per class, once: asked of every node of the arguments' pytree on every call.
    return any(c.__name__ == "Module" and c.__module__.startswith("equinox") for c in cls.__mro__)


def static_mask(tree: Any) -> list[bool]:
    """Per leaf of `tree` (in `tree_flatten`'s order), whether it stays a Python value: the
    leaves of an Equinox module by `eqx.filter_jit`'s rule (only arrays traced), the others
    by `is_static`."""
    mask: list[bool] = []
    for piece in jax.tree_util.tree_leaves(tree, is_leaf=_is_equinox_module):
        if _is_equinox_module(piece):
            mask += [isinstance(x, (int, float, complex)) or is_static(x) for x in jax.tree_util.tree_leaves(piece)]
        else:
            mask.append(is_static(piece))
    return mask


@dataclass(frozen=True)
class StaticLeaves:
    """A call's arguments split into traced leaves and static ones: `key` is what the
    signature holds of the static ones (their leaf numbers and values)."""

    treedef: Any
    static: dict[int, Any]  # leaf number -> value
    dynamic: tuple  # the arguments with every static leaf replaced by None
    key: tuple

    @staticmethod
    def of(args: tuple, name: str) -> StaticLeaves:
        """Splits `args`; an unhashable static leaf is refused naming its path (`name`: the
        step's, for the message)."""
        flat, treedef = jax.tree_util.tree_flatten(args)  # every call: paths only for a message
        static = {i: leaf for i, (leaf, fixed) in enumerate(zip(flat, static_mask(args), strict=True)) if fixed}
        for i, leaf in static.items():
            try:
                hash(leaf)
            except TypeError as error:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(args)[0][i][0])
                raise TypeError(
                    f"{name}'s argument {path} is a {type(leaf).__name__}, not an array: hlopar keeps such "
                    "leaves static, as eqx.filter_jit does, which needs them hashable "
                    f"({error}); make it an array, or a hashable value"
                ) from None
        dynamic = jax.tree_util.tree_unflatten(treedef, [None if i in static else x for i, x in enumerate(flat)])
        key = (treedef, tuple((i, type(v), v) for i, v in static.items()))
        return StaticLeaves(treedef, static, tuple(dynamic), key)

    def leaves(self) -> list:
        """The traced leaves, in order: `@main`'s arguments."""
        return jax.tree_util.tree_leaves(self.dynamic)

    def paths(self) -> list[str]:
        """Per traced leaf, its path in the arguments (`[0]['w']`), for messages."""
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.dynamic)[0]]

    def positions(self) -> list[int]:
        """Per traced leaf, the positional argument it is in."""
        return [i for i, arg in enumerate(self.dynamic) for _ in jax.tree_util.tree_leaves(arg)]

    def traced(self, fn: Callable) -> tuple[Callable, StaticResults]:
        """`fn` as jax lowers it here: it takes `dynamic` (the static leaves put back at trace
        time) and returns its results with their static leaves replaced by None, which the
        returned `StaticResults` puts back. Named and signed as `fn` (`functools.wraps`), so
        that jax names `@main`'s arguments by `fn`'s parameters. The same callable for the
        same `fn` and static leaves (`_TRACED`)."""
        try:
            known = _TRACED.setdefault(fn, {})
        except TypeError:  # not weakly referable or not hashable: traced anew
            known = {}
        if self.key not in known:
            known[self.key] = self._traced(fn)
        return known[self.key]

    def _traced(self, fn: Callable) -> tuple[Callable, StaticResults]:
        results = StaticResults()
        static, treedef = self.static, self.treedef

        @functools.wraps(fn)
        def step(*dynamic):
            traced = iter(jax.tree_util.tree_leaves(dynamic))
            args = [static[i] if i in static else next(traced) for i in range(treedef.num_leaves)]
            out = fn(*jax.tree_util.tree_unflatten(treedef, args))
            leaves, results.treedef = jax.tree_util.tree_flatten(out)
            results.static = {k: x for k, (x, fixed) in enumerate(zip(leaves, static_mask(out), strict=True)) if fixed}
            return jax.tree_util.tree_unflatten(
                results.treedef, [None if k in results.static else x for k, x in enumerate(leaves)]
            )

        return step, results


@dataclass
class StaticResults:
    """The static leaves of a step's results, found when it is traced (`StaticLeaves.traced`)."""

    treedef: Any = None
    static: dict[int, Any] = field(default_factory=dict)
    # The step was lowered returning `(its results, its loss)` (`step_loss.returning_loss`):
    # the loss is dropped from what a call returns.
    loss_added: bool = False

    def rebuild(self, leaves: list, traced_tree: Any) -> Any:
        """The step's results from its traced result leaves (`traced_tree`: their pytree, as
        jax returned it): the loss hlopar added dropped, the static leaves put back."""
        if self.loss_added:
            leaves, traced_tree = list(leaves)[:-1], traced_tree.children()[0]
        if not self.static:
            return jax.tree_util.tree_unflatten(traced_tree, leaves)
        traced = iter(leaves)
        return jax.tree_util.tree_unflatten(
            self.treedef, [self.static[k] if k in self.static else next(traced) for k in range(self.treedef.num_leaves)]
        )
