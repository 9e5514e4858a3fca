"""hlopar-unstack-layer-scans: scans over stacked layers unrolled, stacked values split per layer.

The rewritten step must compute the same numbers as the scanned one (compiled by stock
jaxlib on one device, the pieces sliced from and concatenated back into the stacks), hold no
loop over layers and no whole stack, and leave loops that are not over layers alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scan_steps
from numerics import assert_adam_step_close, assert_trees_equal

from hlopar.analysis.flops import function_flops
from hlopar.analysis.layer_scans import layer_scans
from hlopar.codegen.executables import compile_executable
from hlopar.dialect.layers import LayerPieces
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions, print_module
from hlopar.ir.signature import FuncSignature
from hlopar.models import gpt
from hlopar.passes.base import PassContext
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.import_program import ImportPass
from hlopar.passes.unstack_layer_scans import UnstackLayerScansPass


def _imported(text: str):
    module = parse_module(text)
    ImportPass().run(module, PassContext())
    return module


def _unstacked(text: str):
    module = _imported(text)
    UnstackLayerScansPass().run(module, PassContext())
    return module


def _main(module):
    return planned_functions(module)[0]


def _zoo(name: str):
    s = gpt.train_step(name)
    params = s.init(jax.random.key(0))
    return s.step, (params, s.init_opt_state(params), s.make_batch(jax.random.key(1)))


STEPS = {
    "zoo_gpt_scan": lambda: _zoo("tiny-scan"),
    "gpt_scan_sgd": lambda: scan_steps.gpt_scan(optimizer="sgd"),
    "flax_scan_remat": lambda: scan_steps.flax_scan(remat=True),
}


def params_of(tree):
    """The parameters among a step's arguments or results: the first, or a TrainState's."""
    return tree[0].params if hasattr(tree[0], "params") else tree[0]


def _run(module, leaves, pieces: LayerPieces | None):
    executable = compile_executable(module, jax.devices()[:1])
    arguments = [np.asarray(x) for x in leaves]
    results = executable(*(pieces.split(arguments) if pieces else arguments))
    return pieces.join(results) if pieces else results


@pytest.mark.parametrize("name", list(STEPS))
def test_unstacked_step_computes_the_scanned_steps_numbers(name):
    step, args = STEPS[name]()
    text = jax.jit(step).lower(*args).as_text()
    leaves = [np.asarray(jnp.asarray(x)) for x in jax.tree_util.tree_leaves(args)]  # TrainState's step=0: int32
    module = _unstacked(text)
    pieces = LayerPieces.of(_main(module))
    assert pieces is not None
    tree = jax.tree_util.tree_structure(jax.eval_shape(step, *args))
    got = jax.tree_util.tree_unflatten(tree, _run(module, leaves, pieces))
    want = jax.tree_util.tree_unflatten(tree, _run(_imported(text), leaves, None))
    # XLA fuses the unrolled layers differently from the loop body: rounding may differ (by
    # 2 ulp at most, measured); Adam turns a zero gradient's rounding noise into steps of
    # about lr (attention's key bias), masked.
    assert_adam_step_close(got, want, params_of(args), params_of, rtol=2e-6)


def test_the_zoo_gpt_unstacked_is_bit_exact_and_holds_no_stack():
    """The zoo's scanned GPT: same bits as the loop; no loop, no whole stack, no per-layer slicing
    left; each of the 12 stacked leaves of the parameters and of Adam's two moments is 2 pieces
    of leading dim 1, named by its pytree path and layer; everything else is untouched."""
    step, args = _zoo("tiny-scan")
    text = jax.jit(step).lower(*args).as_text(debug_info=True)
    module = _unstacked(text)
    main = _main(module)
    pieces = LayerPieces.of(main)
    assert_trees_equal(
        _run(module, jax.tree_util.tree_leaves(args), pieces),
        _run(_imported(text), jax.tree_util.tree_leaves(args), None),
    )
    ir_text = print_module(module)
    for gone in (
        "stablehlo.while",
        "stablehlo.dynamic_slice",
        "stablehlo.dynamic_update_slice",
        "stablehlo.concatenate",
    ):
        assert gone not in ir_text
    stacked_leaves = 12 * 3  # block parameters, mu, nu
    assert sorted(set(o for o, p in zip(pieces.arg_origin, pieces.arg_piece) if p >= 0)) == [
        i
        for i, x in enumerate(jax.tree_util.tree_leaves(args))
        if np.ndim(x) > 0 and np.shape(x)[0] == 2 and i not in (49, 50)
    ]  # the batch (4 x 16 tokens) is not a layer stack
    assert len(pieces.arg_origin) == len(jax.tree_util.tree_leaves(args)) + stacked_leaves
    assert len(pieces.result_origin) == 50 + stacked_leaves
    assert [p for p in pieces.arg_piece if p >= 0] == [0, 1] * stacked_leaves
    names = FuncSignature.of(main).arg_names
    assert "params['layers']['attn']['qkv']['kernel'][1]" in names
    assert "opt_state.nu['layers']['ln1']['bias'][0]" in names
    info = [str(a) for a in main.attributes["res_attrs"]]
    assert any("result[1].mu['layers']['mlp']['fc1']['kernel'][0]" in a for a in info)


def test_the_unstacked_scan_is_its_unrolled_twin():
    """Unstacked, the scanned zoo GPT has the FLOPs and matmuls of the same GPT written with a
    Python loop."""
    scanned_module = _unstacked(gpt.train_step("tiny-scan").lower())  # kept alive: the graphs read it
    unrolled_module = _imported(gpt.train_step("tiny").lower())
    scanned, unrolled = FuncGraph.from_func(_main(scanned_module)), FuncGraph.from_func(_main(unrolled_module))
    assert len(scanned.ops) > 100 and len(unrolled.ops) > 100
    # Within 1e-4: the mask recomputed per reader rather than per layer adds elementwise FLOPs
    # (0.003% measured); every matmul is the same.
    assert sum(function_flops(scanned)) == pytest.approx(sum(function_flops(unrolled)), rel=1e-4)
    heavy = lambda g: sum(op.name == "stablehlo.dot_general" for op in g.ops)  # noqa: E731
    assert heavy(scanned) == heavy(unrolled)


def _per_layer_flops(module, num_layers: int) -> list[tuple[float, float]]:
    """Clustered into `num_layers` layers: per layer, the FLOPs of its forward ops and of all its ops."""
    _, info = ClusterOperatorsPass(layers=num_layers).cluster(FuncGraph.from_func(_main(module)))
    return [(layer["forward_flops"], layer["flops"]) for layer in info["layers"]]


def test_the_unstacked_scan_clusters_as_its_unrolled_twin():
    """A 4-layer GPT scanned and written with a Python loop, cut into as many layers as blocks
    and into more (cuts inside blocks): both put the same FLOPs in every layer, forward and
    all. Unstacked as the loops leave it, the scanned one's weight gradients and parameter
    updates went to other layers (up to 98% off per layer), and its backward recomputed the
    causal mask that the twin's backward reads from its forward."""
    config = gpt.GPTConfig(hidden_size=64, num_layers=4, num_heads=4, seq_len=16, vocab_size=128, batch_size=4)
    scanned = _unstacked(gpt.train_step(dataclasses.replace(config, scan_layers=True)).lower())
    unrolled = _imported(gpt.train_step(config).lower())
    for num_layers in (4, 6):
        got, want = _per_layer_flops(scanned, num_layers), _per_layer_flops(unrolled, num_layers)
        assert len(got) == num_layers
        for (got_forward, got_all), (want_forward, want_all) in zip(got, want):
            assert got_forward == pytest.approx(want_forward, rel=1e-6)
            assert got_all == pytest.approx(want_all, rel=1e-6)


