"""Forward, backward and optimizer-update ops of a training step, from data flow alone.

Pipeline planning (Alpa §5) clusters the *forward* ops into layers and lets every backward
and update op follow the layer it belongs to, so that a stage's forward and backward run
on one mesh and each parameter is updated where it lives. JAX exports a training step such as

    step(params, opt_state, batch) -> (new_params, new_opt_state, loss)

(in any order and nesting) as one flat function with no markers: this module finds the three parts by data flow, and
uses JAX's name stacks (`jvp(...)` forward, `transpose(jvp(...))` backward) only to refine
when the module carries them.

Rules (`classify`):

- **State** (`state_pairs`): a result is the new value of an argument of its type that it
  is computed from by elementwise ops (or is, unchanged); donation (`tf.aliasing_output`)
  pairs outright, JAX's pytree names and the fewest ops settle ties. Never by position:
  users return `(loss, params)` as often as `(params, loss)`.
- **Batch** (`batch_arguments`): the arguments the loss is computed from that are not
  state, not scalars and not random keys (`is_random_key`).
- **Loss**: the rank-0 floating-point result that is not state (a rank-0 float result tied
  to an argument still counts as a loss candidate when its elementwise producers never
  reach that argument: state updates do, a loss does not). With several candidates (a
  loss beside metrics), the one some of whose own forward ops the backward reads
  (residuals: a metric shares the model's forward but the backward reads nothing of its
  own), then the one with the most dot_general/convolution ancestors, then the one JAX
  names `loss`; none of them when the program has matmuls but no candidate depends on one
  (`sum(x)` next to a residual block `x + f(x)` is a metric of an inference program, not
  a loss). With no candidate, or with no state left besides the loss and no `transpose(`
  in any name stack (a `value_and_grad` step without an optimizer has those), the program
  is forward-only: all FORWARD, no loss.
- **FORWARD**: the loss's producer and its ancestors (top-level ops). With name stacks,
  also the linearization residuals JAX computes on the forward side but only the backward
  reads (ReLU masks, GELU derivatives): ops named `jvp(` but not `transpose(` whose every
  input is forward. Without name stacks those are BACKWARD: the backward's seed is a
  folded constant, so nothing in the data flow tells a residual from the first backward op.
- **UPDATE**: walking back from the state results, the non-forward elementwise ops
  (arithmetic, compare/select, convert, broadcast_in_dim, constants) all of whose uses are
  update ops or state results: the optimizer's arithmetic. The walk stops at anything else
  (dot_general, reduce, transpose, reshape, scatter, ...): those produce the gradients.
  Then the ops computed from gradients, update values, arguments and constants alone that
  only feed update ops join too, which brings in the reductions of global-norm gradient
  clipping (sum of squared gradients): the norm is the optimizer's business, not the
  model's. Adam's step counter (`count + 1`, the bias corrections) is elementwise on
  state: UPDATE. With name stacks, ops named `jvp(` or `transpose(` are never UPDATE (the
  sum of two gradient contributions of a tied weight is then BACKWARD; without names it
  is UPDATE, being elementwise and feeding only the optimizer).
- **BACKWARD**: every other op.

Known limits: state a forward op writes directly (an RNG key split in the forward and
returned) stays FORWARD; a loss computed inside a loop over microbatches makes that loop
FORWARD as a whole; a returned metric that is not an ancestor of the loss is BACKWARD
without name stacks.

`layer_of_ops` then spreads the layers of the forward ops to all ops (rules in its
docstring); `marked_layers` reads user markers (`jax.named_scope("hlopar_layer_<n>")`).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hlopar.ir.graph import FuncGraph
from hlopar.ir.signature import FuncSignature, path_tokens


class Role(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclass(frozen=True)
class TrainingRoles:
    """The role of every top-level op (by op index), and what the step reads and writes."""

    roles: tuple[Role, ...]
    loss_result: int | None  # result number of the loss; None for a forward-only program
    state_pairs: tuple[tuple[int, int], ...]  # (argument number, result number) of each state
    # Value ids computed by BACKWARD ops and read by UPDATE ops: the gradients (what a
    # pipeline accumulates over microbatches before the update runs once).
    gradients: tuple[int, ...] = ()

    @property
    def is_training(self) -> bool:
        return self.loss_result is not None

    def ops_with(self, role: Role) -> tuple[int, ...]:
        """Indices of the top-level ops with `role`, in program order."""
        return tuple(i for i, r in enumerate(self.roles) if r is role)


# Elementwise ops (and the ops that make or spread values for them): the optimizer's
# arithmetic on parameter-shaped tensors and the scalars it broadcasts.
ELEMENTWISE_OPS = frozenset(
    "stablehlo." + name
    for name in (
        "abs cbrt ceil convert count_leading_zeros cosine exponential exponential_minus_one floor imag "
        "is_finite log log_plus_one logistic not negate popcnt real round_nearest_afz round_nearest_even "
        "rsqrt sign sine sqrt tan tanh reduce_precision add atan2 complex divide maximum minimum "
        "multiply or power remainder shift_left shift_right_arithmetic shift_right_logical subtract xor "
        "and compare clamp select"
    ).split()
)
CONSTANT_OPS = frozenset({"stablehlo.constant", "stablehlo.iota"})
_UPDATE_WALK_OPS = ELEMENTWISE_OPS | CONSTANT_OPS | {"stablehlo.broadcast_in_dim"}
# Ops whose results are their operands unchanged (a typed key's sharding constraint).
PASS_THROUGH_OPS = frozenset({"sdy.sharding_constraint", "sdy.reshard", "stablehlo.optimization_barrier"})
_STATE_WALK_OPS = _UPDATE_WALK_OPS | PASS_THROUGH_OPS
_MATMUL_OPS = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})
_MARKER = re.compile(r"hlopar_layer_(\d+)")


# --------------------------------------------------------------------------- state and loss


class RolesError(ValueError):
    """A role the data flow leaves open (two batches, two losses): the message names the
    candidates and the option that settles it."""


def state_pairs(graph: FuncGraph) -> tuple[tuple[int, int], ...]:
    """(argument number, result number) of every piece of state: the result is the new value
    of the argument. Found from data flow, whatever the order and nesting of arguments and
    results:

    1. JAX's donation (`tf.aliasing_output`: the user donated the argument and JAX reuses
       its buffer for that result) pairs them outright.
    2. Otherwise a result is the new value of an argument of its type that it is computed
       from by elementwise ops alone (the optimizer's arithmetic, a step counter's `+ 1`, a
       running average, the argument returned unchanged). Parameters, Adam's moments and
       the count all reach several same-typed arguments that way (a parameter's update
       reads its moments), so the pairs are chosen greedily by, in order: the longest
       common tail of the two pytree paths JAX names them by (`params['w']` and
       `result[1]['w']`), the fewest elementwise ops between them, then program order.
    3. A random key result pairs with the one key argument of its type it is drawn from.

    The auto-sharding pass ties each pair to one layout.
    """
    with _paused_gc():
        return _state_pairs(graph)


def _state_pairs(graph: FuncGraph) -> tuple[tuple[int, int], ...]:
    signature = FuncSignature.of(graph.mlir_func)
    values = graph.values
    args, results = graph.args, graph.results
    pairs = {}
    for arg, result in signature.aliases:
        if arg < len(args) and result < len(results) and values[args[arg]].type == values[results[result]].type:
            pairs[result] = arg
    taken = set(pairs.values())
    by_type: dict = {}
    for i, a in enumerate(args):
        if i not in taken:
            by_type.setdefault(values[a].type, []).append(i)
    arg_tails = [path_tokens(name) for name in signature.arg_names]
    result_tails = [path_tokens(name) for name in signature.result_names]
    edges = []
    for r, value in enumerate(results):
        if r in pairs:
            continue
        same_type = by_type.get(values[value].type)
        if not same_type:
            continue
        distance = _elementwise_distances(graph, value, {args[i]: i for i in same_type})
        for i, hops in distance.items():
            common = _common_tail(
                arg_tails[i] if i < len(arg_tails) else (), result_tails[r] if r < len(result_tails) else ()
            )
            edges.append((-common, hops, r, i))
    for _, _, r, i in sorted(edges):
        if r not in pairs and i not in taken:
            pairs[r] = i
            taken.add(i)
    # A new random key is drawn from the old one by threefry (slices of its output, not
    # elementwise): a key result pairs with the one key argument of its type it reads.
    preds = None
    for r, value in enumerate(results):
        if r in pairs or values[value].dtype != "ui32":
            continue
        keys = [i for i in by_type.get(values[value].type, ()) if i not in taken and is_random_key(graph, i)]
        if keys:
            preds = preds or _predecessors(graph)
            read = {v for op in _ancestors(preds, values[value].producer) for v in graph.reads(op)}
            keys = [i for i in keys if args[i] in read]
        if len(keys) == 1:
            pairs[r] = keys[0]
            taken.add(keys[0])
    return tuple(sorted((arg, result) for result, arg in pairs.items()))


def _elementwise_distances(graph: FuncGraph, value: int, targets: dict[int, int]) -> dict[int, int]:
    """Argument number -> the fewest elementwise ops from an argument in `targets` (value id
    -> argument number) to `value` (0: returned as it is)."""
    found: dict[int, int] = {}
    frontier, seen, hops = [value], {value}, 0
    while frontier and len(found) < len(targets):
        following = []
        for v in frontier:
            if v in targets:
                found.setdefault(targets[v], hops)
            producer = graph.values[v].producer
            if producer is None or graph.ops[producer].name not in _STATE_WALK_OPS:
                continue
            for operand in graph.ops[producer].operands:
                if operand not in seen:
                    seen.add(operand)
                    following.append(operand)
        frontier, hops = following, hops + 1
    return found


def _common_tail(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def batch_arguments(graph: FuncGraph, pairs: tuple[tuple[int, int], ...] | None = None) -> tuple[int, ...]:
    """The arguments that hold the batch, from data flow: what the loss is computed from
    (every argument, in a program without a loss) that is not training state, not a scalar
    (a learning rate), not a random key (unsigned words that feed threefry's shifts and
    xors). Raises `RolesError` naming the candidates when they have several leading dims."""
    with _paused_gc():
        return _batch_arguments(graph, state_pairs(graph) if pairs is None else pairs)


def _batch_arguments(graph: FuncGraph, pairs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    candidates = batch_candidates(graph, pairs)
    values = graph.values
    groups: dict[int | None, list[int]] = {}
    for i in candidates:
        groups.setdefault(values[graph.args[i]].shape[0], []).append(i)
    if len(groups) <= 1:
        return tuple(candidates)
    signature = FuncSignature.of(graph.mlir_func)
    listed = "; ".join(
        f"leading dim {size}: " + ", ".join(signature.arg(i) for i in group)
        for size, group in sorted(groups.items(), key=lambda item: str(item[0]))
    )
    raise RolesError(
        f"the arguments that are not training state have different leading dims ({listed}): "
        "name the batch with batch-args=..."
    )


def batch_candidates(graph: FuncGraph, pairs: tuple[tuple[int, int], ...]) -> list[int]:
    """The arguments that may hold the batch (`batch_arguments` before it checks that they
    agree on a leading dim)."""
    state = {arg for arg, _ in pairs}
    values = graph.values
    candidates = [
        i for i, a in enumerate(graph.args) if i not in state and values[a].shape and not is_random_key(graph, i)
    ]
    preds = _predecessors(graph)
    loss = _find_loss(graph, pairs, preds)
    if loss is not None:  # the batch is what the loss is computed from
        producer = values[graph.results[loss]].producer
        read = {v for op in _ancestors(preds, producer) for v in graph.reads(op)}
        candidates = [i for i in candidates if graph.args[i] in read]
    return candidates


_RANDOM_BIT_OPS = frozenset({"stablehlo.xor", "stablehlo.shift_left", "stablehlo.shift_right_logical"})


def is_random_key(graph: FuncGraph, arg: int) -> bool:
    """Whether argument `arg` is a random key: 32-bit unsigned words (threefry's key data,
    raw or typed) that reach the generator's rotations (shifts and xors)."""
    value = graph.values[graph.args[arg]]
    if value.dtype != "ui32":
        return False
    stack, seen = [graph.args[arg]], {graph.args[arg]}
    while stack and len(seen) < 256:
        for user in graph.values[stack.pop()].users:
            op = graph.ops[user]
            if any(inner.name in _RANDOM_BIT_OPS for inner in op.walk()):
                return True
            for v in op.results:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
    return False


