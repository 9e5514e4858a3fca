"""A training step's top-level ops -> L layers (Alpa §5.2, Eq. 6), the decision behind
`hlopar-cluster-operators`, which `hlopar-stage-construction` also makes when its input
carries no layering.

The forward ops (ancestors of the loss) are clustered in program order by the DP of Eq. 6
(`clustering.cluster_operators`), or follow the user's `hlopar_layer_N` name scopes;
backward and update ops then follow their forward layer (`op_layers.layer_of_ops`).
"""

from __future__ import annotations

from dataclasses import replace

from hlopar.analysis.flops import function_flops
from hlopar.analysis.op_layers import layer_of_ops, marked_layers
from hlopar.analysis.stages.clustering import choose_num_layers, cluster_operators
from hlopar.analysis.training_roles import Role, TrainingRoles, classify
from hlopar.dialect.attributes import STEP
from hlopar.dialect.layers import Layering
from hlopar.dialect.split import op_kinds
from hlopar.ir.graph import FuncGraph

__all__ = ["HEAVY", "MAX_AUTO_LAYERS", "cluster_layers"]

HEAVY = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})
MAX_AUTO_LAYERS = 64


def cluster_layers(
    graph: FuncGraph, *, layers: int | None = None, delta: float = 0.5, loss_result: int | None = None
) -> tuple[Layering, dict]:
    """The layering of a function and a report of it; `ValueError` where the training roles
    cannot be told (`training_roles.classify`). `layers` None: chosen."""
    roles = _once_per_step(graph, classify(graph, loss_result=loss_result))
    flops = function_flops(graph)
    forward = [op.index for op in graph.ops if roles.roles[op.index] is Role.FORWARD]
    pinned = marked_layers(graph) or {}
    if pinned:
        forward_layer = _pinned_forward_layers(forward, pinned)
        num_layers = max(forward_layer.values()) + 1
        info = {"method": "user markers (hlopar_layer_N name scopes)"}
    else:
        position = {op: k for k, op in enumerate(forward)}
        values = _forward_values(graph, forward, position)
        forward_flops = [flops[op] for op in forward]
        heavy = [graph.ops[op].name in HEAVY for op in forward]
        num_layers = layers or choose_num_layers(forward_flops, values, max_layers=MAX_AUTO_LAYERS, heavy=heavy)
        num_layers = max(1, min(num_layers, len(forward)))
        clustering = cluster_operators(forward_flops, values, num_layers, delta)
        starts = list(clustering.boundaries) + [len(forward)]
        forward_layer = {
            forward[k]: layer for layer in range(num_layers) for k in range(starts[layer], starts[layer + 1])
        }
        info = {
            "method": "Eq. 6 DP",
            "max_input_bytes": clustering.max_input_bytes,
            "delta": getattr(clustering, "delta", delta),
        }
    layers = layer_of_ops(graph, roles, forward_layer)
    layering = Layering(
        tuple(layers),
        tuple(r.value if hasattr(r, "value") else str(r) for r in roles.roles),
        num_layers,
        roles.loss_result,
    )
    info.update(_summary(graph, layering, flops))
    return layering, info


def _once_per_step(graph: FuncGraph, roles: TrainingRoles) -> TrainingRoles:
    """In a step the microbatch split wrote, an op of kind `step` runs once, on the
    microbatches' sums: UPDATE, whatever the data flow says. The loss of a loss normalized
    by the whole batch's weights (`sum(l * w) / sum(w)`: the quotient of two sums) is one."""
    kinds = op_kinds(graph)
    if STEP not in kinds:
        return roles
    return replace(roles, roles=tuple(Role.UPDATE if k == STEP else r for r, k in zip(roles.roles, kinds)))


def _forward_values(graph: FuncGraph, forward: list[int], position: dict[int, int]) -> list[tuple[int, list[int], int]]:
    """(producer position, consumer positions, bytes) of every value a forward op makes that
    other forward ops read: what Eq. 6's C(i, k) counts."""
    out = []
    for op in forward:
        for v in graph.ops[op].results:
            readers = sorted({position[u] for u in graph.values[v].users if u in position and u != op})
            if readers:
                out.append((position[op], readers, graph.values[v].nbytes or 0))
    return out


def _pinned_forward_layers(forward: list[int], pinned: dict[int, int]) -> dict[int, int]:
    """User layers renumbered 0..L-1 in order; unmarked forward ops join the layer of the
    closest marked op before them (the first marked layer at the start)."""
    order = sorted(set(pinned.values()))
    renumber = {layer: k for k, layer in enumerate(order)}
    out, current = {}, None
    first = next((renumber[pinned[op]] for op in forward if op in pinned), 0)
    for op in forward:
        if op in pinned:
            current = renumber[pinned[op]]
        out[op] = first if current is None else current
    return out


def _summary(graph: FuncGraph, layering: Layering, flops: list[float]) -> dict:
    layers = []
    for layer in range(layering.num_layers):
        ops = [op.index for op in graph.ops if layering.layers[op.index] == layer]
        by_role = {
            role: sum(1 for op in ops if layering.roles[op] == role) for role in ("forward", "backward", "update")
        }
        layers.append(
            {
                "layer": layer,
                "ops": by_role,
                "forward_flops": sum(flops[op] for op in ops if layering.roles[op] == "forward"),
                "flops": sum(flops[op] for op in ops),
            }
        )
    return {"num_layers": layering.num_layers, "loss_result": layering.loss_result, "layers": layers}
