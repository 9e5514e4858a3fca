"""What a training step reads and returns, from data flow alone: its state (argument -> new
value result), its batch arguments and its loss result. `training_roles.classify` starts from
them; the auto-sharding and stage-construction passes read them too.

Rules:

- **State** (`state_pairs`): a result is the new value of an argument of its type that it
  is computed from by elementwise ops (or is, unchanged); donation (`tf.aliasing_output`)
  pairs outright, JAX's pytree names and the fewest ops settle ties. A result left over is
  the new value of the argument its pytree path names, whatever computes it. Never by
  position: users return `(loss, params)` as often as `(params, loss)`.
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
"""

from __future__ import annotations

from hlopar.analysis.dataflow import (
    MATMUL_OPS,
    PASS_THROUGH_OPS,
    UPDATE_WALK_OPS,
    ancestors,
    name_stack,
    predecessors,
)
from hlopar.ir.collector import paused_gc
from hlopar.ir.graph import FuncGraph, callee_graph
from hlopar.ir.signature import FuncSignature, path_tokens

__all__ = [
    "RolesError",
    "batch_arguments",
    "batch_candidates",
    "find_loss",
    "is_random_key",
    "pick_loss",
    "state_pairs",
]

# The walk from a state result back to its argument.
_STATE_WALK_OPS = UPDATE_WALK_OPS | PASS_THROUGH_OPS


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
    4. A result still unpaired is the new value of the argument of its type whose pytree
       path ends as its own does (over the most keys; a tie pairs nothing), whatever
       computes it: the power-iteration vectors of a spectral norm are a matrix-vector
       product of the weight, not an elementwise function of their old value.

    The auto-sharding pass ties each pair to one layout.
    """
    with paused_gc():
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
            preds = preds or predecessors(graph)
            read = {v for op in ancestors(preds, values[value].producer) for v in graph.reads(op)}
            keys = [i for i in keys if args[i] in read]
        if len(keys) == 1:
            pairs[r] = keys[0]
            taken.add(keys[0])
    _pair_by_paths(values, args, results, pairs, taken, arg_tails, result_tails)
    return tuple(sorted((arg, result) for result, arg in pairs.items()))


def _pair_by_paths(values, args, results, pairs: dict, taken: set, arg_tails: list, result_tails: list) -> None:
    """Rule 4 of `state_pairs`: a result still unpaired is the new value of the argument of
    its type whose pytree path ends as its own does, over more keys than any other such
    argument's, whatever computes it (a power iteration's vectors, a reset counter). A tie
    pairs nothing (the batch's candidates then name both, `batch_arguments`)."""
    free = [i for i in range(len(args)) if i not in taken]
    for r, value in enumerate(results):
        if r in pairs or r >= len(result_tails) or not result_tails[r]:
            continue
        scored = {}
        for i in free:
            if i not in taken and i < len(arg_tails) and values[args[i]].type == values[value].type:
                common = _common_tail(arg_tails[i], result_tails[r])
                if common:
                    scored.setdefault(common, []).append(i)
        if scored:
            best = scored[max(scored)]
            if len(best) == 1:
                pairs[r] = best[0]
                taken.add(best[0])


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
    xors), and, beside others, not of leading dim 1 (nothing to split). Raises `RolesError`
    naming the candidates when they have several leading dims."""
    with paused_gc():
        return _batch_arguments(graph, state_pairs(graph) if pairs is None else pairs)


def _batch_arguments(graph: FuncGraph, pairs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    candidates = batch_candidates(graph, pairs)
    values = graph.values
    groups: dict[int | None, list[int]] = {}
    for i in candidates:
        groups.setdefault(values[graph.args[i]].shape[0], []).append(i)
    if len(groups) > 1:
        groups.pop(1, None)  # a (1, ...) value beside a batch (a loss scale, a fresh counter) is not one
    if len(groups) <= 1:
        return tuple(i for group in groups.values() for i in group)
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
    preds = predecessors(graph)
    loss = pick_loss(graph, pairs, preds)
    if loss is not None:  # the batch is what the loss is computed from
        producer = values[graph.results[loss]].producer
        read = {v for op in ancestors(preds, producer) for v in graph.reads(op)}
        candidates = [i for i in candidates if graph.args[i] in read]
    return candidates


_RANDOM_BIT_OPS = frozenset({"stablehlo.xor", "stablehlo.shift_left", "stablehlo.shift_right_logical"})


def is_random_key(graph: FuncGraph, arg: int, depth: int = 0) -> bool:
    """Whether argument `arg` is a random key: 32-bit unsigned words (threefry's key data,
    raw or typed) that reach the generator's rotations (shifts and xors), in this function
    or in the private functions it calls (JAX lowers `jax.random` as calls to
    `@_uniform`, `@threefry2x32`, ... that `hlopar-import` inlines)."""
    value = graph.values[graph.args[arg]]
    if value.dtype != "ui32":
        return False
    stack, seen = [graph.args[arg]], {graph.args[arg]}
    while stack and len(seen) < 256:
        vid = stack.pop()
        for user in graph.values[vid].users:
            op = graph.ops[user]
            if any(inner.name in _RANDOM_BIT_OPS for inner in op.walk()):
                return True
            if op.name == "func.call" and depth < 8:
                callee = callee_graph(graph, op)
                if callee is not None and any(
                    is_random_key(callee, k, depth + 1) for k, v in enumerate(op.operands) if v == vid
                ):
                    return True
            for v in op.results:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
    return False


def find_loss(graph: FuncGraph) -> int | None:
    """The result number of the loss, or None for a forward-only program (rules in the module
    docstring)."""
    with paused_gc():
        return pick_loss(graph, state_pairs(graph), predecessors(graph))


def pick_loss(graph: FuncGraph, pairs: tuple[tuple[int, int], ...], preds: list[list[int]]) -> int | None:
    """`find_loss` given the state pairs and the predecessors of every op."""
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
    if not others and not any("transpose(" in (name_stack(graph, i) or "") for i in range(len(graph.ops))):
        return None
    # The loss of a model worth the name goes through its matmuls: a scalar that does not
    # (a metric of the input) is no loss when the program has matmuls elsewhere.
    matmuls = [op.name in MATMUL_OPS for op in graph.ops]
    state_side = ancestors(preds, *(graph.values[graph.results[result]].producer for _, result in pairs))
    names = FuncSignature.of(graph.mlir_func).result_names
    least = 1 if any(matmuls) else 0
    ancestry = {}
    for number in candidates:
        producer = graph.values[graph.results[number]].producer
        ancestry[number] = ancestors(preds, producer) if producer is not None else set()
    backward = state_side.difference(*ancestry.values())
    best, best_key = None, None
    for number in candidates:
        upstream = ancestry[number]
        count = sum(1 for i in upstream if matmuls[i])
        if count < least:
            continue
        # The scalar the gradients are taken of: some of its forward ops are residuals the
        # backward reads (the softmax of a cross-entropy, the error of a squared loss); a
        # metric beside it (an accuracy, a norm of the logits) shares the model's forward
        # but the backward reads nothing that is its own. Then the matmuls it goes
        # through, then the name the user gave it.
        residuals = sum(1 for i in upstream if any(u in backward for u in graph.successors(i)))
        name = names[number] if number < len(names) else None
        key = (residuals, count, bool(name) and "loss" in name.lower())
        if best_key is None or key > best_key:
            best, best_key = number, key
    return best


def _updates_itself(graph: FuncGraph, arg: int, value: int) -> bool:
    """Whether `value` is `arg` or is computed from it by elementwise ops (a state update)."""
    return bool(_elementwise_distances(graph, value, {arg: 0}))
