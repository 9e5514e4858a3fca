"""A step split into B microbatches, run slice by slice with gradients accumulated in donated
buffers and the update once on the sums, computes what the whole step computes on one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from microbatch_steps import compare, run_pipeline, step_data
from oracles.microbatched import MicrobatchedStep, run_microbatched

from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.module import parse_module

MODELS = ["mlp", "gpt", "u_transformer"]


@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_microbatched_step_matches_one_device(model, microbatches):
    text, arguments, *_ = step_data(model)
    step = MicrobatchedStep(run_pipeline(text, f"hlopar-split-microbatches{{microbatches={microbatches}}}"))
    assert step.microbatches == microbatches
    # The loss's sum and the gradients cross the cut; the optimizer's ops are after it.
    assert step.split.num_sums > 1
    compare(model, step(arguments))


def test_split_here_when_given_a_plain_step():
    text, arguments, *_ = step_data("mlp")
    compare("mlp", run_microbatched(parse_module(text), arguments, 4))


def test_functions_form_is_the_whole_step():
    """functions=true: @main slices, calls @microbatch_step per slice, adds, calls @apply_update."""
    text, arguments, *_ = step_data("gpt")
    module = run_pipeline(text, "hlopar-split-microbatches{microbatches=2 functions=true}")
    compare("gpt", compile_spmd(module, jax.devices()[:1])(*arguments))


def test_wrong_batch_is_refused():
    text, arguments, *_ = step_data("mlp")
    step = MicrobatchedStep(run_pipeline(text, "hlopar-split-microbatches{microbatches=2}"))
    bad = list(arguments)
    bad[-1] = np.concatenate([bad[-1], bad[-1]])
    with pytest.raises(ValueError, match="2 microbatches of"):
        step(bad)
