"""Per-example outputs (predictions returned as `has_aux` output, per-example losses) under
several microbatches come back for the whole batch, rows in the original order, equal to one
device: concatenated along their batch dim (`passes.per_example_results`).

The steps: the zoo's tiny MLP with Adam, returning its predictions [batch, out] beside the
loss (`jax.value_and_grad(..., has_aux=True)`), or the per-example losses [batch] and the
predictions transposed [out, batch] (the batch in dim 1). Every row of the batch differs, so
a row out of place fails. Tolerances as `numerics` and the Ray runtime's tests: the training
state by update to 1e-5; per-example outputs to 1e-5 of each entry plus 1e-5 of the leaf's
largest (each microbatch's matmul rounds on its own shapes: measured 1.2e-7 absolute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxlib.mlir import ir
from numerics import assert_step_close, assert_trees_close
from oracles.microbatched import MicrobatchedStep

import hlopar
from hlopar.codegen.executables import accumulating_module, compile_executable
from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.dialect.attributes import KIND_ATTR, PER_EXAMPLE_ATTR, SUM
from hlopar.dialect.split import split_step
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module
from hlopar.models import get_train_step, mlp
from hlopar.models.adam import adam_update
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.runtime.local_executor import PipelinedStep

MODEL = get_train_step("mlp", "tiny")
CONFIG = MODEL.config
RTOL = 1e-5
CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")
# Memory per device so small that one stage does not fit: the tiny MLP pipelines.
TWO_STAGES = (
    "hlopar-cluster-operators{layers=2},hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 "
    "workers=1 memory-per-device=4KiB}"
)


def _adam(grads, state, params):
    opt = MODEL.optimizer
    return adam_update(grads, state, params, lr=opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps)


def aux_step(params, state, batch):
    """(loss, logits) by has_aux: the logits [batch, out] come back beside the update."""

    def loss_fn(p):
        logits = mlp.forward(CONFIG, p, batch["x"])
        return jnp.mean(jnp.square(logits - batch["y"])), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return *_adam(grads, state, params), loss, logits


def per_example_step(params, state, batch):
    """The mean of per-example losses trains; it comes back with the per-example losses
    [batch], the predictions transposed [out, batch] and each example's best output (int32)."""

    def loss_fn(p):
        pred = mlp.forward(CONFIG, p, batch["x"])
        return jnp.mean(jnp.square(pred - batch["y"]), axis=1), pred

    def mean_loss(p):
        losses, pred = loss_fn(p)
        return jnp.mean(losses), (losses, pred)

    (loss, (losses, pred)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    return (
        *_adam(grads, state, params),
        loss,
        {"losses": losses, "pred_t": pred.T, "best": jnp.argmax(pred, axis=1).astype(jnp.int32)},
    )


def folded_step(params, state, batch):
    """Predictions with the batch folded into two dims: no concatenation gives them."""
    *trained, logits = aux_step(params, state, batch)
    return *trained, {"folded": logits.reshape(2, -1)}


STEPS = {"aux": aux_step, "per_example": per_example_step}


def _args():
    params = MODEL.init(jax.random.PRNGKey(0))
    return params, MODEL.init_opt_state(params), MODEL.make_batch(jax.random.PRNGKey(1))


def _check(step, outputs, args) -> None:
    """`outputs` (flat leaves or the step's pytree: parameters, Adam's state, the loss, the
    per-example outputs) against one device's step."""
    expected = jax.jit(step)(*args)
    leaves = jax.tree_util.tree_leaves(outputs)
    training = len(jax.tree_util.tree_leaves(expected[:3]))
    assert_step_close(leaves[:training], expected[:3], args[0], rtol=RTOL)
    per_example = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(expected[3]), leaves[training:])
    assert_trees_close(per_example, expected[3], rtol=RTOL, max_rtol=RTOL)


def _split(step, microbatches: int):
    args = _args()
    module = parse_module(jax.jit(step).lower(*args).as_text(debug_info=True))
    context = PassContext()
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, context)
    SplitMicrobatchesPass(microbatches=microbatches).run(module, context)
    return module, args


# --------------------------------------------------------------------------- the split and codegen


def test_the_split_places_the_rows_in_the_whole_batch():
    """The results keep the whole batch's type: `sum`s of each microbatch's rows placed in
    zeros along their batch dim (dim 1 for the transposed predictions), made per microbatch."""
    module, _ = _split(per_example_step, 4)
    graph = FuncGraph.from_module(module)
    placed = [
        (tuple(op.mlir_op.results[0].type.shape), ir.IntegerAttr(op.mlir_op.attributes[PER_EXAMPLE_ATTR]).value)
        for op in graph.ops
        if PER_EXAMPLE_ATTR in op.mlir_op.attributes
    ]
    assert sorted(placed) == [((4, 8), 1), ((8,), 0), ((8,), 0)]  # losses, best [batch]; predictions
    assert all(
        str(op.mlir_op.attributes[KIND_ATTR]) == f'"{SUM}"'
        for op in graph.ops
        if PER_EXAMPLE_ATTR in op.mlir_op.attributes
    )
    returned = {graph.values[v].producer for v in graph.results[-3:]}
    assert {graph.ops[i].name for i in returned} == {"stablehlo.dynamic_update_slice"}
    split = split_step(module)  # the contract's cut: the placements are among the sums
    assert set(range(len(graph.results) - 3, len(graph.results))) <= {
        graph.results.index(v) for v in split.microbatch.outputs if v in graph.results
    }