def test_a_loop_over_time_is_not_a_layer_scan():
    """A fori_loop whose operands are not stacked per iteration stays a loop, and nothing is split."""

    def step(w, x):
        return jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x).sum()

    text = jax.jit(step).lower(jnp.ones((4, 4)), jnp.ones((4, 4))).as_text()
    imported = _imported(text)
    assert layer_scans(FuncGraph.from_func(_main(imported))) == []
    module = _unstacked(text)
    assert "stablehlo.while" in print_module(module) and LayerPieces.of(_main(module)) is None


def test_layer_pieces_split_and_join():
    pieces = LayerPieces(arg_origin=(0, 1, 1), arg_piece=(-1, 0, 1), result_origin=(0, 0, 1), result_piece=(0, 1, -1))
    stack = np.arange(6.0).reshape(2, 3)
    a, p0, p1 = pieces.split([np.float32(7), stack])
    assert a == 7 and p0.shape == p1.shape == (1, 3)
    np.testing.assert_array_equal(np.concatenate([p0, p1]), stack)
    joined = pieces.join([p0, p1, np.float32(1)])
    assert len(joined) == 2
    np.testing.assert_array_equal(joined[0], stack)
    assert pieces.resident({1: 0}) == {1: 0, 2: 1}
    assert pieces.arguments_of([1]) == (1, 2)
    assert LayerPieces.from_json(pieces.to_json()) == pieces


def test_a_hoisted_mask_is_made_by_each_layer_and_read_by_its_backward():
    """JAX hoists the causal mask (iota, compare, select, broadcast) out of the scan; unrolled,
    each layer's forward computes its own copy and that layer's backward reads it, as in the
    model written with a Python loop, so no mask crosses a layer (or stage) boundary."""
    # GPT-350M (abstract: nothing is allocated), whose 1024 x 1024 mask JAX computes from iotas.
    module = _unstacked(gpt.train_step("350M-scan").lower())  # kept alive: the graph reads it
    graph = FuncGraph.from_func(_main(module))
    assert len(graph.ops) > 1000
    layering, _ = ClusterOperatorsPass(layers=24).cluster(graph)
    from_constants: set[int] = set()
    for op in graph.ops:
        if op.name == "stablehlo.constant" or all(v in from_constants for v in graph.reads(op.index)):
            from_constants.update(op.results)
    made = [v for v in from_constants if graph.ops[graph.values[v].producer].name != "stablehlo.constant"]
    assert [v for v in made if len({layering.layers[u] for u in graph.values[v].users}) > 1] == []
    read_by_both = [v for v in made if {layering.roles[u] for u in graph.values[v].users} == {"forward", "backward"}]
    assert len(read_by_both) == 2 * 24  # two per block, as in the Python-loop twin
