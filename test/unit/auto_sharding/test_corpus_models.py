"""The corpus' whole models (written by others), planned on 8 CPU devices, compute what one device computes.

Their weights are elided (`dense_resource<__elided__>`); the test materializes them so that both
runs see the same program with real values: small float tensors get seeded random values (a
splat would make LayerNorm divide rounding noise by sqrt(eps): AlphaFold then outputs chaos),
integer tensors zeros (they index tables), and large tensors a splat (the text stays small). Tolerance: these
are deep float32 networks (BERT has 12 layers) whose sharded dot products sum in another order:
differences of 1e-4 relative are rounding, not error.

AlphaFold takes its parameters as arguments. Drawn N(0, 1) they make it chaotic: its logits
reach 1e10, and perturbing the inputs by one ulp changes 5 of its 7 outputs by 2% to 60% on
one device, in float32 and in float64 alike, as much as sharding does. So its parameters are
drawn N(0, 0.05) and its features |N(0, 1)| (masks, counts are not negative): one ulp then
moves its outputs by at most 5e-5 relative, and every mesh matches one device within 1e-6.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from hlopar.codegen.spmd import compile_spmd
from hlopar.corpus import corpus_dir
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

MODELS = corpus_dir() / "models"
pytestmark = pytest.mark.corpus
ELIDED = re.compile(r"dense_resource<__elided__> : tensor<([^>]*)>")
FAST = {("jax_resnet_50", "2x4"), ("searchless_chess_9m", "4x2")}


RANDOM_LIMIT = 1 << 20  # elements; beyond it a splat keeps the text small
FLOATS = {"f32": np.float32, "f64": np.float64, "f16": np.float16}


def materialized(text: str) -> str:
    rng = np.random.default_rng(0)

    def value(match: re.Match) -> str:
        *dims, element = match.group(1).split("x")
        count = int(np.prod([int(d) for d in dims])) if dims else 1
        if element.startswith(("i", "ui")):
            return f"dense<0> : tensor<{match.group(1)}>"
        if element in FLOATS and count <= RANDOM_LIMIT:
            data = (rng.normal(0, 0.1, count)).astype(FLOATS[element]).astype("<" + np.dtype(FLOATS[element]).str[1:])
            return f'dense<"0x{data.tobytes().hex().upper()}"> : tensor<{match.group(1)}>'
        return f"dense<1.000000e-02> : tensor<{match.group(1)}>"

    return ELIDED.sub(value, text)


PARAMETER_SCALE = {"alphafold": 0.05}  # models whose parameters are arguments (see above)

def arguments(executable, seed: int, parameter_scale: float | None = None) -> list[np.ndarray]:
    """N(0, 1) floats and zero integers; with `parameter_scale`, the float arguments before
    the first other one (the parameters, ahead of an rng key) are scaled by it, and the
    later ones (features) are made non-negative."""
    rng = np.random.default_rng(seed)
    values = []
    in_parameters = True
    for shape, dtype in executable.input_types:
        if np.issubdtype(dtype, np.floating):
            value = rng.normal(0, 1, shape)
            if parameter_scale is not None:
                value = value * parameter_scale if in_parameters else np.abs(value)
            values.append(value.astype(dtype))
        else:
            in_parameters = False
            values.append(np.zeros(shape, dtype))  # indices: 0 is in range for every table
    return values


def cases():
    for name in ["jax_resnet_50", "pt_bert", "searchless_chess_9m", "searchless_chess_270m", "alphafold"]:
        for mesh in ["1x8", "2x4", "4x2", "8x1"]:
            marks = () if (name, mesh) in FAST else (pytest.mark.heavy,)
            yield pytest.param(name, mesh, marks=marks, id=f"{name}-{mesh}")


@pytest.mark.parametrize("name, mesh", list(cases()))
def test_planned_model_matches_one_device(name, mesh):
    text = materialized((MODELS / f"{name}.mlir").read_text())
    reference_module = parse_module(text, source_name=name)
    Pipeline.parse("builtin.module(hlopar-import)", reference_module.context).run(reference_module, PassContext())
    reference = compile_spmd(reference_module, jax.devices()[:1])
    planned_module = parse_module(text, source_name=name)
    zeros = ",".join("0" for _ in mesh.split("x"))
    pipeline = f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={mesh} latency={zeros}}})"
    Pipeline.parse(pipeline, planned_module.context).run(planned_module, PassContext())
    assert re.search(r'sdy.sharding_per_value<\[<@mesh, \[[^\]]*\{"[xy]"', print_module(planned_module)), "nothing is split"
    planned = compile_spmd(planned_module, jax.devices()[:8])
    args = arguments(reference, seed=0, parameter_scale=PARAMETER_SCALE.get(name))
    for expected, actual in zip(reference(*args), planned(*args)):
        scale = float(np.max(np.abs(expected))) if expected.size else 0.0
        np.testing.assert_allclose(actual, expected, rtol=1e-3, atol=1e-4 * scale + 1e-6)
