"""The loss of a step that does not return it, found in jax's trace (`hlopar.parallelize`).

A step such as `return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))` (a VAE
example's, Equinox's stateful example's) takes gradients of a scalar it drops: jax's
lowering removes the dead value, so `@main` has no loss for the planner to start from
(`analysis.step_io`), and the step would be planned forward-only. jax's trace still holds it:
the primal output of the differentiated function, computed under a `jvp(...)` name stack
and read by nothing (its cotangent, the `1.0` that seeds the transposed backward, is a
literal). `unreturned_loss` finds it, and `returning_loss` is the step that also returns it
(its last result), which the planner then finds as any returned loss; `parallelize` drops it
from what the call returns.

Rules: a step returning a scalar computed under `jvp(` (a `value_and_grad` loss or one of
its aux metrics) returns its loss: nothing is found. Otherwise, with a backward
(`transpose(` in some name stack), the candidates are the top-level rank-0 floating values
computed under `jvp(` (not `transpose(`) that nothing reads; of several (metrics of a
`has_aux` loss dropped beside it) the one computed from the most equations, the whole
forward pass being upstream of the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, Var

__all__ = ["returning_loss", "unreturned_loss"]


def _forward_scalar(eqn, var) -> bool:
    name = str(eqn.source_info.name_stack)
    aval = var.aval
    return (
        "jvp(" in name
        and "transpose(" not in name
        and getattr(aval, "shape", None) == ()
        and jnp.issubdtype(aval.dtype, jnp.floating)
    )


def unreturned_loss(closed: ClosedJaxpr) -> Var | None:
    """The dropped loss of a step's trace, or None (module docstring)."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    if not any("transpose(" in str(e.source_info.name_stack) for e in eqns):
        return None
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars}
    returned = {v for v in jaxpr.outvars if isinstance(v, Var)}
    if any(v in producer and _forward_scalar(eqns[producer[v]], v) for v in returned):
        return None
    read = returned | {v for e in eqns for v in e.invars if not isinstance(v, Literal)}
    candidates = [v for e in eqns for v in e.outvars if v not in read and _forward_scalar(e, v)]
    if not candidates:
        return None

    def upstream(var: Var) -> int:
        seen, stack = set(), [producer[var]]
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            stack += [producer[v] for v in eqns[k].invars if not isinstance(v, Literal) and v in producer]
        return len(seen)

    return max(candidates, key=lambda v: (upstream(v), producer[v]))


def returning_loss(fn: Callable, closed: ClosedJaxpr, loss: Var, out_tree: Any) -> Callable:
    """`fn` (whose trace is `closed`, its results of pytree `out_tree`) returning `(its
    results, loss)`: the trace evaluated again, each equation at its source line and name
    stack, so that `@main` keeps the user's locations. Signed as `fn`."""
    debug = closed.jaxpr.debug_info
    if debug.result_paths is not None:
        debug = debug._replace(result_paths=(*debug.result_paths, "loss"))
    jaxpr = closed.jaxpr.replace(outvars=[*closed.jaxpr.outvars, loss], debug_info=debug)

    @functools.wraps(fn)
    def step(*args):
        out = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(out_tree, out[:-1]), out[-1]

    return step
