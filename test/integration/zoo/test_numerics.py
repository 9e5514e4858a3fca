"""Annotated training steps compiled by stock jaxlib on 8 CPU devices compute what one device computes.

Tolerances (`numerics.assert_step_close`): parameter updates, Adam's moments and the loss to a
relative RTOL = 1e-5 (measured on the default cases: MLP 2e-7, GPT 1e-6, MoE 5e-7, Wide-ResNet 5e-6,
U-Transformer 1e-6); updates whose gradient is rounding noise are masked by the reference's first
moment. The default suite runs one mesh of each model family; `-m heavy` the others.
"""

from __future__ import annotations

import jax
import pytest
from numerics import assert_step_close

from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.module import parse_module, print_module
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

MODELS = ["mlp", "gpt", "moe", "wide_resnet", "u_transformer"]
MESHES = ["1x8", "2x4", "4x2", "8x1"]
FAST = {("mlp", "2x4"), ("gpt", "4x2"), ("moe", "2x4"), ("wide_resnet", "4x2"), ("u_transformer", "2x4")}
RTOL = 1e-5


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
    reference = step.jitted_step(params, state, batch)

    module = parse_module(step.lower())
    # No latency: on tiny models, latency would make replication optimal and test nothing.
    zeros = ",".join("0" for _ in mesh.split("x"))
    pipeline = f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={mesh} latency={zeros}}})"
    Pipeline.parse(pipeline, module.context).run(module, PassContext())
    text = print_module(module)
    assert '{"x"' in text or '{"y"' in text, "the plan shards nothing: the test would prove nothing"

    outputs = compile_spmd(module, jax.devices()[:8])(*jax.tree_util.tree_leaves((params, state, batch)))
    assert_step_close(outputs, reference, params, rtol=RTOL)
