"""hlopar-cluster-operators: the ops of a training step → L layers (Alpa §5.2, Eq. 6).

The forward ops (ancestors of the loss) are clustered in program order by the DP of Eq. 6:
the largest input any layer receives from earlier layers is minimized while each layer's
FLOPs stay within (1+δ) of the average. Backward and update ops then follow their forward
layer (`training_roles.layer_of_ops`), moved where a pipeline can run them
(`training_roles.consistent_layers`). The result is written on every top-level op of the
entry function as `hlopar.layer = N : i64` and `hlopar.role = "forward" | "backward" |
"update"` (docs/ir.md), which `hlopar-stage-construction` reads.

Ops a user pinned with `jax.named_scope("hlopar_layer_N")` (visible when the module carries
name-stack locations) keep their layer N; the DP then only places the unpinned ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.flops import function_flops
from hlopar.analysis.stages.clustering import choose_num_layers, cluster_operators
from hlopar.analysis.training_roles import Role, TrainingRoles, classify, layer_of_ops, marked_layers
from hlopar.ir.graph import FuncGraph
from hlopar.passes.auto_sharding import planned_functions
from hlopar.passes.base import ModulePass, PassContext, option, parse_count_or_auto, report_option

LAYER_ATTR = "hlopar.layer"
ROLE_ATTR = "hlopar.role"
HEAVY = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})
MAX_AUTO_LAYERS = 64


@dataclass(frozen=True)
class Layering:
    """What clustering decided for one function: per top-level op its layer and role."""

    layers: tuple[int, ...]
    roles: tuple[str, ...]
    num_layers: int
    loss_result: int | None


@dataclass
class ClusterOperatorsPass(ModulePass):
    name = "hlopar-cluster-operators"
    summary = "cluster the ops of a training step into layers (Alpa Eq. 6); backward and update ops follow their forward layer"

    layers: int | None = option(None, "number of layers, or auto", parse=parse_count_or_auto)
    delta: float = option(0.5, "each layer's FLOPs stay within (1+delta) of the average (Eq. 6)")
    loss_result: int | None = option(None, "result number of the loss (default: found from the program)")
    report: str | None = report_option("write a JSON report of the layers to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        funcs = planned_functions(module)
        if len(funcs) != 1:
            self.fail(module, f"expects one entry function (@main), found {len(funcs)}")
        with module.context, ir.Location.unknown():
            graph = FuncGraph.from_func(funcs[0])
            start = time.perf_counter()
            layering, info = self.cluster(graph)
            write_layering(graph, layering)
        if self.wants_report(context):
            info["seconds"] = time.perf_counter() - start
            self.emit_report(module, context, info)

    def cluster(self, graph: FuncGraph) -> tuple[Layering, dict]:
        """The layering of a function and a report of it."""
        try:
            roles = classify(graph, loss_result=self.loss_result)
        except ValueError as error:
            self.fail(graph.mlir_func, str(error))
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
            num_layers = self.layers or choose_num_layers(
                forward_flops, values, max_layers=MAX_AUTO_LAYERS, heavy=heavy
            )
            num_layers = max(1, min(num_layers, len(forward)))
            clustering = cluster_operators(forward_flops, values, num_layers, self.delta)
            starts = list(clustering.boundaries) + [len(forward)]
            forward_layer = {
                forward[k]: layer for layer in range(num_layers) for k in range(starts[layer], starts[layer + 1])
            }
            info = {
                "method": "Eq. 6 DP",
                "max_input_bytes": clustering.max_input_bytes,
                "delta": getattr(clustering, "delta", self.delta),
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


def write_layering(graph: FuncGraph, layering: Layering) -> None:
    i64 = ir.IntegerType.get_signless(64)
    for op, layer, role in zip(graph.ops, layering.layers, layering.roles):
        op.mlir_op.attributes[LAYER_ATTR] = ir.IntegerAttr.get(i64, layer)
        op.mlir_op.attributes[ROLE_ATTR] = ir.StringAttr.get(role)


def read_layering(graph: FuncGraph) -> Layering | None:
    """The layering written by this pass, or None when the ops carry none (or some lack it)."""
    layers, roles = [], []
    for op in graph.ops:
        attributes = op.mlir_op.attributes
        if LAYER_ATTR not in attributes or ROLE_ATTR not in attributes:
            return None
        layers.append(ir.IntegerAttr(attributes[LAYER_ATTR]).value)
        roles.append(ir.StringAttr(attributes[ROLE_ATTR]).value)
    if not layers:
        return None
    return Layering(tuple(layers), tuple(roles), max(layers) + 1, None)


def strip_layering(func: ir.Operation) -> None:
    """Removes the attributes (once stages are built they have served)."""

    def visit(op: ir.Operation) -> ir.WalkResult:
        for name in (LAYER_ATTR, ROLE_ATTR):
            if name in op.attributes:
                del op.attributes[name]
        return ir.WalkResult.ADVANCE

    func.walk(visit)


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
