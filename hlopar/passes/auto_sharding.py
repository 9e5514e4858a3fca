"""`hlopar-auto-sharding`: choose how every tensor and op of `@main` is split on one mesh.

Alpa's intra-op plan (§4) on StableHLO, written as `sdy` shardings that stock jaxlib
compiles; `passes/intra_op_plan.py` does the planning and the writing (stage
construction runs it too, per stage). This module is the pass's options and its report.
Shardings already in the input are kept as hard constraints.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, LogicalMesh
from hlopar.analysis.limits import check_mesh_shape, check_positive, check_seconds
from hlopar.ir.output import write_output
from hlopar.passes.base import ModulePass, PassContext, option, parse_str_tuple, report_option
from hlopar.passes.intra_op_plan import NAME, IntraOpOptions, plan_module
from hlopar.units import parse_bytes


def parse_float_tuple(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in parse_str_tuple(text))


@dataclass
class AutoShardingPass(ModulePass):
    name = NAME
    summary = "choose a sharding for every op on one device mesh (Alpa's intra-op ILP) and write it as sdy"

    mesh_shape: tuple[int, ...] = option((1,), "logical mesh shape, e.g. 2x4", check=check_mesh_shape)
    axis_names: tuple[str, ...] = option((), "mesh axis names (default x, y, z, ...)")
    preset: str = option(
        "cpu",
        f"cluster preset for bandwidths, FLOP/s and memory ({', '.join(sorted(CLUSTER_PRESETS))}, or a preset file)",
    )
    latency: tuple[float, ...] = option(
        (), "per-axis latency in seconds (overrides the preset)", parse=parse_float_tuple
    )
    bandwidth: tuple[float, ...] = option(
        (), "per-axis bandwidth in bytes/s (overrides the preset)", parse=parse_float_tuple
    )
    memory_budget: float | None = option(
        None, "bytes per device, e.g. 16GiB (none: no limit)", parse=parse_bytes, check=check_positive
    )
    time_limit: float = option(60.0, "solver time limit in seconds (keeps the best plan found)", check=check_seconds)
    prefer_reduce_scatter: bool = option(
        False,
        "prefer weight-update sharding (ZeRO-like): the training state split over the mesh wherever that "
        "costs less than sending the bytes it saves once (gradients reduce-scattered, parameters all-gathered)",
    )
    weight_update_sharding: bool = option(
        False, "weight-update sharding, enforced: every training state split over the mesh where its shape allows"
    )
    force_batch_dim: str | None = option(
        None, "split the batch over this mesh axis: the dimension of every value that holds the batch's examples"
    )
    data_parallel: bool = option(
        False, "pure data parallelism: the batch split over every mesh axis, the training state replicated"
    )
    batch_args: tuple[int, ...] | None = option(
        None, "with force-batch-dim or data-parallel: the arguments that hold the batch, e.g. 5,6 (default: found)"
    )
    merge: bool = option(
        False,
        "fold cheap ops into their deepest operand before solving (Alpa §4.2): a smaller ILP whose "
        "optimum may cost more than the program's (the report then says FEASIBLE, gap null)",
    )
    partial_sums: bool = option(
        False,
        "partial-sum layouts (Shardy's unreduced axes): a matrix product or sum that splits its reduction "
        "may leave its sums pending through linear ops and loops, reduced once where a consumer needs them "
        "(gradient accumulation syncs once per step)",
    )
    tie_outputs: bool = option(
        True, "give each new value of training state the layout of its old value (step_io.state_pairs)"
    )
    reshard_constraints: bool = option(
        True,
        "also write the plan as sdy.sharding_constraints (XLA keeps those and drops op shardings): "
        "on every op's results, and wherever a consumer reads a value in another layout",
    )
    report: str | None = report_option("write a JSON report of the plan to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        options = IntraOpOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(IntraOpOptions)})
        planned = plan_module(module, options, context.warn)
        if planned is not None and self.report:
            _write_report(Path(self.report), self, planned.mesh, list(planned.functions))


def _write_report(path: Path, options: AutoShardingPass, mesh: LogicalMesh, functions: list[dict]) -> None:
    """The plan as JSON (schema: docs/auto_sharding_report.md). Top-level fields summarize the
    first planned function (`@main`); `functions` has every planned function."""
    report = {
        "pass": options.pipeline_text(),
        "mesh": {
            "shape": list(mesh.shape),
            "axes": list(mesh.axis_names),
            "bandwidth_bytes_per_s": [a.bandwidth_bytes_per_s for a in mesh.axes],
            "latency_s": [a.latency_s for a in mesh.axes],
        },
        **{k: v for k, v in functions[0].items() if k != "function"},
        "functions": [{k: v for k, v in f.items() if k not in ("ops", "reshards")} for f in functions],
    }
    write_output(path, json.dumps(report, indent=1))
