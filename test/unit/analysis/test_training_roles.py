"""Forward, backward and update ops of the zoo's training steps, and the layers they follow."""

from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from jaxlib.mlir import ir
from reordered_steps import FLAT_ARGS, FLAT_RESULTS, reordered_step_text

from hlopar.analysis.op_layers import layer_of_ops, marked_layers
from hlopar.analysis.step_io import RolesError, batch_arguments, state_pairs
from hlopar.analysis.training_roles import Role, TrainingRoles, classify
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module
from hlopar.ir.signature import FuncSignature
from hlopar.models import adam_update, get_train_step, init_adam
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

FAMILIES = ["mlp", "gpt", "moe", "wide_resnet", "u_transformer"]
DENSE = ["mlp", "gpt", "u_transformer"]
MATMULS = ("stablehlo.dot_general", "stablehlo.convolution")


def imported(text: str) -> tuple[ir.Operation, FuncGraph]:
    """The module after `hlopar-import` and its graph; the graph reads the live IR (names
    of locations, attributes), so callers keep the module alive as long as the graph."""
    module = parse_module(text)
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    return module, FuncGraph.from_module(module)


@functools.cache
def _zoo(family: str, debug_info: bool) -> tuple[ir.Operation, FuncGraph, TrainingRoles]:
    module, graph = imported(get_train_step(family, "tiny").lower(debug_info=debug_info))
    return module, graph, classify(graph)


def zoo(family: str, debug_info: bool = False) -> tuple[FuncGraph, TrainingRoles]:
    return _zoo(family, debug_info)[1:]


@functools.cache
def _loss_only(family: str) -> tuple[ir.Operation, FuncGraph]:
    step = get_train_step(family, "tiny")
    params, _, batch = step.abstract_args()
    return imported(jax.jit(step.loss_fn).lower(params, batch).as_text())


def loss_only(family: str) -> FuncGraph:
    """The model's loss alone (no gradient): a forward-only program."""
    return _loss_only(family)[1]


def name(graph: FuncGraph, i: int) -> str:
    location = graph.ops[i].location
    return (location.name if location is not None else None) or ""