def find_loss(graph: FuncGraph) -> int | None:
    """The result number of the loss, or None for a forward-only program (module docstring)."""
    with _paused_gc():
        return _find_loss(graph, state_pairs(graph), _predecessors(graph))


def _find_loss(graph: FuncGraph, pairs: tuple[tuple[int, int], ...], preds: list[list[int]]) -> int | None:
    tied = {result: arg for arg, result in pairs}
    candidates = []
    for number, value in enumerate(graph.results):
        info = graph.values[value]
        if info.shape != () or not info.dtype.startswith(("f", "bf")):
            continue
        arg = tied.get(number)
        if arg is None or not _updates_itself(graph, graph.args[arg], value):
            candidates.append(number)
    if not candidates:
        return None
    others = [result for _, result in pairs if result not in candidates]
    if not others and not any("transpose(" in (_name(graph, i) or "") for i in range(len(graph.ops))):
        return None
    # The loss of a model worth the name goes through its matmuls: a scalar that does not
    # (a metric of the input) is no loss when the program has matmuls elsewhere.
    matmuls = [op.name in _MATMUL_OPS for op in graph.ops]
    state_side = _ancestors(preds, *(graph.values[graph.results[result]].producer for _, result in pairs))
    names = FuncSignature.of(graph.mlir_func).result_names
    least = 1 if any(matmuls) else 0
    ancestry = {}
    for number in candidates:
        producer = graph.values[graph.results[number]].producer
        ancestry[number] = _ancestors(preds, producer) if producer is not None else set()
    backward = state_side.difference(*ancestry.values())
    best, best_key = None, None
    for number in candidates:
        ancestors = ancestry[number]
        count = sum(1 for i in ancestors if matmuls[i])
        if count < least:
            continue
        # The scalar the gradients are taken of: some of its forward ops are residuals the
        # backward reads (the softmax of a cross-entropy, the error of a squared loss); a
        # metric beside it (an accuracy, a norm of the logits) shares the model's forward
        # but the backward reads nothing that is its own. Then the matmuls it goes
        # through, then the name the user gave it.
        residuals = sum(1 for i in ancestors if any(u in backward for u in graph.successors(i)))
        name = names[number] if number < len(names) else None
        key = (residuals, count, bool(name) and "loss" in name.lower())
        if best_key is None or key > best_key:
            best, best_key = number, key
    return best


