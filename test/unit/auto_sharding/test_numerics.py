"""Annotated training steps compiled by stock jaxlib on 8 CPU devices compute what one device computes.

Tolerances: the loss and Adam's moments must match closely. Parameters are compared to
within Adam's step bound (learning rate) plus a relative term: where a gradient is exactly
zero in exact arithmetic (the key bias of attention, softmax is invariant to it), both runs
hold rounding noise of a different order of summation, and Adam normalizes that noise to a
step of up to `lr` either way.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.module import parse_module, print_module
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

MODELS = ["mlp", "gpt", "moe", "wide_resnet", "u_transformer"]
MESHES = ["1x8", "2x4", "4x2", "8x1"]
FAST = {("mlp", "2x4"), ("gpt", "4x2")}


def cases():
    for model in MODELS:
        for mesh in MESHES:
            marks = () if (model, mesh) in FAST else (pytest.mark.heavy,)
            yield pytest.param(model, mesh, marks=marks, id=f"{model}-{mesh}")


@pytest.mark.parametrize("model, mesh", list(cases()))
def test_sharded_step_matches_one_device(model, mesh):
    step = get_train_step(model, "tiny")
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    reference = jax.tree_util.tree_flatten_with_path(step.jitted_step(params, state, batch))[0]

    module = parse_module(step.lower())
    # No latency: on tiny models, latency would make replication optimal and test nothing.
    zeros = ",".join("0" for _ in mesh.split("x"))
    pipeline = f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={mesh} latency={zeros}}})"
    Pipeline.parse(pipeline, module.context).run(module, PassContext())
    text = print_module(module)
    assert '{"x"' in text or '{"y"' in text, "the plan shards nothing: the test would prove nothing"

    outputs = compile_spmd(module, jax.devices()[:8])(*jax.tree_util.tree_leaves((params, state, batch)))
    lr = step.optimizer.learning_rate
    for (path, expected), actual in zip(reference, outputs):
        name = jax.tree_util.keystr(path)
        expected = np.asarray(expected)
        if name.startswith("[0]"):  # parameters after the Adam step
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=2 * lr, err_msg=name)
        else:  # optimizer state and loss
            scale = float(np.max(np.abs(expected))) if expected.size else 0.0
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale + 1e-12, err_msg=name)
