"""The zoo's tiny training steps with real arguments, and how close a microbatched run must come.

Tolerance (`numerics.assert_step_close`): parameter updates, Adam's moments and the loss to a
relative RTOL; updates whose gradient is rounding noise (the sum of microbatches adds it in
another order) are masked by the reference's first moment.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from numerics import assert_step_close
from oracles.microbatched import MicrobatchedStep
from zoo_steps import tiny_step_data

from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.passes.split_microbatches import SplitMicrobatchesPass

RTOL = 1e-5


@functools.cache
def step_data(model: str):
    """(imported StableHLO text, flat arguments, parameters, one device's ``(params, state, loss)``)."""
    text, arguments, params, reference = tiny_step_data(model)
    return imported(text), arguments, params, reference


def imported(text: str) -> str:
    module = parse_module(text)
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    return print_module(module)


def run_pipeline(text: str, pipeline: str):
    module = parse_module(text)
    Pipeline.parse(f"builtin.module({pipeline})", module.context).run(module, PassContext())
    return module


def compare(model: str, outputs, *, rtol: float = RTOL) -> None:
    _, _, params, reference = step_data(model)
    assert_step_close(outputs, reference, params, rtol=rtol)


def split_jax_step(step, args, microbatches: int, **options):
    """`step` lowered on `args` (with its source lines), imported and split into
    `microbatches`; returns the module and the pass's warnings."""
    module = parse_module(jax.jit(step).lower(*args).as_text(debug_info=True))
    context = PassContext()
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, context)
    SplitMicrobatchesPass(microbatches=microbatches, **options).run(module, context)
    return module, [d.message for d in context.diagnostics]


def run_split(module, args) -> list[np.ndarray]:
    """A split step run over its microbatches by the oracle, on the whole batch's `args`."""
    return [np.asarray(x) for x in MicrobatchedStep(module)(jax.tree_util.tree_leaves(args))]


def assert_leaves_close(actual, expected, rtol: float) -> None:
    """Same leaves, shapes and dtypes; values to `rtol` of each entry plus `rtol` of the
    leaf's largest magnitude (sums in another order: their error is relative to the
    largest terms)."""
    expected = [np.asarray(x) for x in jax.tree_util.tree_leaves(expected)]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        a = np.asarray(a)
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)