def _updates_itself(graph: FuncGraph, arg: int, value: int) -> bool:
    """Whether `value` is `arg` or is computed from it by elementwise ops (a state update)."""
    return bool(_elementwise_distances(graph, value, {arg: 0}))


# --------------------------------------------------------------------------- classification


def classify(graph: FuncGraph, *, loss_result: int | None = None) -> TrainingRoles:
    """The role of every top-level op of a training step (rules in the module docstring).

    `loss_result` names the loss when the caller knows it (a `value_and_grad` function
    without state, a loss that is not rank 0); otherwise it is found.
    """
    if loss_result is not None and not 0 <= loss_result < len(graph.results):
        raise ValueError(f"loss result {loss_result} out of range: the function has {len(graph.results)} results")
    with _paused_gc():
        return _classify(graph, loss_result)


def _classify(graph: FuncGraph, loss_result: int | None) -> TrainingRoles:
    n = len(graph.ops)
    pairs = state_pairs(graph)
    preds = _predecessors(graph)
    if loss_result is None:
        loss_result = _find_loss(graph, pairs, preds)
    if loss_result is None:
        return TrainingRoles((Role.FORWARD,) * n, None, pairs, ())
    pairs = tuple(pair for pair in pairs if pair[1] != loss_result)

    forward = [False] * n
    producer = graph.values[graph.results[loss_result]].producer
    if producer is not None:
        for i in _ancestors(preds, producer):
            forward[i] = True
    _add_residuals(graph, preds, forward)
    update = _update_ops(graph, preds, forward, pairs)

    roles = tuple(Role.FORWARD if forward[i] else Role.UPDATE if update[i] else Role.BACKWARD for i in range(n))
    return TrainingRoles(roles, loss_result, pairs, _gradients(graph, roles))


