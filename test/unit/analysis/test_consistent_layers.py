"""`op_layers.consistent_layers`: backward ops moved where a pipeline can run them.

Small graphs written as plain data (roles, the ops each op reads, the layers the rules of
`layer_of_ops` gave), one per way the rules went wrong on real steps (docs/stage_construction.md,
"How backward ops get their layers"), and random graphs against the two rules: a backward
op of layer l reads backward values of layers >= l and forward values of layers <= l.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
import scan_steps
from flax.training import train_state
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopar.analysis.op_layers import consistent_layers
from hlopar.analysis.training_roles import Role
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions
from hlopar.models import get_train_step
from hlopar.passes import mpmd_program
from hlopar.passes.base import PassContext
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.mpmd_program import misordered_reads
from hlopar.passes.pipeline import Pipeline

F, B, U = Role.FORWARD, Role.BACKWARD, Role.UPDATE


def repaired(ops: list[tuple[Role, list[int], int]], free: set[int] = frozenset()) -> list[int]:
    """`ops`: per op (role, the ops it reads, its layer before the repair)."""
    roles, reads, layers = zip(*ops)
    return list(consistent_layers(roles, reads, layers, [i in free for i in range(len(ops))]))


def test_a_bias_gradient_follows_the_checkpoint_barrier_it_reads():
    """jax.checkpoint's barrier holds a block's inputs and the incoming cotangent; the bias
    gradient (a sum of that cotangent) was put with its bias, a layer above the barrier:
    it runs with the barrier instead."""
    ops = [
        (F, [], 0),
        (F, [0], 1),  # the block, cut in two
        (B, [1], 1),  # the cotangent, from the layer above
        (B, [0, 2], 0),  # the barrier: the block's input and the cotangent
        (B, [3], 1),  # the bias gradient, placed by its bias's layer
        (U, [4], 1),
    ]
    assert repaired(ops) == [0, 1, 1, 0, 0, 1]


def test_a_weight_gradient_runs_no_later_than_its_cotangent():
    """A skip connection's weight gradient reads the skip (made in layer 1, read in 1 and 3)
    and a cotangent made in layer 2; the candidate closest to 2 was 3 on a tie."""
    ops = [(F, [], 1), (F, [0], 3), (B, [], 2), (B, [0, 2], 3), (U, [3], 3)]
    assert repaired(ops) == [1, 3, 2, 2, 3]


def test_a_backward_op_reading_a_later_forward_value_pulls_its_cotangents_up():
    """Lowered to its cotangent's layer 1, the op still reads a forward value of layer 2: it
    and what it reads from the backward go to layer 2."""
    ops = [(F, [], 2), (B, [], 1), (B, [1], 1), (B, [0, 2], 2)]
    assert repaired(ops) == [2, 2, 2, 2]


def test_values_computed_from_constants_follow_their_readers():
    """A causal mask recomputed after the forward (so clustered into the last layer) that the
    first layer's backward reads; a zero buffer shared by two layers' backward and an update
    (cse) placed with the update's layer 0."""
    ops = [
        (F, [], 3),  # iota
        (F, [0], 3),  # the mask, placed by program order
        (B, [], 1),
        (B, [1, 2], 0),  # layer 0's backward reads the mask
        (B, [], 0),  # zeros
        (B, [4], 2),
        (B, [4, 5], 1),
        (U, [4, 6], 0),
    ]  # (ops 5 and 6 read arguments too)
    assert repaired(ops, free={0, 1, 4}) == [0, 0, 1, 0, 2, 2, 1, 0]


def test_consistent_layers_are_kept():
    ops = [(F, [], 0), (F, [0], 1), (B, [1], 1), (B, [0, 2], 0), (B, [2], 1), (U, [3, 4], 0)]
    assert repaired(ops) == [0, 1, 1, 0, 1, 0]


