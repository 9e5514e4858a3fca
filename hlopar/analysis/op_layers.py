"""The layer of every op of a training step, from the layers of its forward ops (rules in
`layer_of_ops`), moved where a pipeline can run them (`consistent_layers`); `marked_layers`
reads user markers (`jax.named_scope("hlopar_layer_<n>")`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from hlopar.analysis.dataflow import constant_derived, name_stack, predecessors
from hlopar.analysis.training_roles import Role, TrainingRoles
from hlopar.ir.collector import paused_gc
from hlopar.ir.graph import FuncGraph

__all__ = ["consistent_layers", "layer_of_ops", "marked_layers"]

_MARKER = re.compile(r"hlopar_layer_(\d+)")


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
    with paused_gc():
        return _layer_of_ops(graph, roles, forward_layer)


def _layer_of_ops(graph: FuncGraph, roles: TrainingRoles, forward_layer: Mapping[int, int]) -> tuple[int, ...]:
    role_of = roles.roles
    preds = predecessors(graph)
    constant = constant_derived(graph, preds)
    layer: list[int | None] = [None] * len(graph.ops)
    for i, role in enumerate(role_of):
        if role is Role.FORWARD:
            layer[i] = forward_layer.get(i)
    from_forward = _backward_layers(graph, role_of, constant, layer)
    _update_layers(graph, roles, layer)
    _gradient_layers(graph, role_of, from_forward, layer)
    _layers_without_evidence(graph, preds, layer)
    return consistent_layers(role_of, preds, layer, constant)


def _backward_layers(
    graph: FuncGraph, role_of: Sequence[Role], constant: Sequence[bool], layer: list[int | None]
) -> list[bool]:
    """Sets the layer of the backward ops from what they read; returns, per op, whether it
    read forward values (or arguments)."""
    values = graph.values
    from_forward = [False] * len(graph.ops)

    def forward_readers(v: int) -> list[int]:
        return [layer[u] for u in values[v].users if role_of[u] is Role.FORWARD and layer[u] is not None]

    for i in range(len(graph.ops)):
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
    return from_forward


def _update_layers(graph: FuncGraph, roles: TrainingRoles, layer: list[int | None]) -> None:
    """Sets the layer of the update ops, from the parameter they update."""
    ops, values, role_of = graph.ops, graph.values, roles.roles
    parameter_layer = {}
    for arg, result in roles.state_pairs:
        readers = [u for u in values[graph.args[arg]].users if role_of[u] is Role.FORWARD and layer[u] is not None]
        if readers:
            parameter_layer[graph.results[result]] = layer[min(readers)]
    for i in range(len(ops) - 1, -1, -1):
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


def _gradient_layers(
    graph: FuncGraph, role_of: Sequence[Role], from_forward: Sequence[bool], layer: list[int | None]
) -> None:
    """Backward ops that read nothing forward and only feed, through such ops, the update
    of one layer's parameters (a bias gradient: a sum of the output's cotangent) belong to
    that layer. Every backward value ends in some gradient: the path must not go through a
    backward op that read forward values, which has its own layer."""
    ops = graph.ops
    returned = set(graph.results)
    only_for: list[int | None] = [None] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        if role_of[i] is Role.UPDATE:
            only_for[i] = layer[i]
        elif role_of[i] is Role.BACKWARD and not from_forward[i] and not any(v in returned for v in ops[i].results):
            targets = {only_for[u] for u in graph.successors(i)}
            if len(targets) == 1:
                only_for[i] = targets.pop()
                if only_for[i] is not None:
                    layer[i] = only_for[i]


def _layers_without_evidence(graph: FuncGraph, preds: list[list[int]], layer: list[int | None]) -> None:
    """Ops with no evidence take their users' smallest layer, else their producers', else 0."""
    n = len(graph.ops)
    for i in range(n - 1, -1, -1):
        if layer[i] is None:
            found = [layer[u] for u in graph.successors(i) if layer[u] is not None]
            if found:
                layer[i] = min(found)
    for i in range(n):
        if layer[i] is None:
            found = [layer[p] for p in preds[i] if layer[p] is not None]
            layer[i] = min(found) if found else 0


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
        name = name_stack(graph, i)
        if name is not None and "hlopar_layer_" in name:
            found[i] = int(_MARKER.findall(name)[-1])
    return found or None