def _add_residuals(graph: FuncGraph, preds: list[list[int]], forward: list[bool]) -> None:
    """Marks FORWARD the `jvp(` ops (not `transpose(`) whose inputs are all forward or
    constants, then the constants that only they read."""
    ops = graph.ops
    added = False
    for i in range(len(ops)):
        if forward[i] or not all(forward[p] or ops[p].name in CONSTANT_OPS for p in preds[i]):
            continue
        name = _name(graph, i)
        if name is not None and "jvp(" in name and "transpose(" not in name:
            forward[i] = added = True
    if added:
        for i, op in enumerate(ops):
            if not forward[i] and op.name in CONSTANT_OPS:
                users = [u for v in op.results for u in graph.values[v].users]
                forward[i] = bool(users) and all(forward[u] for u in users)


def _update_ops(
    graph: FuncGraph, preds: list[list[int]], forward: list[bool], pairs: tuple[tuple[int, int], ...]
) -> list[bool]:
    ops, values = graph.ops, graph.values
    n = len(ops)
    state = {graph.results[result] for _, result in pairs}
    other = set(graph.results) - state
    update = [False] * n

    def feeds_only_update(i: int) -> bool:
        used = False
        for v in ops[i].results:
            if v in other:
                return False
            if v in state:
                used = True
            for user in values[v].users:
                if not update[user]:
                    return False
                used = True
        return used

    def model_named(i: int) -> bool:
        name = _name(graph, i)
        return name is not None and ("jvp(" in name or "transpose(" in name)

    # The optimizer's elementwise arithmetic, walking back from the state results.
    for i in range(n - 1, -1, -1):
        if not forward[i] and ops[i].name in _UPDATE_WALK_OPS and feeds_only_update(i) and not model_named(i):
            update[i] = True
    # Then what is computed from gradients (the ops the walk stopped at), update values,
    # arguments and constants alone, when it only feeds the update: norms for clipping.
    allowed = [update[i] or ops[i].name in CONSTANT_OPS for i in range(n)]
    for i in range(n):
        if update[i]:
            for p in preds[i]:
                allowed[p] = True
    derived = []
    for i in range(n):
        if not forward[i] and not update[i] and all(allowed[p] for p in preds[i]):
            derived.append(i)
            allowed[i] = True
    for i in reversed(derived):
        if feeds_only_update(i) and not model_named(i):
            update[i] = True
    return update


