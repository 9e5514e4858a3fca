"""`hlopar-auto-sharding`'s batch options do what they say (issue 30 item 3).

- `force-batch-dim=AXIS` splits the batch's flow over AXIS: the dimension of every value
  that holds the examples (`batch_flow.batch_dims`, from the ops' factors), not every value
  whose leading dim happens to equal the batch size (a transposed embedding table of 8 rows
  next to a batch of 8 is no batch);
- the batch is found with a random key in it and optax's scalar count beside it, also
  before `hlopar-import` inlines JAX's random functions;
- a size-1 axis splits nothing, and the pass says so;
- `data-parallel` is pure data parallelism: the batch split over every axis, the state
  replicated, and the program equal to one device's;
- `batch-args` names the batch, as the error messages say.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_trees_close

from hlopar.analysis.auto_sharding.batch_flow import batch_dims
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions, print_module, run_function_pass
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

HIDDEN, VOCAB, BATCH, SEQ = 8, 32, 8, 4  # hidden = batch: a leading dim of 8 says nothing
OPTIMIZER = optax.adam(1e-2)


def _loss(params, batch):
    table = params["table"]  # (hidden, vocab): the embedding stored transposed, tied to the output
    h = jnp.take(table.T, batch["tokens"], axis=0)  # (batch, seq, hidden)
    keep = jax.random.bernoulli(batch["key"], 0.9, h.shape)
    h = jnp.tanh(jnp.where(keep, h / 0.9, 0.0) @ params["w"])
    logits = h @ table  # (batch, seq, vocab)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _step(params, state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, state = OPTIMIZER.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"table": jax.random.normal(k[0], (HIDDEN, VOCAB)), "w": jax.random.normal(k[1], (HIDDEN, HIDDEN)) / 3}
    batch = {
        "tokens": jax.random.randint(k[2], (BATCH, SEQ), 0, VOCAB),
        "labels": jax.random.randint(k[3], (BATCH, SEQ), 0, VOCAB),
        "key": jax.random.PRNGKey(7),
    }
    return params, OPTIMIZER.init(params), batch


def _text() -> str:
    return jax.jit(_step).lower(*_args()).as_text()


def _run(options: str, *, imported: bool = True):
    module = parse_module(_text())
    context = PassContext()
    passes = ("hlopar-import," if imported else "") + f"hlopar-auto-sharding{{{options}}}"
    Pipeline.parse(f"builtin.module({passes})", module.context).run(module, context)
    return module, context


def _arg_numbers() -> dict[str, int]:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(_args())]
    return {path: i for i, path in enumerate(paths)}


def _main_signature(text: str) -> tuple[list[str], list[str]]:
    """Each argument's and result's sharding (`[...]` part), in order."""
    match = re.search(r"func\.func public @main\((.*?)\) -> \((.*?)\) \{", text, re.S)
    layouts = [re.findall(r"#sdy\.sharding<@\w+, (\[.*?\])>", part) for part in match.groups()]
    return layouts[0], layouts[1]


def _dim0_axes(layout: str) -> list[str]:
    """The mesh axes that split dim 0 of a printed layout such as `[{"x", "y"}, {}]`."""
    return re.findall(r'"(\w+)"', layout.split("}")[0])


def test_the_batch_flows_along_the_examples_not_along_leading_dims():
    module = parse_module(_text())
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    func = planned_functions(module)[0]
    run_function_pass(module, [func], "sdy-populate-op-sharding-rules")
    graph = FuncGraph.from_func(func)
    rules = {op.id: rule_of(op.mlir_op) for op in graph.walk()}
    numbers = _arg_numbers()
    tokens, labels = numbers["[2]['tokens']"], numbers["[2]['labels']"]
    dims = batch_dims(graph, rules, (tokens, labels))
    table = graph.args[numbers["[0]['table']"]]
    assert dims[graph.args[tokens]] == 0 and dims[graph.args[labels]] == 0
    assert table not in dims and graph.args[numbers["[0]['w']"]] not in dims
    shapes = {v: graph.values[v].shape for v in dims}
    # The activations (batch, seq, hidden) and logits (batch, seq, vocab) carry it in dim 0 ...
    assert any(shapes[v] == (BATCH, SEQ, VOCAB) and d == 0 for v, d in dims.items())
    # ... and no value of the update does: the gradients sum over the examples.
    results = set(graph.results)
    assert not results & set(dims)
    # A leading dim of 8 was the old rule: it also took the table, its gradient and Adam's moments.
    leading = [v for v, info in enumerate(graph.values) if info.shape and info.shape[0] == BATCH]
    assert len([v for v in leading if v not in dims]) >= 4


def test_force_batch_dim_splits_the_batch_flow_and_nothing_else():
    module, context = _run("mesh-shape=2x4 force-batch-dim=x latency=0,0")
    args, _ = _main_signature(print_module(module))
    numbers = _arg_numbers()
    assert "x" in _dim0_axes(args[numbers["[2]['tokens']"]]) and "x" in _dim0_axes(args[numbers["[2]['labels']"]])
    assert not [d for d in context.diagnostics if d.severity == "error"]
    # Every op result in the batch's flow is split over x in its batch dim.
    graph = FuncGraph.from_func(planned_functions(module)[0])
    ops = [op for op in graph.walk() if "sdy.sharding" in op.mlir_op.attributes]
    batched = [
        op
        for op in ops
        if op.results and graph.values[op.results[0]].shape[:2] == (BATCH, SEQ) and op.name != "stablehlo.iota"
    ]
    assert len(batched) >= 10
    for op in batched:
        layout = re.search(r"<@\w+, (\[.*?\])>", str(op.mlir_op.attributes["sdy.sharding"])).group(1)
        assert "x" in _dim0_axes(layout), (op.name, layout)


@pytest.mark.parametrize("imported", [True, False], ids=["imported", "as-jax-lowers-it"])
def test_the_batch_is_found_beside_a_random_key_and_a_scalar_count(imported):
    module, context = _run("mesh-shape=2x4 force-batch-dim=y", imported=imported)
    args, _ = _main_signature(print_module(module))
    numbers = _arg_numbers()
    assert "y" in _dim0_axes(args[numbers["[2]['tokens']"]])
    assert args[numbers["[2]['key']"]] == "[{}]"
    assert not [d for d in context.diagnostics if "force-batch-dim" in d.message]


def test_a_size_one_axis_is_reported():
    module, context = _run("mesh-shape=1x8 force-batch-dim=x")
    messages = [d.message for d in context.diagnostics if d.severity == "warning"]
    assert "hlopar-auto-sharding: force-batch-dim=x: the axis has size 1, so it splits nothing" in messages


def test_batch_args_names_the_batch_the_messages_point_to():
    numbers = _arg_numbers()
    batch = ",".join(str(numbers[path]) for path in ("[2]['tokens']", "[2]['labels']"))
    module, _ = _run(f"mesh-shape=2x4 force-batch-dim=y batch-args={batch}")
    args, _ = _main_signature(print_module(module))
    assert "y" in _dim0_axes(args[numbers["[2]['tokens']"]])
    with pytest.raises(DiagnosticError, match="batch-args: 'main' has no argument 99"):
        _run("mesh-shape=2x4 force-batch-dim=y batch-args=99")


def test_data_parallel_replicates_the_state_and_splits_the_batch_over_every_axis():
    module, _ = _run("mesh-shape=2x4 data-parallel=true")
    text = print_module(module)
    args, results = _main_signature(text)
    numbers = _arg_numbers()
    batch = {numbers["[2]['tokens']"], numbers["[2]['labels']"]}
    state = [i for path, i in numbers.items() if path.startswith(("[0]", "[1]"))]
    assert len(state) == len(results) - 1 == 7  # 2 parameters; Adam's count and 2 x 2 moments
    assert all('"' not in args[i] for i in state) and all('"' not in r for r in results)
    assert all(args[i] == '[{"x", "y"}, {}]' for i in batch)
    params, opt_state, data = _args()
    reference = jax.jit(_step)(params, opt_state, data)
    outputs = compile_spmd(module, jax.devices()[:8])(*jax.tree_util.tree_leaves((params, opt_state, data)))
    # The loss and gradients summed over 8 shards instead of at once: float32 rounding.
    assert_trees_close(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(reference), [np.asarray(x) for x in outputs]),
        reference,
        rtol=2e-6,
        atol=1e-7,
    )
