"""The zoo's tiny training steps with real arguments, and how close a microbatched run must come.

Tolerance (`numerics.assert_step_close`): parameter updates, Adam's moments and the loss to a
relative RTOL; updates whose gradient is rounding noise (the sum of microbatches adds it in
another order) are masked by the reference's first moment.
"""

from __future__ import annotations

import functools

from numerics import assert_step_close
from zoo_steps import tiny_step_data

from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

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