def _gradients(graph: FuncGraph, roles: tuple[Role, ...]) -> tuple[int, ...]:
    found = set()
    values = graph.values
    for i, role in enumerate(roles):
        if role is not Role.UPDATE:
            continue
        for op in graph.ops[i].walk():
            for v in op.operands:
                p = values[v].producer
                if p is not None and p != i and roles[p] is Role.BACKWARD and graph.ops[p].name not in CONSTANT_OPS:
                    found.add(v)
    return tuple(sorted(found))


# --------------------------------------------------------------------------- layers


def layer_of_ops(graph: FuncGraph, roles: TrainingRoles, forward_layer: Mapping[int, int]) -> tuple[int, ...]:
    """The layer of every top-level op, given the layer of the FORWARD ops.

    - FORWARD ops keep `forward_layer[i]`.
    - BACKWARD ops, in program order (the backward runs from the last layer to the
      first): the transpose of a forward op reads that op's inputs (residuals) and the
      cotangent of its output. So each backward op gets the *cotangent layer* t, the
      smallest layer of the backward ops whose values it reads, and the *candidate
      layers* S: for every forward value or argument it reads, the layers of the forward
      ops that read that value too, and of the forward op that made it. With both, the
      candidate closest to t (the larger on a tie); with only S, its largest (a
      residual belongs to the last layer that uses its input); with only t, t. So the
      weight gradient of layer k, which reads layer k's input (made by layer k-1, read
      by layer k) and the cotangent of layer k, lands in layer k; a U-Net skip read by
      layers 1 and 7 goes to whichever the cotangent is coming from.
      Values computed from constants alone are no evidence, wherever they sit.
    - UPDATE ops: the layer of the parameter they update, i.e. of the first forward op
      reading the argument of their state pair; ops feeding several state updates (Adam's
      moments feed the parameter update, the step counter feeds all) take the smallest
      layer among their update users.
    - BACKWARD ops that read nothing forward and reach, through such ops only, the
      update of one layer's parameters take that layer: a bias gradient (a sum of the
      output's cotangent, made by the next layer) belongs with its bias. Every backward
      value ends in some gradient, so a path through a backward op that read forward
      values (which has a layer of its own) does not count.
    - Ops with no evidence (constants, seeds, state no forward op reads) take the
      smallest layer among their users, else among their producers, else 0.
    - Last, `consistent_layers` moves the backward ops these rules put where the pipeline
      cannot run them (a bias gradient placed with its bias while the checkpointed block's
      barrier it reads sits a layer below) and the ops computed from constants alone.

    Checked against JAX's name stacks on the zoo: every backward op named
    `transpose(jvp(<scope>))` lands in `<scope>`'s layer, except scalar seeds computed
    from constants alone, which follow their users.
    """
    with _paused_gc():
        return _layer_of_ops(graph, roles, forward_layer)


