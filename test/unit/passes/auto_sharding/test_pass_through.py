"""`jax.checkpoint`'s optimization barrier passes its operands through: a checkpointed model
is planned (sharded, and split into microbatches) as its unchecked twin and computes what
one device computes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_trees_close
from oracles.microbatched import run_microbatched
from zoo_steps import mlp_step

from hlopar.analysis.auto_sharding.rules import OpRule, pass_through_rule
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

WIDTH, BATCH, LAYERS = 64, 32, 4


def _layer(w, h):
    return jnp.tanh(h @ w)


def _step(checkpointed: bool):
    return mlp_step(_layer, checkpointed)


def _args():
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS + 2)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[:LAYERS]]
    return ws, jax.random.normal(keys[-2], (BATCH, WIDTH)), jax.random.normal(keys[-1], (BATCH, WIDTH))


def _planned(checkpointed: bool, merge: bool = False):
    module = parse_module(jax.jit(_step(checkpointed)).lower(*_args()).as_text())
    context = PassContext()
    Pipeline.parse(
        f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape=2x4 latency=0,0 merge={str(merge).lower()}}})",
        module.context,
    ).run(module, context)
    return module, context


def _signature_shardings(text: str) -> list[str]:
    """The shardings of @main's arguments and results, in order."""
    signature = re.search(r"func\.func public @main\((.*?)\) -> \((.*?)\) \{", text, re.S)
    return re.findall(r"#sdy\.sharding<@\w+, \[.*?\]>", signature.group(1) + signature.group(2))


def test_checkpointed_model_is_planned_as_its_unchecked_twin():
    # Merged (Alpa §4.2), the recomputed forward ops follow the ops they copy. The program's
    # optimum may differ: the copies are ops of their own, which change the weights' costs.
    checked, context = _planned(True, merge=True)
    twin, _ = _planned(False, merge=True)
    text = print_module(checked)
    assert text.count("stablehlo.optimization_barrier") == LAYERS  # one per rematerialized layer
    assert [d for d in context.diagnostics if "optimization_barrier" in d.message] == []
    layouts, twin_layouts = _signature_shardings(text), _signature_shardings(print_module(twin))
    assert len(layouts) == len(twin_layouts) == 2 * LAYERS + 3  # weights, x, y; new weights, loss
    # Weights and new weights as in the twin, every one sharded. (The batch's layout may differ:
    # the recomputed forward changes what the activations cost.)
    weights = layouts[:LAYERS] + layouts[LAYERS + 2 : -1]
    assert weights == twin_layouts[:LAYERS] + twin_layouts[LAYERS + 2 : -1]
    assert all('"' in layout for layout in weights)


def test_checkpointed_model_computes_what_one_device_computes():
    module, _ = _planned(True)
    args = _args()
    reference = jax.jit(_step(True))(*args)
    outputs = compile_spmd(module, jax.devices()[:8])(*jax.tree_util.tree_leaves(args))
    # Sums of 64-term products regrouped across devices: float32 rounding, a few ulps.
    assert_trees_close(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(reference), list(outputs)),
        reference,
        rtol=1e-6,
        atol=1e-7,
    )


def test_checkpointed_model_splits_into_microbatches():
    """The barrier's per-example operands stay per microbatch, its weights independent of
    the batch: 4 microbatches accumulate to the whole batch's step."""
    args = _args()
    reference = jax.jit(_step(True))(*args)
    module = parse_module(jax.jit(_step(True)).lower(*args).as_text())
    outputs = run_microbatched(module, jax.tree_util.tree_leaves(args), 4)
    # The loss and gradients summed over 4 microbatches instead of in one reduction: rounding.
    assert_trees_close(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(reference), list(outputs)),
        reference,
        rtol=1e-6,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    "shapes, expected",
    [
        ([[4, 8], [3]], OpRule((4, 8, 3), (((0,), (1,)), ((2,),)), (((0,), (1,)), ((2,),)))),
        ([[]], OpRule((), ((),), ((),))),
        ([[2], None], None),  # a token: no rule can describe it
    ],
)
def test_pass_through_rule_ties_each_result_to_its_operand(shapes, expected):
    assert pass_through_rule(shapes) == expected
