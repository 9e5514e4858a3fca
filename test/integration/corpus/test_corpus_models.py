"""The corpus' whole models (written by others), planned on 8 CPU devices, compute what one device computes.

Every tensor gets random values, so that a shard in the wrong place shows: the elided weights
(`dense_resource<__elided__>`) are materialized as seeded N(0, 0.1) constants, whatever their size
(a splat, equal everywhere, would hide a wrong shard order), the float arguments N(0, 1), and the
integer arguments uniform in the range of the table they index (`INDEX_BOUNDS`, read off each
model's gathers). Tolerance per model (`RTOL`, relative to each entry and to its output's largest
entry): a little above what is measured; deep float32 networks whose sharded dot products sum
in another order.

AlphaFold takes its parameters as arguments. Drawn N(0, 1) they make it chaotic: its logits
reach 1e10, and perturbing the inputs by one ulp changes 5 of its 7 outputs by 2% to 60% on
one device, in float32 and in float64 alike, as much as sharding does. So its parameters are
drawn N(0, 0.05) and its features |N(0, 1)| (masks, counts are not negative): one ulp then
moves its outputs by at most 5e-5 relative, and every mesh matches one device within 1e-6.
Its integer features and elided integer tables stay zero (always in range); random ones have
not been tried (its cases are heavy, 700 s each on 2 cores).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from numerics import assert_trees_close

from hlopar.codegen.spmd import compile_spmd
from hlopar.corpus import corpus_dir
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

MODELS = corpus_dir() / "models"
pytestmark = pytest.mark.corpus
ELIDED = re.compile(r"dense_resource<__elided__> : tensor<([^>]*)>")
FAST = {("jax_resnet_50", "2x4"), ("searchless_chess_9m", "4x2")}
# Measured with these inputs: ResNet-50 2x4 bit-exact, Searchless Chess 9M 4x2 5e-5; of the heavy
# ones only 2x4 was re-run (BERT 1e-4, Searchless Chess 270M 5e-5), so they keep 1e-3 until their
# other meshes are measured; AlphaFold 1e-6 (above).
RTOL = {
    "jax_resnet_50": 1e-6,
    "searchless_chess_9m": 1e-4,
    "pt_bert": 1e-3,
    "searchless_chess_270m": 1e-3,
    "alphafold": 1e-6,
}


FLOATS = {"f32": np.float32, "f64": np.float64, "f16": np.float16}


def materialized(text: str) -> str:
    rng = np.random.default_rng(0)

    def value(match: re.Match) -> str:
        *dims, element = match.group(1).split("x")
        count = int(np.prod([int(d) for d in dims])) if dims else 1
        if element.startswith(("i", "ui")):
            return f"dense<0> : tensor<{match.group(1)}>"
        if element not in FLOATS:
            raise ValueError(f"no values for elided {match.group(0)}")
        data = rng.normal(0, 0.1, count).astype(FLOATS[element]).astype("<" + np.dtype(FLOATS[element]).str[1:])
        return f'dense<"0x{data.tobytes().hex().upper()}"> : tensor<{match.group(1)}>'

    return ELIDED.sub(value, text)


PARAMETER_SCALE = {"alphafold": 0.05}  # models whose parameters are arguments (see above)
# Per model, argument index -> the size of what it indexes (its random values are in [0, size)).
INDEX_BOUNDS = {
    "pt_bert": {199: 512, 200: 30522, 201: 2, 202: 2},  # position ids, token ids, token types, mask
    "searchless_chess_9m": {94: 1968},  # board tokens into the 1968-row embedding
    "searchless_chess_270m": {182: 1968},
}


def arguments(name: str, executable, seed: int) -> list[np.ndarray]:
    """N(0, 1) floats and in-range random integers (`INDEX_BOUNDS`, zero for a model without
    bounds); for a model in `PARAMETER_SCALE`, the float arguments before the first other one
    (the parameters, ahead of an rng key) are scaled by it and the later ones (features) made
    non-negative."""
    rng = np.random.default_rng(seed)
    scale, bounds = PARAMETER_SCALE.get(name), INDEX_BOUNDS.get(name, {})
    values = []
    in_parameters = True
    for index, (shape, dtype) in enumerate(executable.input_types):
        if np.issubdtype(dtype, np.floating):
            value = rng.normal(0, 1, shape)
            if scale is not None:
                value = value * scale if in_parameters else np.abs(value)
            values.append(value.astype(dtype))
        else:
            in_parameters = False
            values.append(rng.integers(0, bounds.get(index, 1), shape).astype(dtype))
    if name in INDEX_BOUNDS:
        integer = {i for i, (_, dtype) in enumerate(executable.input_types) if not np.issubdtype(dtype, np.floating)}
        assert integer == set(bounds), f"{name}: integer arguments {sorted(integer)}, bounds for {sorted(bounds)}"
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
    assert re.search(r'sdy.sharding_per_value<\[<@mesh, \[[^\]]*\{"[xy]"', print_module(planned_module)), (
        "nothing is split"
    )
    planned = compile_spmd(planned_module, jax.devices()[:8])
    args = arguments(name, reference, seed=0)
    assert_trees_close(list(planned(*args)), list(reference(*args)), rtol=RTOL[name], max_rtol=RTOL[name])
