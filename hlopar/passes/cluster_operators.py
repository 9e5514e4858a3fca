"""hlopar-cluster-operators: the ops of a training step → L layers (Alpa §5.2, Eq. 6).

The decision is `analysis.stages.layering.cluster_layers`; this pass writes it.

The forward ops (ancestors of the loss) are clustered in program order by the DP of Eq. 6:
the largest input any layer receives from earlier layers is minimized while each layer's
FLOPs stay within (1+δ) of the average. Backward and update ops then follow their forward
layer (`op_layers.layer_of_ops`), moved where a pipeline can run them
(`op_layers.consistent_layers`). The result is written on every top-level op of the
entry function as `hlopar.layer = N : i64` and `hlopar.role = "forward" | "backward" |
"update"` (docs/ir.md), which `hlopar-stage-construction` reads.

Ops a user pinned with `jax.named_scope("hlopar_layer_N")` (visible when the module carries
name-stack locations) keep their layer N; the DP then only places the unpinned ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.stages.layering import cluster_layers
from hlopar.dialect.layers import Layering, write_layering
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions
from hlopar.passes.base import ModulePass, PassContext, option, parse_count_or_auto, report_option


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
        """The layering of a function and a report of it (`cluster_layers` with this pass's options)."""
        try:
            return cluster_layers(graph, layers=self.layers, delta=self.delta, loss_result=self.loss_result)
        except ValueError as error:
            self.fail(graph.mlir_func, str(error))
