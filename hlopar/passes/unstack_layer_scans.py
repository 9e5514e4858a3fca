"""hlopar-unstack-layer-scans: a layer stack under `scan` becomes one piece per layer.

A scanned model (`jax.lax.scan` over stacked weights, Flax `nn.scan`) keeps its layers'
parameters in arrays with a leading layer axis and runs its blocks in a `while` loop
(`analysis.layer_scans`); its backward loop writes the stacked gradients, and the optimizer
updates the stacked parameters and state elementwise. A pipeline stage must hold only its
own layers, and stage construction cuts between top-level ops, so this pass:

1. unrolls each loop over layers (its body cloned once per iteration, the counter folded to
   constants by `canonicalize`), so that layer i's ops are ops of their own;
2. splits every value stacked along the layer axis (the stacked parameters and optimizer
   state among the arguments, the loop's stacked residuals, the stacked gradients, the
   updated state among the results) into L pieces of leading dim 1: reads of layer i
   (`dynamic_slice` at constant index i) read piece i, writes (`dynamic_update_slice`) replace
   piece i, elementwise ops (the optimizer) run per piece, sums over the layer axis (a global
   gradient norm) add the pieces' sums;
3. tidies what the loops leave that the model written with a Python loop has not, since
   clustering places ops by program order and by what they read: a residual stacked by
   `broadcast_in_dim` and read back by `reshape` is read directly (`fold_unit_reshapes`),
   the backward's reshape of a residual reads the forward's (`merge_repeated_reshapes`), and
   a layer's parameter reshapes and recomputed mask move to where they are read
   (`read_where_used`). The unrolled scanned GPT then clusters as its Python-loop twin does
   (same cuts, same matmuls per layer) and gets the same stages.

A value is split only if everything that reads it can follow the pieces, and only if it is
connected to a per-layer read or write; the rest is left as it is. `@main` then takes
the pieces as arguments and returns them as results: `hlopar.layer_pieces` on `@main` says
which argument and result of the original signature each one is a piece of (docs/ir.md),
so a caller slices the stacked arrays it passes and concatenates the pieces it gets back
(`dialect.layers.LayerPieces`).

Unrolling is what makes the cut points ops; it costs IR size (the unrolled stack is the size
of the same model written with a Python loop) and nothing at run time: the pieces are the
slices a stage would hold anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.layer_scans import layer_scans
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions
from hlopar.passes.base import ModulePass, PassContext, option, report_option
from hlopar.passes.layer_scans.unroll import (
    canonicalize,
    fold_unit_reshapes,
    merge_repeated_reshapes,
    read_where_used,
    unroll,
)
from hlopar.passes.layer_scans.unstack import unstack

__all__ = ["UnstackLayerScansPass"]


@dataclass
class UnstackLayerScansPass(ModulePass):
    name = "hlopar-unstack-layer-scans"
    summary = (
        "unroll scans over stacked layers and split their stacked parameters, state and results into one "
        "piece per layer (so that stages can cut between layers)"
    )

    max_layers: int = option(512, "unroll loops over at most this many layers")
    report: str | None = report_option("write a JSON report of the unrolled loops and split values to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        funcs = planned_functions(module)
        if len(funcs) != 1:
            self.fail(module, f"expects one entry function (@main), found {len(funcs)}")
        (main,) = funcs
        clock = time.perf_counter()
        with module.context, ir.Location.unknown():
            graph = FuncGraph.from_func(main)
            scans = [s for s in layer_scans(graph) if s.trips <= self.max_layers]
            masks: dict[tuple[ir.Value, int], ir.Value] = {}
            for number, scan in enumerate(scans):
                unroll(graph.ops[scan.op].mlir_op, scan.trips, masks, loop=number)
            canonicalize(module)
            pieces = None
            if scans:
                pieces = unstack(planned_functions(module)[0], {s.trips for s in scans})
                fold_unit_reshapes(planned_functions(module)[0])
                canonicalize(module)  # what read or made the whole stacks is dead now
                merge_repeated_reshapes(planned_functions(module)[0])
                read_where_used(planned_functions(module)[0])
        if self.wants_report(context):
            report = {
                "pass": self.name,
                "seconds": time.perf_counter() - clock,
                "loops": [{"trips": s.trips, "stacked_operands": len(s.stacked)} for s in scans],
                "split_arguments": pieces.split_arguments if pieces else 0,
                "split_results": pieces.split_results if pieces else 0,
            }
            self.emit_report(module, context, report, end="")