@st.composite
def steps(draw):
    """Forward ops in layer order, then backward ops reading earlier ops, then updates."""
    num_layers = draw(st.integers(1, 5))
    forward = sorted(draw(st.lists(st.integers(0, num_layers - 1), min_size=1, max_size=8)))
    roles, reads, layers = [], [], []
    for layer in forward:
        reads.append(draw(st.sets(st.sampled_from(range(len(roles))), max_size=2)) if roles else set())
        roles.append(F)
        layers.append(layer)
    for role in draw(st.lists(st.sampled_from([B, B, U]), min_size=1, max_size=12)):
        earlier = [i for i in range(len(roles)) if role is U or roles[i] is not U]
        reads.append(draw(st.sets(st.sampled_from(earlier), max_size=3)))
        roles.append(role)
        layers.append(draw(st.integers(0, num_layers - 1)))
    free = [not reads[i] and draw(st.booleans()) for i in range(len(roles))]
    for i in range(len(roles)):  # free: computed from free ops alone
        free[i] = free[i] or bool(reads[i]) and all(free[p] for p in reads[i]) and draw(st.booleans())
    return roles, [sorted(r) for r in reads], layers, free


@settings(max_examples=200, deadline=None)
@given(steps())
def test_every_read_is_one_a_pipeline_can_run(step):
    roles, reads, layers, free = step
    out = consistent_layers(roles, reads, layers, free)
    assert len(out) == len(layers) and min(out) >= 0 and max(out) <= max(layers)
    for i, producers in enumerate(reads):
        for p in producers:
            if roles[i] is B and roles[p] is B:
                assert out[i] <= out[p], (i, p, out)
            if roles[i] is B and roles[p] is F:
                assert out[p] <= out[i], (i, p, out)
            if roles[i] is F and free[p]:
                assert out[p] <= out[i], (i, p, out)
    for i in range(len(roles)):
        if roles[i] is not B and not free[i]:
            assert out[i] == layers[i]  # the forward's clustering and the updates stay
    assert consistent_layers(roles, reads, out, free) == out  # a fixpoint


# --------------------------------------------------------------------------- real steps


class LoopTransformer(nn.Module):
    """`scan_steps.ScannedTransformer` written with a Python loop, each block under `nn.remat`."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(scan_steps.VOCAB, scan_steps.WIDTH)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.2), (scan_steps.SEQ, scan_steps.WIDTH))
        mask = nn.make_causal_mask(tokens)
        for i in range(2):
            x, _ = nn.remat(scan_steps.Block)(name=f"block_{i}")(x, mask)
        return nn.Dense(scan_steps.VOCAB)(nn.LayerNorm()(x))


def _flax_loop_step() -> str:
    model = LoopTransformer()

    def init():
        params = model.init(jax.random.PRNGKey(0), jnp.ones((1, scan_steps.SEQ), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(scan_steps.LR))

    state = jax.eval_shape(init)  # only the IR is needed

    def train_step(state, batch):
        def loss_fn(params):
            return scan_steps._cross_entropy(state.apply_fn({"params": params}, batch["tokens"]), batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return jax.jit(train_step).lower(state, scan_steps.batch()).as_text(debug_info=True)


@pytest.mark.parametrize("model, layers", [("flax-remat-loop", 6), ("wide_resnet", 4)])
def test_no_layer_reads_a_value_made_later(model, layers):
    """Where the rules alone went wrong: a Flax Python loop of two `nn.remat` blocks cut into 6
    layers (a bias gradient above its barrier), the Wide-ResNet into 4 (a shortcut's weight
    gradient above its cotangent). Taking each layer as a stage, no op reads a value the
    pipeline makes after it."""
    text = _flax_loop_step() if model == "flax-remat-loop" else get_train_step(model, "tiny").lower()
    module = parse_module(text)
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    with module.context:
        graph = FuncGraph.from_func(planned_functions(module)[0])
        layering, _ = ClusterOperatorsPass(layers=layers).cluster(graph)
        reads, floating = mpmd_program._reads(graph)
        assert misordered_reads(reads, layering.layers, layering.roles, floating) == []
