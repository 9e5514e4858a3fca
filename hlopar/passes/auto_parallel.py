"""hlopar-auto-parallel: the planning pipeline (`passes.planning`) as one pass.

    hlopar-import → hlopar-unstack-layer-scans → [hlopar-split-microbatches] → hlopar-cluster-operators
                  → hlopar-stage-construction → hlopar-rematerialize → hlopar-reroll-stage-loops
                  → hlopar-cross-mesh-resharding

with the options of the passes it runs, which are `PlanOptions`' (`passes.plan_options`) in
pipeline syntax, on the cluster its `num-hosts`, `devices-per-host` and `preset` describe.
With `split=true` the step is first rewritten into the step of one of `microbatches`
microbatches (gradient accumulation; the program a pipeline runtime runs), and stages are
planned on that per-microbatch program. `method=shard` plans one stage on one mesh of every
device instead. Its report gathers theirs in one JSON object (`layer_scans`, `split`,
`clustering`, `stages`, `reroll`, `cross_mesh`), handed over through the pass context and
written where `report` names a file. Pipeline schedules and codegen come after it
(`hlopar-compile`). `remat` is stage construction's choice of rematerialized stages (`auto`:
where it pays; `always`; `never`), which hlopar-rematerialize then carries out (with
`always`, on every backward fragment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS
from hlopar.analysis.cluster import Cluster
from hlopar.analysis.limits import check_cluster, check_cluster_dimension, check_positive
from hlopar.analysis.schedules import DEFAULT_SCHEDULE, ScheduleOption
from hlopar.passes.base import ModulePass, PassContext, option, parse_count_or_auto, report_option
from hlopar.passes.plan_options import METHODS, REMAT_MODES, RNG_MODES, PlanOptions, schedule_named
from hlopar.passes.planning import REPORT_KEYS, Plan, import_step, plan
from hlopar.units import parse_bytes


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
    rng: Literal[RNG_MODES] = option(
        "exact",
        "with split: per-microbatch lets whole-shape random generators draw per microbatch "
        "(hlopar-split-microbatches' rng)",
    )
    method: Literal[METHODS] = option(
        "auto",
        "auto: stages, submeshes and intra-op plans chosen; shard: one stage on one mesh of every device "
        "(intra-op only); pipeline: stages replicated over their submeshes (inter-op only)",
    )
    schedule: ScheduleOption = option(
        DEFAULT_SCHEDULE,
        "pipeline schedule (the registry's; default its DEFAULT_SCHEDULE), or auto: chosen by stage construction "
        "(the report's stages.schedule)",
    )
    memory_per_device: float | None = option(
        None, "bytes per device, e.g. 80GiB (default: the preset's)", parse=parse_bytes, check=check_positive
    )
    preset: str = option("cpu", f"cluster preset ({', '.join(sorted(CLUSTER_PRESETS))}, or a preset file)")
    layers: int | None = option(None, "number of layers, or auto", parse=parse_count_or_auto)
    stages: int | None = option(
        None, "exactly this many pipeline stages, or auto (stage construction chooses)", parse=parse_count_or_auto
    )
    idle_hosts: bool = option(
        False, "the stages may leave whole hosts idle where that is predicted faster (hlopar-stage-construction)"
    )
    remat: Literal[REMAT_MODES] = option(
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
        self.plan_options()  # what the planning options refuse together (stages=2 with method=shard)

    def plan_options(self) -> PlanOptions:
        """These options as the planning pipeline's (the schedule's name made a `Schedule` here,
        or "auto")."""
        return PlanOptions(
            method=self.method,
            schedule=schedule_named(self.schedule),
            microbatches=self.microbatches,
            split=self.split,
            batch_args=self.batch_args,
            loss_result=self.loss_result,
            rng=self.rng,
            remat=self.remat,
            stage_loops=self.reroll == "auto",
            unstack_layers=self.unstack_layers,
            layers=self.layers,
            stages=self.stages,
            idle_hosts=self.idle_hosts,
            memory_per_device=self.memory_per_device,
        )

    def run(self, module: ir.Operation, context: PassContext) -> None:
        if self.split and self.microbatches is None:
            self.fail(module, "split=true needs a number of microbatches (microbatches=B), not auto")
        # The sizes are checked with the options; the preset by the passes that read it.
        cluster = Cluster(num_hosts=self.num_hosts, devices_per_host=self.devices_per_host, preset=self.preset)
        planned = plan(import_step(module, self.plan_options(), context.diagnostics), cluster)
        if self.wants_report(context):
            self.emit_report(module, context, self.plan_report(planned))

    def plan_report(self, planned: Plan) -> dict:
        """The pass's report: its options, and every pass's report by its key."""
        return {
            "pass": self.name,
            "options": self.pipeline_text(),
            **{k: planned.reports[k] for k in REPORT_KEYS.values()},
        }
