"""hlopar-rematerialize: the choice of ops to recompute over plain data, and the pass on a
planned program.

The program: the zoo's tiny MLP planned by hlopar-auto-parallel on 2 hosts x 4 CPU devices
over 2 microbatches, without remat (two stages whose backwards read their forwards' ReLU
activations), then rewritten with `all=true`. Each stage then stashes only the microbatch's
examples (the simulated peak memory of every schedule drops by the activations it no longer
holds), each forward returns only what the next stage or the loss needs, the step computes
what one device does, and the pass run again changes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_step_close

from hlopar.analysis.schedules import StageCost, simulate
from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.ir.module import parse_module, print_module
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.passes.rematerialize import (
    LayerRecompute,
    Recompute,
    RematerializePass,
    fill_layers,
    layer_slices,
    recompute_slice,
)
from hlopar.runtime.local_executor import PipelinedStep

# Values 0 (x) and 1 (w) are inputs; op0: 2 = f(x); op1: 3 = g(2, w); op2: 4 = h(3); op3: 5 = k(x);
# op4 reads 4 and defines nothing (a side effect).
READS = [(0,), (2, 1), (3,), (0,), (4,)]
DEFINES = [(2,), (3,), (4,), (5,), ()]


def test_slice_follows_reads_back_to_the_inputs():
    clonable = [True] * 5
    assert recompute_slice(READS, DEFINES, clonable, [3]) == Recompute((0, 1), (0, 1), ())
    assert recompute_slice(READS, DEFINES, clonable, [4, 2]) == Recompute((0, 1, 2), (0, 1), ())
    assert recompute_slice(READS, DEFINES, clonable, [5]) == Recompute((3,), (0,), ())
    # An input wanted as it is: nothing to clone.
    assert recompute_slice(READS, DEFINES, clonable, [1]) == Recompute((), (1,), ())


def test_slice_stops_at_ops_that_cannot_be_cloned():
    clonable = [True, False, True, True, True]
    # 3 comes from op1, which is not cloned: it is kept, and op0 (only op1 read it) is not needed.
    assert recompute_slice(READS, DEFINES, clonable, [4]) == Recompute((2,), (), (3,))
    assert recompute_slice(READS, DEFINES, clonable, [3, 5]) == Recompute((3,), (0,), (3,))


def test_slice_checks_its_lists():
    with pytest.raises(ValueError, match="2 read lists, 1 define lists"):
        recompute_slice([(), ()], [()], [True, True], [])


# Two layers: inputs 0 (x), 1 (w0), 2 (w1); layer 0: op0 3 = f(x, w0), op1 4 = g(3);
# layer 1: op2 5 = f(4, w1), op3 6 = g(5). 4 is a layer boundary (layer 1's forward reads it).
LAYER_READS = [(0, 1), (3,), (4, 2), (5,)]
LAYER_DEFINES = [(3,), (4,), (5,), (6,)]


def test_layer_slices_recompute_each_layer_from_the_boundaries():
    wanted = [(3, 0), (6, 1), (4, 1)]  # layer 0's backward reads 3; layer 1's reads 6 and its input 4
    plan = layer_slices(LAYER_READS, LAYER_DEFINES, [True] * 4, [0, 0, 1, 1], wanted)
    # Layer 1 first (the backward's order), from its input 4 (stashed) and w1; layer 0 from x, w0.
    assert plan == LayerRecompute(((1, Recompute((2, 3), (2, 4), ())), (0, Recompute((0,), (0, 1), ()))), (4,))


def test_layer_slices_stash_what_a_later_layer_reads():
    # 3 read by a backward op of layer 1: a boundary too, stashed, so layer 0 recomputes nothing.
    plan = layer_slices(LAYER_READS, LAYER_DEFINES, [True] * 4, [0, 0, 1, 1], [(3, 1), (6, 1)])
    assert plan == LayerRecompute(((1, Recompute((2, 3), (2, 4), ())),), (3,))
    # An op that cannot be cloned: its result is kept, nothing before it in its layer is cloned.
    plan = layer_slices(LAYER_READS, LAYER_DEFINES, [True, True, True, False], [0, 0, 1, 1], [(6, 1)])
    assert plan == LayerRecompute(((1, Recompute((), (), (6,))),), ())
    with pytest.raises(ValueError, match="4 read lists, 3 layers"):
        layer_slices(LAYER_READS, LAYER_DEFINES, [True] * 4, [0, 0, 1], [])


def test_layer_slices_clone_constants_where_needed():
    # op0 7 = constant (written in layer 0); op1 (layer 0) 3 = f(x, 7); op2 (layer 1) 5 = g(3, 7).
    # 7 is no boundary (made of nothing): layer 1's slice clones it; the backward reading 7
    # itself gets it from its reader's slice, not from the stash.
    reads, defines = [(), (0, 7), (3, 7)], [(7,), (3,), (5,)]
    plan = layer_slices(reads, defines, [True] * 3, [0, 0, 1], [(5, 1), (7, 1)])
    assert plan == LayerRecompute(((1, Recompute((0, 2), (3,), ())),), ())


def test_fill_layers_from_producers_then_readers():
    # op0 reads only an input: the layer of its reader op1 (0); op2 likewise takes op3's (1);
    # op4 follows its producer op3 (1); op5 touches nothing with a layer: the lowest, 0.
    reads = [(0,), (3,), (0,), (5,), (6,), (9,)]
    defines = [(3,), (4,), (5,), (6,), (7,), (8,)]
    assert fill_layers(reads, defines, [None, 0, None, 1, None, None]) == [0, 0, 1, 1, 1, 0]
    assert fill_layers(reads, defines, [None] * 6) == [0] * 6


@functools.cache
def _mlp():
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    arguments = [np.asarray(a) for a in jax.tree_util.tree_leaves((params, state, batch))]
    module = parse_module(step.lower())
    Pipeline.parse(
        "builtin.module(hlopar-auto-parallel{num-hosts=2 devices-per-host=4 split=true microbatches=2 remat=never schedule=1f1b})",
        module.context,
    ).run(module, PassContext())
    return print_module(module), arguments, params, step.jitted_step(params, state, batch), batch


def _rematerialized(text: str) -> tuple[str, PassContext]:
    module = parse_module(text)
    context = PassContext()
    RematerializePass(all=True).run(module, context)
    return print_module(module), context


def test_rematerialized_stages_stash_only_their_examples():
    text, arguments, params, reference, batch = _mlp()
    before = pipeline_program(parse_module(text))
    after_text, context = _rematerialized(text)
    after = pipeline_program(parse_module(after_text))
    assert context.diagnostics == []
    assert before.topology.num_stages == after.topology.num_stages == 2
    examples = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(batch)) // 2
    for stage in range(2):
        old = {f.role: f for f in before.fragments if f.stage == stage}
        new = {f.role: f for f in after.fragments if f.stage == stage}
        # Before: the backward reads activations of its forward; after, only the examples.
        assert before.topology.activation_bytes[stage] > examples
        assert after.topology.activation_bytes[stage] <= examples
        assert len(new["forward"].results) < len(old["forward"].results)
        assert new["forward"].flops <= old["forward"].flops
        assert new["backward"].flops > old["backward"].flops  # one more forward
        assert after_text.count("{hlopar.remat}") == 2
    costs = [StageCost(1.0, 2.0)] * 2
    for schedule in ("gpipe", "1f1b", "eager-1f1b"):
        old_peak = simulate(before.streams(schedule), costs).peak_memory
        new_peak = simulate(after.streams(schedule), costs).peak_memory
        assert all(new_peak[m] < old_peak[m] for m in old_peak), (schedule, old_peak, new_peak)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager-1f1b-wd"])
def test_rematerialized_step_equals_one_device(schedule):
    text, arguments, params, reference, _ = _mlp()
    after, _ = _rematerialized(text)
    outputs = PipelinedStep(parse_module(after), schedule)(arguments)
    assert_step_close(outputs, reference, params, rtol=1e-5)


def test_pass_is_idempotent_and_a_no_op_on_unmarked_programs():
    text = _mlp()[0]
    module = parse_module(text)
    RematerializePass().run(module, PassContext())  # nothing marked
    assert print_module(module) == text
    once = _rematerialized(text)[0]
    module = parse_module(once)
    RematerializePass().run(module, PassContext())  # marked, nothing left to recompute
    assert print_module(module) == once


def test_parallelize_takes_remat_as_a_mode_or_a_bool():
    import hlopar

    assert hlopar.parallelize(lambda x: x).remat == "auto"
    assert hlopar.parallelize(lambda x: x, remat=True).remat == "always"
    assert hlopar.parallelize(lambda x: x, remat=False).remat == "never"
    with pytest.raises(ValueError, match="remat must be True, False or one of auto, always, never, layers, got 'yes'"):
        hlopar.parallelize(lambda x: x, remat="yes")


def _dropout_step(params, x, y, key):
    """A two-layer MLP with dropout (JAX's threefry) on its hidden activations, one SGD step."""

    def loss_fn(params):
        h = jnp.tanh(x @ params["w1"])
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        out = jnp.where(keep, h / 0.8, 0.0) @ params["w2"]
        return jnp.mean(jnp.square(out - y))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_dropout_is_drawn_again_in_the_backward():
    """The backward recomputes the dropout mask from the key (threefry: a function of its
    operands) and the microbatch index, and gets the forward's bits: the step equals one
    device's, which it would not with other bits."""
    init = jax.random.split(jax.random.PRNGKey(7), 3)
    args = (
        {"w1": jax.random.normal(init[0], (5, 8)), "w2": jax.random.normal(init[1], (8, 2))},
        jax.random.normal(init[2], (16, 5)),
        jnp.ones((16, 2)),
        jax.random.PRNGKey(3),
    )
    module = parse_module(jax.jit(_dropout_step).lower(*args).as_text())
    Pipeline.parse(
        "builtin.module(hlopar-auto-parallel{num-hosts=1 devices-per-host=2 split=true microbatches=2 "
        "batch-args=2,3 remat=never schedule=1f1b})",
        module.context,
    ).run(module, PassContext())
    before = pipeline_program(module)
    RematerializePass(all=True).run(module, PassContext())
    after = pipeline_program(module)
    backward = [f for f in after.fragments if f.role == "backward"]
    assert backward and all("stablehlo.xor" in f.text for f in backward)  # threefry's rounds
    assert not any("stablehlo.xor" in f.text for f in before.fragments if f.role == "backward")
    outputs = PipelinedStep(module, "1f1b")(jax.tree_util.tree_leaves(args))
    want = jax.tree_util.tree_leaves(jax.jit(_dropout_step)(*args))
    for have, expected in zip(outputs, want, strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(expected), rtol=1e-5, atol=1e-6)
    other = jax.tree_util.tree_leaves(jax.jit(_dropout_step)(*args[:3], jax.random.PRNGKey(4)))
    assert not np.allclose(np.asarray(outputs[0]), np.asarray(other[0]), rtol=1e-3)
