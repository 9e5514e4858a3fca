"""Forward, backward and optimizer-update ops of a training step, from data flow alone.

Pipeline planning (Alpa §5) clusters the *forward* ops into layers and lets every backward
and update op follow the layer it belongs to, so that a stage's forward and backward run
on one mesh and each parameter is updated where it lives. JAX exports a training step such as

    step(params, opt_state, batch) -> (new_params, new_opt_state, loss)

(in any order and nesting) as one flat function with no markers: this module finds the three
parts by data flow, and uses JAX's name stacks (`jvp(...)` forward, `transpose(jvp(...))`
backward) only to refine when the module carries them.

Rules (`classify`), after `step_io` found the state, the batch and the loss:

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

`op_layers.layer_of_ops` then spreads the layers of the forward ops to all ops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hlopar.analysis.dataflow import CONSTANT_OPS, UPDATE_WALK_OPS, ancestors, name_stack, predecessors
from hlopar.analysis.step_io import pick_loss, state_pairs
from hlopar.ir.collector import paused_gc
from hlopar.ir.graph import FuncGraph

__all__ = ["Role", "TrainingRoles", "classify"]


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


def classify(graph: FuncGraph, *, loss_result: int | None = None) -> TrainingRoles:
    """The role of every top-level op of a training step (rules in the module docstring).

    `loss_result` names the loss when the caller knows it (a `value_and_grad` function
    without state, a loss that is not rank 0); otherwise it is found.
    """
    if loss_result is not None and not 0 <= loss_result < len(graph.results):
        raise ValueError(f"loss result {loss_result} out of range: the function has {len(graph.results)} results")
    with paused_gc():
        return _classify(graph, loss_result)


def _classify(graph: FuncGraph, loss_result: int | None) -> TrainingRoles:
    n = len(graph.ops)
    pairs = state_pairs(graph)
    preds = predecessors(graph)
    if loss_result is None:
        loss_result = pick_loss(graph, pairs, preds)
    if loss_result is None:
        return TrainingRoles((Role.FORWARD,) * n, None, pairs, ())
    pairs = tuple(pair for pair in pairs if pair[1] != loss_result)

    forward = [False] * n
    producer = graph.values[graph.results[loss_result]].producer
    if producer is not None:
        for i in ancestors(preds, producer):
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
        name = name_stack(graph, i)
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
        name = name_stack(graph, i)
        return name is not None and ("jvp(" in name or "transpose(" in name)

    # The optimizer's elementwise arithmetic, walking back from the state results.
    for i in range(n - 1, -1, -1):
        if not forward[i] and ops[i].name in UPDATE_WALK_OPS and feeds_only_update(i) and not model_named(i):
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