# --------------------------------------------------------------------------- roles


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_the_scalar_result_and_the_rest_is_state(family):
    graph, roles = zoo(family)
    assert roles.loss_result == len(graph.results) - 1
    assert graph.values[graph.results[roles.loss_result]].shape == ()
    assert [result for _, result in roles.state_pairs] == list(range(len(graph.results) - 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_ops_are_the_loss_program(family):
    """The training step's FORWARD ops are, op for op, what the loss alone lowers to."""
    graph, roles = zoo(family)
    forward = Counter(graph.ops[i].name for i in roles.ops_with(Role.FORWARD))
    assert forward == Counter(op.name for op in loss_only(family).ops)


@pytest.mark.parametrize("family", FAMILIES)
def test_matmuls_split_into_forward_and_about_twice_as_many_backward(family):
    graph, roles = zoo(family)
    counts = Counter(roles.roles[op.index] for op in graph.ops if op.name in MATMULS)
    assert counts[Role.FORWARD] == sum(op.name in MATMULS for op in loss_only(family).ops)
    assert counts[Role.UPDATE] == 0
    assert counts[Role.FORWARD] < counts[Role.BACKWARD] <= 2 * counts[Role.FORWARD]
    if family in DENSE:  # all but the data gradient of the first layer (the batch's)
        assert counts[Role.BACKWARD] >= 2 * counts[Role.FORWARD] - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_update_ops_only_feed_state_and_write_every_state(family):
    graph, roles = zoo(family)
    update = set(roles.ops_with(Role.UPDATE))
    state = {graph.results[result] for _, result in roles.state_pairs}
    assert update
    for i in update:
        for v in graph.ops[i].results:
            assert all(u in update for u in graph.values[v].users)
            assert v in state or graph.values[v].users, f"op {i} feeds a non-state result"
            assert v not in set(graph.results) - state
    for v in state:
        assert graph.values[v].producer in update
    # The gradients are what the backward hands the update: one per parameter, or two
    # for a tied weight (GPT's token embedding, used by the embedding and the head).
    parameters = len(jax.tree_util.tree_leaves(get_train_step(family, "tiny").param_specs))
    assert parameters <= len(roles.gradients) <= parameters + 1
    assert all(roles.roles[graph.values[v].producer] is Role.BACKWARD for v in roles.gradients)


@pytest.mark.parametrize("family", FAMILIES)
def test_roles_agree_with_jax_name_stacks(family):
    """With debug info: `jvp(` is forward, `transpose(jvp(` backward, neither the update."""
    graph, roles = zoo(family, debug_info=True)
    for i, op in enumerate(graph.ops):
        stack = name(graph, i)
        if not stack or op.name == "stablehlo.constant":
            continue
        expected = Role.BACKWARD if "transpose(" in stack else Role.FORWARD if "jvp(" in stack else Role.UPDATE
        assert roles.roles[i] is expected, (i, op.name, stack)


def test_without_name_stacks_residuals_are_backward():
    """ReLU masks are computed next to the forward but only the backward reads them: with
    name stacks they are FORWARD, without they cannot be told from the backward."""
    with_names, named_roles = zoo("mlp", debug_info=True)
    plain, plain_roles = zoo("mlp")
    masks = [op.index for op in plain.ops if op.name == "stablehlo.compare"]
    assert masks and [op.name for op in plain.ops] == [op.name for op in with_names.ops]
    assert all(plain_roles.roles[i] is Role.BACKWARD for i in masks)
    assert all(named_roles.roles[i] is Role.FORWARD for i in masks)


def _flat_roles(arg_order, result_order, debug_info):
    """Roles of the reordered step, named by what they are (`FLAT_ARGS` / `FLAT_RESULTS`)."""
    module, graph = imported(reordered_step_text(arg_order, result_order, debug_info))
    roles = classify(graph)
    arg_name = [FLAT_ARGS[k] for k in arg_order]
    result_name = [FLAT_RESULTS[k] for k in result_order]
    counts = Counter(roles.roles[op.index] for op in graph.ops if op.name in MATMULS)
    return (
        result_name[roles.loss_result],
        sorted((arg_name[a], result_name[r]) for a, r in roles.state_pairs),
        sorted(arg_name[i] for i in batch_arguments(graph, roles.state_pairs)),
        counts,
    )


_FLAT_EXPECTED = (
    "loss",
    sorted((n, n) for n in FLAT_ARGS if n not in ("x", "y")),
    ["x", "y"],
    Counter({Role.FORWARD: 2, Role.BACKWARD: 3}),
)


@settings(max_examples=12, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(st.permutations(range(len(FLAT_ARGS))), st.permutations(range(len(FLAT_RESULTS))), st.booleans())
def test_roles_do_not_depend_on_the_order_of_arguments_and_results(arg_order, result_order, debug_info):
    """Whatever order the step takes and returns its values in (with JAX's names or
    without), the same loss, the same state pairs, the same batch and the same roles."""
    assert _flat_roles(arg_order, result_order, debug_info) == _FLAT_EXPECTED


def test_state_pairs_of_an_optax_step_returning_the_loss_first():
    """`(loss, params, opt_state)` with Optax's nested state: each new value pairs with its
    own argument (by data flow, and JAX's pytree names where types tie)."""

    def model_loss(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"] - y) ** 2)

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model_loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4))}
    batch = (jnp.ones((8, 4)), jnp.ones((8, 4)))
    module, graph = imported(jax.jit(step).lower(params, optimizer.init(params), batch).as_text(debug_info=True))
    signature = FuncSignature.of(graph.mlir_func)
    roles = classify(graph)
    assert signature.result_names[roles.loss_result] == "result[0]"
    pairs = {signature.arg_names[a]: signature.result_names[r] for a, r in roles.state_pairs}
    state_args = [n for n in signature.arg_names if not n.startswith("batch")]
    assert len(pairs) == len(state_args) == len(graph.results) - 1
    for (
        arg,
        result,
    ) in pairs.items():  # params['a'] -> result[1]['a'], opt_state[1][0].mu['a'] -> result[2][1][0].mu['a']
        root, _, rest = arg.partition("[") if arg.startswith("params") else arg.partition("state")
        expected = "result[1][" + rest if arg.startswith("params") else "result[2]" + rest
        assert result == expected, (arg, result)
    assert [signature.arg_names[i] for i in batch_arguments(graph)] == ["batch[0]", "batch[1]"]


def test_donation_pairs_state_outright():
    """`tf.aliasing_output` (a donated argument whose buffer JAX reuses) is the pair, even
    where data flow alone would choose otherwise (a result that is a copy of another)."""

    def swap(a, b):
        return b + 0.0, a * 1.0

    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    module, graph = imported(jax.jit(swap, donate_argnums=(0, 1)).lower(spec, spec).as_text())
    aliases = FuncSignature.of(graph.mlir_func).aliases
    assert sorted(aliases) == [(0, 0), (1, 1)]  # JAX pairs donated buffers by type, in order
    assert state_pairs(graph) == ((0, 0), (1, 1))


def _power_iteration_step(params, state, x, y):
    """A spectral norm's step: `u`, `v` are updated by matrix-vector products of the weight,
    not elementwise from their old values (`v` does not even read the old `v`)."""
    w = params["w"]
    v = w.T @ state["u"]
    v = v / jnp.linalg.norm(v)
    u = w @ v
    u = u / jnp.linalg.norm(u)

    def loss_fn(params):
        sigma = jax.lax.stop_gradient(u @ params["w"] @ v)
        return jnp.mean((x @ (params["w"] / sigma).T - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return {"w": params["w"] - 0.1 * grads["w"]}, {"u": u, "v": v}, loss


def test_state_is_what_the_step_returns_as_an_arguments_new_value_whatever_computes_it():
    """Rule 4 of `state_pairs`: by pytree path. The batch is then the rest (before, u and v
    were batch candidates of another leading dim than x and y)."""
    f32 = jnp.float32
    args = (
        {"w": jax.ShapeDtypeStruct((4, 6), f32)},
        {"u": jax.ShapeDtypeStruct((4,), f32), "v": jax.ShapeDtypeStruct((6,), f32)},
        jax.ShapeDtypeStruct((8, 6), f32),
        jax.ShapeDtypeStruct((8, 4), f32),
    )
    module, graph = imported(jax.jit(_power_iteration_step, keep_unused=True).lower(*args).as_text(debug_info=True))
    # Arguments: w, u, v, x, y; results: w, u, v, loss.
    assert state_pairs(graph) == ((0, 0), (1, 1), (2, 2))
    assert batch_arguments(graph) == (3, 4)
    roles = classify(graph)
    assert roles.loss_result == 3 and roles.state_pairs == ((0, 0), (1, 1), (2, 2))


def test_a_path_shared_by_two_arguments_pairs_neither():
    """Two same-typed arguments whose paths end as the result's does, over as many keys: the
    pair is left open, never guessed."""

    def step(a, b, x):
        w = a["w"] @ b["w"]
        return {"w": w / jnp.linalg.norm(w)}, jnp.mean(x @ w)

    spec = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    module, graph = imported(jax.jit(step).lower({"w": spec}, {"w": spec}, spec).as_text(debug_info=True))
    assert state_pairs(graph) == ()


def test_several_leading_dims_name_the_candidates():
    def step(w, x, z):
        return jnp.mean(x @ w) + jnp.mean(z @ w), w

    args = (
        jax.ShapeDtypeStruct((4, 4), jnp.float32),
        jax.ShapeDtypeStruct((8, 4), jnp.float32),
        jax.ShapeDtypeStruct((6, 4), jnp.float32),
    )
    module, graph = imported(jax.jit(step).lower(*args).as_text(debug_info=True))
    with pytest.raises(
        RolesError,
        match=r"leading dim 6: argument 2 \(z\); leading dim 8: argument 1 \(x\).*"
        r"batch-args=",
    ):
        batch_arguments(graph, ((0, 1),))


def test_a_leading_dim_of_one_beside_the_batch_is_not_the_batch():
    """A (1,) value the loss reads (a loss scale, a freshly built counter) has nothing to
    split: the batch is the rest."""

    def step(w, x, scale):
        return jnp.mean(x @ w) * scale[0], w

    args = (
        jax.ShapeDtypeStruct((4, 4), jnp.float32),
        jax.ShapeDtypeStruct((8, 4), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.float32),
    )
    module, graph = imported(jax.jit(step).lower(*args).as_text())
    assert batch_arguments(graph, ((0, 1),)) == (1,)


# --------------------------------------------------------------------------- other programs


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_only_programs_are_all_forward(family):
    graph = loss_only(family)
    roles = classify(graph)
    assert roles.loss_result is None and not roles.is_training
    assert set(roles.roles) == {Role.FORWARD}


def test_inference_with_state_shaped_outputs_is_forward_only():
    def residual_block(x, w):
        return x + jnp.tanh(x @ w), jnp.sum(x)  # a result tied to x, a scalar not a loss

    spec = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    _module, graph = imported(jax.jit(residual_block).lower(spec, spec).as_text())
    roles = classify(graph)
    assert set(roles.roles) == {Role.FORWARD}


def test_value_and_grad_without_optimizer():
    step = get_train_step("mlp", "tiny")
    params, _, batch = step.abstract_args()
    grad_step = jax.jit(jax.value_and_grad(step.loss_fn))

    _module, plain = imported(grad_step.lower(params, batch).as_text())
    assert classify(plain).loss_result is None  # no state: looks like inference
    roles = classify(plain, loss_result=0)
    assert roles.loss_result == 0 and Role.UPDATE not in roles.roles
    assert Counter(roles.roles[op.index] for op in plain.ops if op.name in MATMULS) == {
        Role.FORWARD: 3,
        Role.BACKWARD: 5,
    }

    _named_module, named = imported(grad_step.lower(params, batch).as_text(debug_info=True))
    assert classify(named).loss_result == 0  # `transpose(` in the name stacks gives it away


def test_global_norm_clipping_belongs_to_the_update():
    step = get_train_step("mlp", "tiny")

    def clipped_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(step.loss_fn)(params, batch)
        leaves = jax.tree_util.tree_leaves(grads)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in leaves))
        scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
        grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        new_params, new_state = adam_update(grads, opt_state, params)
        return new_params, new_state, loss

    params, _, batch = step.abstract_args()
    opt_state = jax.eval_shape(init_adam, params)
    _module, graph = imported(jax.jit(clipped_step).lower(params, opt_state, batch).as_text())
    roles = classify(graph)
    squares = [
        op.index
        for op in graph.ops
        if op.name == "stablehlo.reduce"
        and graph.values[op.results[0]].shape == ()
        and roles.roles[op.index] is not Role.FORWARD
    ]
    assert len(squares) == 6  # one sum of squares per gradient
    assert all(roles.roles[i] is Role.UPDATE for i in squares)
    assert len(roles.gradients) == 6
    assert all(roles.roles[graph.values[v].producer] is Role.BACKWARD for v in roles.gradients)
    assert Counter(roles.roles[op.index] for op in graph.ops if op.name in MATMULS) == {
        Role.FORWARD: 3,
        Role.BACKWARD: 5,
    }


def test_loss_result_out_of_range_is_an_error():
    graph, _ = zoo("mlp")
    with pytest.raises(ValueError, match="out of range"):
        classify(graph, loss_result=len(graph.results))


# --------------------------------------------------------------------------- layers


def mlp_layers() -> tuple[FuncGraph, TrainingRoles, tuple[int, ...]]:
    """The tiny MLP with each forward op in the layer of the nearest forward dot before it."""
    graph, roles = zoo("mlp")
    forward_layer, layer = {}, 0
    seen = 0
    for i in roles.ops_with(Role.FORWARD):
        if graph.ops[i].name == "stablehlo.dot_general":
            layer, seen = seen, seen + 1
        forward_layer[i] = layer
    return graph, roles, layer_of_ops(graph, roles, forward_layer)


def test_mlp_backward_matmuls_follow_their_layer():
    graph, roles, layers = mlp_layers()
    kernels = [graph.values[graph.args[2 * k + 1]].shape for k in range(3)]  # params[k]['kernel']
    backward_dots = [
        op for op in graph.ops if op.name == "stablehlo.dot_general" and roles.roles[op.index] is Role.BACKWARD
    ]
    weight_gradients = 0
    for op in backward_dots:
        shape = graph.values[op.results[0]].shape
        owners = [k for k, kernel in enumerate(kernels) if shape in (kernel, kernel[::-1])]
        reads_kernel = [k for k in range(3) if graph.args[2 * k + 1] in op.operands]
        if reads_kernel:  # data gradient: the cotangent times W_k
            assert layers[op.index] == reads_kernel[0]
        else:  # weight gradient: W_k's shape (or its transpose)
            weight_gradients += 1
            assert len(owners) == 1 and layers[op.index] == owners[0]
    assert weight_gradients == 3


def test_mlp_update_ops_follow_the_parameter_they_update():
    graph, roles, layers = mlp_layers()
    # Results: params[k]['bias'|'kernel'] (0-5), count (6), mu (7-12), nu (13-18), loss.
    for k in range(3):
        for offset in (0, 7, 13):
            for leaf in (2 * k, 2 * k + 1):
                producer = graph.values[graph.results[offset + leaf]].producer
                assert roles.roles[producer] is Role.UPDATE and layers[producer] == k
    count = graph.values[graph.results[6]].producer
    assert layers[count] == 0  # the step counter feeds every layer's update: the first


def scope_order(graph: FuncGraph, roles: TrainingRoles) -> tuple[dict[int, int], list[str]]:
    """Forward layers from the zoo's `named_scope`s: the order in which scopes first appear
    (constants apart: canonicalization hoists them all to the top, the loss's among them)."""
    order: list[str] = []
    forward_layer = {}
    current = 0
    for i in range(len(graph.ops)):
        match = re.search(r"jvp\(([^)/]*)", name(graph, i))
        if match and "transpose(" not in name(graph, i) and graph.ops[i].name != "stablehlo.constant":
            if match[1] not in order:
                order.append(match[1])
            current = order.index(match[1])
        if roles.roles[i] is Role.FORWARD:
            forward_layer[i] = current
    return forward_layer, order


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_ops_follow_the_layer_jax_names_them_for(family):
    """The layer found by data flow (on the module without debug info) is the scope of the
    forward op JAX transposed, except for ops computed from constants alone (seeds)."""
    named, named_roles = zoo(family, debug_info=True)
    plain, plain_roles = zoo(family)
    assert [op.name for op in plain.ops] == [op.name for op in named.ops]
    forward_layer, order = scope_order(named, plain_roles)
    layers = layer_of_ops(plain, plain_roles, forward_layer)

    constant = [False] * len(plain.ops)
    for i, op in enumerate(plain.ops):
        producers = [plain.values[v].producer for v in op.operands]
        constant[i] = all(p is not None and constant[p] for p in producers)
    transposed = [i for i in range(len(plain.ops)) if "transpose(jvp(" in name(named, i)]
    checked = 0
    for i in transposed:
        match = re.search(r"transpose\(jvp\(([^)/]*)", name(named, i))
        # (Without names, the sum of a tied weight's two gradients is UPDATE.)
        if plain_roles.roles[i] is Role.BACKWARD and not constant[i] and match[1] in order:
            assert layers[i] == order.index(match[1]), (i, plain.ops[i].name, name(named, i))
            checked += 1
    assert checked > 0.8 * len(transposed)


def test_marked_layers_read_user_scopes():
    def model(x, w1, w2):
        with jax.named_scope("hlopar_layer_0"):
            h = jnp.tanh(x @ w1)
        with jax.named_scope("hlopar_layer_1"):
            return jnp.mean((h @ w2) ** 2)

    spec = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    step = jax.jit(jax.value_and_grad(model, argnums=(1, 2)))
    _module, graph = imported(step.lower(spec, spec, spec).as_text(debug_info=True))
    marks = marked_layers(graph)
    dots = [op.index for op in graph.ops if op.name == "stablehlo.dot_general"]
    assert marks is not None and all(i in marks for i in dots)
    assert sorted(Counter(marks[i] for i in dots).items()) == [(0, 2), (1, 3)]  # fwd + grads
    _plain_module, plain = imported(step.lower(spec, spec, spec).as_text())
    assert marked_layers(plain) is None