def test_accumulation_writes_the_rows_in_place():
    """codegen's piece: the accumulating executable writes microbatch k's rows into the
    donated accumulator (it does not add a whole batch of zeros): rows k of an accumulator
    holding ones come back as the microbatch's values, the other rows keep their ones, and
    the four microbatches' results in turn make the whole batch's."""
    module, args = _split(aux_step, 4)
    split = split_step(module)
    position = len(split.microbatch.outputs) - 1
    assert PER_EXAMPLE_ATTR in str(split.microbatch.module)
    accumulating = accumulating_module(split.microbatch.module, [position])
    text = str(accumulating)
    assert "stablehlo.dynamic_update_slice %arg0," in text and "tf.aliasing_output" in text
    executable = compile_executable(accumulating, jax.devices()[:1])
    assert executable.donated == frozenset({0})
    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(args)]
    leaves.append(np.arange(4, dtype=np.int32))  # the microbatch index the split added
    rows = 2
    expected = np.asarray(jax.jit(aux_step)(*args)[-1])
    whole = np.zeros_like(expected)
    for k in range(4):
        inputs = [
            leaves[i][k * split.argument_shapes[i][0] : (k + 1) * split.argument_shapes[i][0]]
            if i in split.batch_args
            else leaves[i]
            for i in split.microbatch_args
        ]
        ones = np.ones_like(expected)
        placed = np.asarray(executable.run([ones] + inputs)[position])
        mine = slice(k * rows, (k + 1) * rows)
        assert np.all(np.delete(placed, np.s_[mine], axis=0) == 1.0)
        whole[mine] = placed[mine]
    assert_trees_close(whole, expected, rtol=RTOL, max_rtol=RTOL)


def test_a_batch_folded_into_two_dims_is_refused_by_name():
    with pytest.raises(DiagnosticError) as error:
        _split(folded_step, 4)
    message = str(error.value)
    assert "(result[3]['folded']) of @main carries the batch spread over several dims (2, 2)" in message
    assert "cannot be concatenated along one" in message


# --------------------------------------------------------------------------- the in-process executors


@pytest.mark.parametrize("name", list(STEPS))
def test_microbatched_step(name):
    module, args = _split(STEPS[name], 4)
    _check(STEPS[name], MicrobatchedStep(module)(jax.tree_util.tree_leaves(args)), args)


@pytest.mark.parametrize("name", list(STEPS))
def test_pipelined_step_under_every_schedule(name):
    module, args = _split(STEPS[name], 4)
    Pipeline.parse(f"builtin.module({TWO_STAGES})", module.context).run(module, PassContext())
    program = pipeline_program(module, split_backward=True)
    assert len(program.meshes) == 2, "the plan does not pipeline: the test would prove less"
    step = PipelinedStep(program, "eager-1f1b-wd")
    for schedule in ("gpipe", "1f1b", "eager-1f1b", "eager-1f1b-wd"):
        _check(STEPS[name], step(jax.tree_util.tree_leaves(args), schedule), args)


# --------------------------------------------------------------------------- parallelize (Ray)


def _parallelize(name: str, method: str, schedule: str = "eager-1f1b", pipelined: bool = False) -> None:
    step, args = STEPS[name], _args()
    parallel = hlopar.parallelize(
        step, cluster=CLUSTER, num_microbatches=4, method=method, schedule=schedule, verbose=False
    )
    try:
        outputs = parallel(*args)
        program = parallel.runtime.program
        assert program.microbatches == 4
        if pipelined:
            assert len(program.meshes) == 2, "the plan does not pipeline: the test would prove less"
        _check(step, outputs, args)
    finally:
        parallel.shutdown()


@pytest.mark.parametrize("name", list(STEPS))
def test_parallelize_shard(ray_cluster, name):
    _parallelize(name, "shard")


@pytest.mark.parametrize(
    ("name", "schedule"), [("aux", "gpipe"), ("aux", "1f1b"), ("per_example", "eager-1f1b"), ("aux", "eager-1f1b-wd")]
)
def test_parallelize_auto_pipelined(ray_cluster, name, schedule):
    _parallelize(name, "auto", schedule, pipelined=True)