def _layer_of_ops(graph: FuncGraph, roles: TrainingRoles, forward_layer: Mapping[int, int]) -> tuple[int, ...]:
    ops, values = graph.ops, graph.values
    n = len(ops)
    role_of = roles.roles
    preds = _predecessors(graph)
    constant = _constant_derived(graph, preds)
    layer: list[int | None] = [None] * n
    for i, role in enumerate(role_of):
        if role is Role.FORWARD:
            layer[i] = forward_layer.get(i)

    def forward_readers(v: int) -> list[int]:
        return [layer[u] for u in values[v].users if role_of[u] is Role.FORWARD and layer[u] is not None]

    # Backward ops, from what they read.
    from_forward = [False] * n
    for i in range(n):
        if role_of[i] is not Role.BACKWARD:
            continue
        candidates: set[int] = set()
        cotangent = None
        for v in graph.reads(i):
            p = values[v].producer
            if p is not None and constant[p]:
                continue  # a constant says nothing about layers, wherever it sits
            if p is None or role_of[p] is Role.FORWARD:
                candidates.update(forward_readers(v))
                if p is not None and layer[p] is not None:
                    candidates.add(layer[p])
            elif layer[p] is not None:
                cotangent = layer[p] if cotangent is None else min(cotangent, layer[p])
        from_forward[i] = bool(candidates)
        if cotangent is not None and candidates:
            layer[i] = min(candidates, key=lambda s: (abs(s - cotangent), -s))
        elif candidates:
            layer[i] = max(candidates)
        else:
            layer[i] = cotangent

    # Update ops, from the parameter they update.
    parameter_layer = {}
    for arg, result in roles.state_pairs:
        readers = [u for u in values[graph.args[arg]].users if role_of[u] is Role.FORWARD and layer[u] is not None]
        if readers:
            parameter_layer[graph.results[result]] = layer[min(readers)]
    for i in range(n - 1, -1, -1):
        if role_of[i] is not Role.UPDATE:
            continue
        found = [parameter_layer[v] for v in ops[i].results if v in parameter_layer]
        found += [
            layer[u]
            for v in ops[i].results
            for u in values[v].users
            if role_of[u] is Role.UPDATE and layer[u] is not None
        ]
        if found:
            layer[i] = min(found)

    # Backward ops that read nothing forward and only feed, through such ops, the update
    # of one layer's parameters (a bias gradient: a sum of the output's cotangent)
    # belong to that layer. Every backward value ends in some gradient: the path must
    # not go through a backward op that read forward values, which has its own layer.
    returned = set(graph.results)
    only_for: list[int | None] = [None] * n
    for i in range(n - 1, -1, -1):
        if role_of[i] is Role.UPDATE:
            only_for[i] = layer[i]
        elif role_of[i] is Role.BACKWARD and not from_forward[i] and not any(v in returned for v in ops[i].results):
            targets = {only_for[u] for u in graph.successors(i)}
            if len(targets) == 1:
                only_for[i] = targets.pop()
                if only_for[i] is not None:
                    layer[i] = only_for[i]

    # Ops with no evidence: from their users, else their producers.
    for i in range(n - 1, -1, -1):
        if layer[i] is None:
            found = [layer[u] for u in graph.successors(i) if layer[u] is not None]
            if found:
                layer[i] = min(found)
    for i in range(n):
        if layer[i] is None:
            found = [layer[p] for p in preds[i] if layer[p] is not None]
            layer[i] = min(found) if found else 0
    return consistent_layers(role_of, preds, layer, constant)


