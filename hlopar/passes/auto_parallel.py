"""hlopar-auto-parallel: the whole planning pipeline under one pass name.

    hlopar-import → hlopar-unstack-layer-scans → [hlopar-split-microbatches] → hlopar-cluster-operators
                  → hlopar-stage-construction → hlopar-rematerialize → hlopar-reroll-stage-loops
                  → hlopar-cross-mesh-resharding

with the options of the passes it runs. With `split=true` the step is first rewritten into
the step of one of `microbatches` microbatches (gradient accumulation; the program a
pipeline runtime runs), and stages are planned on that per-microbatch program. Its report
gathers theirs in one JSON object (`split`, `clustering`, `stages`, `cross_mesh`). Pipeline
schedules and codegen come after it (`hlopar-compile`). `remat` is stage construction's choice
of rematerialized stages (`auto`: where it pays; `always`; `never`), which
hlopar-rematerialize then carries out (with `always`, on every backward fragment).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS
from hlopar.analysis.limits import check_cluster, check_cluster_dimension, check_positive
from hlopar.ir.output import write_output
from hlopar.passes.auto_sharding import parse_bytes
from hlopar.passes.base import ModulePass, PassContext, option, parse_count_or_auto, report_option
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.cross_mesh_resharding import CrossMeshReshardingPass
from hlopar.passes.import_program import ImportPass
from hlopar.passes.rematerialize import RematerializePass
from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.passes.stage_construction import StageConstructionPass
from hlopar.passes.unstack_layer_scans import UnstackLayerScansPass


@dataclass
class AutoParallelPass(ModulePass):
    name = "hlopar-auto-parallel"
    summary = (
        "plan everything: import, microbatch split, operator clustering, stage construction, cross-mesh resharding"
    )

    num_hosts: int = option(1, "hosts in the cluster (N)", check=check_cluster_dimension)
    devices_per_host: int = option(8, "devices per host (M)", check=check_cluster_dimension)
    microbatches: int | None = option(None, "microbatches per step, or auto", parse=parse_count_or_auto)
    split: bool = option(
        False,
        "split @main into the step of one microbatch first (hlopar-split-microbatches; needs a number of microbatches)",
    )
    batch_args: tuple[int, ...] | None = option(
        None, "with split: arguments cut along dim 0, e.g. 19,20 (default: those that are not training state)"
    )
    loss_result: int | None = option(None, "with split: the result that is the loss (default: found)")
    rng: Literal["exact", "per-microbatch"] = option(
        "exact",
        "with split: per-microbatch lets whole-shape random generators draw per microbatch "
        "(hlopar-split-microbatches' rng)",
    )
    schedule: Literal["1f1b", "eager-1f1b", "eager-1f1b-wd", "gpipe"] = option("1f1b", "pipeline schedule")
    memory_per_device: float | None = option(
        None, "bytes per device, e.g. 80GiB (default: the preset's)", parse=parse_bytes, check=check_positive
    )
    preset: str = option("cpu", f"cluster preset ({', '.join(sorted(CLUSTER_PRESETS))})")
    layers: int | None = option(None, "number of layers, or auto", parse=parse_count_or_auto)
    remat: Literal["auto", "always", "never", "layers"] = option(
        "auto",
        "rematerialized stages (hlopar-rematerialize): auto (where stage construction finds it pays), "
        "always (per stage), layers (per layer), never",
    )
    unstack_layers: bool = option(
        True,
        "unroll scans over stacked layers and split their stacks per layer "
        "(hlopar-unstack-layer-scans), so that stages can cut between layers",
    )
    reroll: Literal["auto", "never"] = option(
        "never",
        "auto: run each stage's iterations of an unrolled layer scan as a loop again "
        "(hlopar-reroll-stage-loops), each stage holding its range as one value; never (the default: on "
        "XLA:CPU the rolled stages still compile slower, docs/stage_construction.md)",
    )
    report: str | None = report_option("write one JSON report of every step's decisions to this path")

    def check_options(self) -> None:
        check_cluster(self.num_hosts, self.devices_per_host)

    def run(self, module: ir.Operation, context: PassContext) -> None:
        if self.split and self.microbatches is None:
            self.fail(module, "split=true needs a number of microbatches (microbatches=B), not auto")
        with tempfile.TemporaryDirectory(prefix="hlopar-auto-parallel-") as scratch:
            paths = {
                key: str(Path(scratch) / f"{key}.json") if self.report else None
                for key in ("layer_scans", "split", "clustering", "stages", "reroll", "cross_mesh")
            }
            steps: list[ModulePass] = [ImportPass()]
            if self.unstack_layers:
                steps.append(UnstackLayerScansPass(report=paths["layer_scans"]))
            if self.split:
                steps.append(
                    SplitMicrobatchesPass(
                        microbatches=self.microbatches,
                        batch_args=self.batch_args,
                        loss_result=self.loss_result,
                        rng=self.rng,
                        report=paths["split"],
                    )
                )
            steps += [
                ClusterOperatorsPass(layers=self.layers, report=paths["clustering"]),
                StageConstructionPass(
                    num_hosts=self.num_hosts,
                    devices_per_host=self.devices_per_host,
                    microbatches=self.microbatches,
                    schedule=self.schedule,
                    memory_per_device=self.memory_per_device,
                    preset=self.preset,
                    report=paths["stages"],
                    **stage_remat(self.remat),
                ),
                RematerializePass(all=self.remat == "always"),
                RerollStageLoopsPass(reroll=self.reroll, report=paths["reroll"]),
                CrossMeshReshardingPass(
                    cluster=self.preset, devices_per_host=self.devices_per_host, report=paths["cross_mesh"]
                ),
            ]
            for step in steps:
                step.run(module, context)
            if self.report:
                merged = {"pass": self.name, "options": self.pipeline_text()}
                for key, path in paths.items():
                    merged[key] = json.loads(Path(path).read_text()) if path and Path(path).exists() else None
                try:
                    write_output(self.report, json.dumps(merged, indent=1) + "\n")
                except OSError as error:
                    self.fail(module, f"cannot write the report to '{self.report}': {error.strerror}")


def stage_remat(remat: str) -> dict:
    """StageConstructionPass's `remat` option, where it has one (stage construction that
    cannot plan rematerialized stages gets none; `always` is then carried out by
    hlopar-rematerialize's `all` alone)."""
    return {"remat": remat} if "remat" in {f.name for f in dataclasses.fields(StageConstructionPass)} else {}
