"""hlopar-split-microbatches on the zoo's steps: what it resizes, the kinds it writes, and
the steps it refuses (losses that are not sums or means over the batch). Batch statistics are
split per microbatch since issue 13 (`test_random_and_statistics.py`)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from microbatch_steps import RTOL, imported, run_pipeline, step_data
from numerics import assert_step_close
from oracles.microbatched import MicrobatchedStep

from hlopar.dialect.attributes import BATCH, KIND_ATTR, STEP, SUM
from hlopar.dialect.split import op_kinds, read_split
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.models import mlp
from hlopar.models.common import TrainStep


def kinds_of_values(graph: FuncGraph, batch_args) -> dict[int, str | None]:
    kinds = op_kinds(graph)
    found = {a: (BATCH if i in batch_args else None) for i, a in enumerate(graph.args)}
    for op, kind in zip(graph.ops, kinds):
        for v in op.results:
            found[v] = kind
    return found


@pytest.mark.parametrize("model", ["mlp", "gpt", "u_transformer"])
def test_split_keeps_the_contract(model, tmp_path):
    text = step_data(model)[0]
    report = tmp_path / "split.json"
    module = run_pipeline(text, f"hlopar-split-microbatches{{microbatches=4 report={report}}}")
    main = FuncGraph.from_module(module)
    before = FuncGraph.from_module(run_pipeline(text, "canonicalize"))
    b, batch_args = read_split(main.mlir_func)
    assert b == 4 and batch_args == tuple(range(len(main.args) - 2, len(main.args)))  # the batch dict's leaves
    found = json.loads(report.read_text())
    assert found["batch_args"] == list(batch_args) and found["resized_values"] > 0
    # Batch arguments are a quarter; the other arguments and all results are unchanged.
    for i, (new, old) in enumerate(zip(main.args, before.args)):
        new_shape, old_shape = main.values[new].shape, before.values[old].shape
        assert new_shape == ((old_shape[0] // 4, *old_shape[1:]) if i in batch_args else old_shape)
    assert [main.values[v].type for v in main.results] == [before.values[v].type for v in before.results]
    # No op reads per-example values together with sums or step values; the loss is a sum.
    kind = kinds_of_values(main, batch_args)
    for op in main.ops:
        read = {kind[v] for v in op.operands}
        assert not (BATCH in read and read & {SUM, STEP}), op
    assert kind[main.results[found["loss_result"]]] == SUM
    assert all(kind[v] != BATCH for v in main.results)
    assert sum(1 for op in main.ops if KIND_ATTR in op.mlir_op.attributes) == sum(
        found["ops"][k] for k in (BATCH, SUM, STEP)
    )


def custom_mlp_step(loss) -> TrainStep:
    """The tiny MLP with another loss of its predictions and targets."""
    config = mlp.MLP_CONFIGS["tiny"]

    def loss_fn(params, batch):
        pred = mlp.forward(config, params, batch["x"])
        return loss(pred, batch["y"])

    return TrainStep(
        "mlp-custom", config, mlp.param_specs(config), loss_fn, jax.jit(lambda rng: mlp.make_batch(config, rng))
    )


def split_error(step: TrainStep, microbatches: int = 2) -> str:
    with pytest.raises(DiagnosticError) as error:
        run_pipeline(imported(step.lower()), f"hlopar-split-microbatches{{microbatches={microbatches}}}")
    return str(error.value)


@pytest.mark.parametrize(
    "loss, culprit",
    [
        (lambda p, y: jnp.log(jnp.mean(jnp.square(p - y))), "stablehlo.log"),
        (lambda p, y: jnp.mean(jnp.square(p - y)) ** 2, "stablehlo.multiply"),
        (lambda p, y: jnp.sqrt(jnp.sum(jnp.square(p - y))), "stablehlo.sqrt"),
    ],
)
def test_losses_that_are_not_sums_are_refused(loss, culprit):
    message = split_error(custom_mlp_step(loss))
    assert "the loss (result 19) is not a sum or a mean over the batch" in message
    assert f"'{culprit}' is not linear in the sums over the batch" in message


@pytest.mark.parametrize(
    "loss",
    [
        lambda p, y: jnp.sum(jnp.square(p - y)),  # a sum
        lambda p, y: 3.0 * jnp.mean(jnp.abs(p - y)) - jnp.mean(p),  # linear in means
    ],
)
def test_sums_and_means_are_accepted(loss):
    """Accepted, and the step split into 4 microbatches computes what the whole step computes."""
    step = custom_mlp_step(loss)
    split = MicrobatchedStep(run_pipeline(imported(step.lower()), "hlopar-split-microbatches{microbatches=4}"))
    assert split.microbatches == 4
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    outputs = split([np.asarray(a) for a in jax.tree_util.tree_leaves((params, state, batch))])
    assert_step_close(outputs, step.jitted_step(params, state, batch), params, rtol=RTOL)


def test_batch_that_does_not_divide_is_refused():
    message = split_error(custom_mlp_step(lambda p, y: jnp.mean(jnp.square(p - y))), microbatches=3)
    assert "has leading dim 8, not divisible by 3 microbatches" in message