def consistent_layers(
    roles: Sequence[Role], reads: Sequence[Sequence[int]], layers: Sequence[int], free: Sequence[bool]
) -> tuple[int, ...]:
    """`layers` (one per op, in program order) moved as little as the pipeline needs.

    A pipeline runs the forward of layers 0..L-1, then the backward of L-1..0, then the
    updates. So a backward op of layer l may read backward values of layers >= l only (a
    value of a lower layer is made after it runs), and should read forward values of layers
    <= l only (a later layer's forward value would travel back against the pipeline).
    `reads[i]`: the ops whose values op i reads (all before i); `free[i]`: op i computes
    from constants alone, so it can sit in any layer. Three passes, each a fixpoint in one
    sweep because every read points back in program order:

    1. each backward op is lowered to the smallest layer of the backward values it reads
       (it cannot run before its cotangents are made);
    2. then raised to the largest layer of the forward values it reads and of the backward
       ops that read it (these lower bounds only ever push producers up: the result is the
       least assignment above step 1's that satisfies both rules);
    3. a free forward op goes to the smallest layer among its forward and backward readers,
       a free backward op to the largest among its backward readers.

    Forward and update ops that are not free keep their layers (clustering orders the
    forward by program order; updates run last and may read any layer).
    """
    n = len(layers)
    layer = list(layers)
    readers: list[list[int]] = [[] for _ in range(n)]
    for i, producers in enumerate(reads):
        for p in producers:
            readers[p].append(i)
    backward = [roles[i] is Role.BACKWARD and not free[i] for i in range(n)]
    forward = [roles[i] is Role.FORWARD and not free[i] for i in range(n)]
    for i in range(n):
        if backward[i]:
            layer[i] = min([layer[i]] + [layer[p] for p in reads[i] if backward[p]])
    for i in range(n - 1, -1, -1):
        if backward[i]:
            layer[i] = max(
                [layer[i]] + [layer[p] for p in reads[i] if forward[p]] + [layer[u] for u in readers[i] if backward[u]]
            )
    for i in range(n - 1, -1, -1):
        if free[i] and roles[i] is Role.FORWARD:
            found = [layer[u] for u in readers[i] if roles[u] is not Role.UPDATE]
            layer[i] = min(found, default=layer[i])
        elif free[i] and roles[i] is Role.BACKWARD:
            layer[i] = max((layer[u] for u in readers[i] if roles[u] is Role.BACKWARD), default=layer[i])
    return tuple(layer)


def marked_layers(graph: FuncGraph) -> dict[int, int] | None:
    """Op index → N for the ops whose name stack holds a `hlopar_layer_<N>` scope (the
    innermost one when nested): the user's own layer boundaries, from
    `jax.named_scope("hlopar_layer_<N>")`. None when no op carries a marker."""
    found = {}
    for i in range(len(graph.ops)):
        name = _name(graph, i)
        if name is not None and "hlopar_layer_" in name:
            found[i] = int(_MARKER.findall(name)[-1])
    return found or None


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _paused_gc() -> Iterator[None]:
    """The passes make a few small lists per op and free none: the cyclic collector would
    rescan the graph's hundred thousand objects again and again for nothing (as when the
    graph is built)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _name(graph: FuncGraph, i: int) -> str | None:
    """The JAX name stack of top-level op `i`, e.g. "jit(step)/transpose(jvp(layer_3))/dot_general"."""
    location = graph.ops[i].location
    return None if location is None else location.name


def _predecessors(graph: FuncGraph) -> list[list[int]]:
    """Per top-level op, the top-level ops whose results it reads (nested reads included)."""
    preds: list[list[int]] = [[] for _ in graph.ops]
    for value in graph.values:
        p = value.producer
        if p is None:
            continue
        for user in value.users:
            if user != p:
                preds[user].append(p)
    return preds


def _ancestors(preds: list[list[int]], *starts: int | None) -> set[int]:
    """The `starts` (None: an argument) and every top-level op they depend on."""
    seen = {start for start in starts if start is not None}
    stack = list(seen)
    while stack:
        for p in preds[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _constant_derived(graph: FuncGraph, preds: list[list[int]]) -> list[bool]:
    """Per top-level op, whether it computes from constants alone (no argument reaches it)."""
    values = graph.values
    derived = [False] * len(graph.ops)
    for i in range(len(graph.ops)):
        derived[i] = all(derived[p] for p in preds[i]) and not any(values[v].is_arg for v in graph.reads(i))
    return derived
