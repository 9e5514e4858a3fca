"""The planning pipeline: what `parallelize`, `hlopar-compile` and `hlopar-auto-parallel` run.

    hlopar-import → hlopar-unstack-layer-scans → hlopar-split-microbatches
      method "auto" / "pipeline":  hlopar-cluster-operators → hlopar-stage-construction
                                   (plan_shardings=false for "pipeline") → hlopar-rematerialize
                                   → hlopar-reroll-stage-loops
      method "shard":              one stage on one mesh of every device, planned by
                                   hlopar-auto-sharding → hlopar-rematerialize
      → hlopar-cross-mesh-resharding

from one `PlanOptions` (`passes.plan_options`) and a `Cluster` (`analysis.cluster`); the
unstacking where `unstack_layers` (never for "shard": one stage, its loops stay loops), the
split where `split`. hlopar-reroll-stage-loops rolls the stages' layers with `stage_loops`,
and else runs with `reroll=never`, which changes nothing and reports the ranges a stage could
loop over. Each pass hands its report over through the pass context (`PassContext.reports`);
`Plan.reports` holds them by their place in a plan report (`layer_scans`, `split`,
`clustering`, `stages`, `reroll`, `cross_mesh`). Codegen and the bundle come after it.

The microbatch policy (where `split` and no count is given: `parallelize`'s
`num_microbatches=None`; docs/training_step.md):

1. the count is the largest divisor of the batch size not above max(4, 2 × hosts) (1 for
   "shard", 1 where no batch argument has a leading dim) (`default_microbatches`);
2. where the split pass refuses that many (a whole-batch op, a generator that must draw for
   the whole batch), the step is planned again with one microbatch, the refusal kept as a
   warning that says so; a count the user gives is refused instead;
3. with `schedule="auto"`, the step is first planned at one microbatch (the batch whole),
   and stage construction prices the other counts the batch divides into (every power of two,
   `hlopar-stage-construction{other-microbatches=true}`) beside every schedule, scaled down
   from the whole batch: an optimistic price (a layer plan of the whole batch may split the
   batch over more devices than a microbatch has examples), so no count that could pay is
   missed. Where one is predicted 5% faster or more, the step is split at it and planned
   again (schedule still "auto", that count fixed), and that plan kept where its own
   simulated step is faster than the first's; where the split refuses it, the plan of one
   microbatch stays, with the refusal as a warning. Where no plan of the whole batch fits the
   memory, the policy's count of 1. is planned instead, the other counts priced from its
   microbatch (scaled up: the same re-split rule). Why the whole batch first: priced from a
   split's microbatch (of one example, on the tiny GPT), fewer and larger microbatches cost
   their small microbatch's plans times the count, which split no batch over a mesh: one stage
   at one microbatch was priced 26.5 ms where its own plan predicts 11.4 and runs 13-15 ms,
   and the planner picked a pipeline twice as slow (docs/performance.md);
4. otherwise (a schedule given), where the plan at the policy's count is one stage, the step
   is planned again with one microbatch and that plan kept if it is still one stage
   (microbatches would only add launches; where memory needs them, the plan at one is more
   stages and is not kept).

With `schedule="auto"` the plan's options (`Plan.options`) hold the schedule chosen (the
stage report's `schedule`; `DEFAULT_SCHEDULE` for "shard", one stage).

Planning again needs the step again: `plan` takes a `load` that imports it afresh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jaxlib.mlir import ir

from hlopar.analysis.cluster import Cluster
from hlopar.analysis.schedules import AUTO_SCHEDULE, DEFAULT_SCHEDULE, get_schedule
from hlopar.analysis.step_io import batch_arguments
from hlopar.dialect.layers import LayerPieces
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions
from hlopar.passes.base import PassContext
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.cross_mesh_resharding import CrossMeshReshardingPass
from hlopar.passes.import_program import ImportPass
from hlopar.passes.mpmd_program import StageMesh, write_mpmd_program
from hlopar.passes.plan_options import PlanOptions
from hlopar.passes.rematerialize import RematerializePass
from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.passes.stage_construction import StageConstructionPass
from hlopar.passes.unstack_layer_scans import UnstackLayerScansPass

__all__ = ["REPORT_KEYS", "ImportedStep", "Plan", "default_microbatches", "import_step", "plan", "run_passes"]

# Where each pass's report goes in a plan report.
REPORT_KEYS = {
    UnstackLayerScansPass.name: "layer_scans",
    SplitMicrobatchesPass.name: "split",
    ClusterOperatorsPass.name: "clustering",
    StageConstructionPass.name: "stages",
    RerollStageLoopsPass.name: "reroll",
    CrossMeshReshardingPass.name: "cross_mesh",
}


@dataclass
class ImportedStep:
    """A step imported (hlopar-import) and, where unstacked, its layer scans unrolled:
    the module, the pass context its passes ran in, the `LayerPieces` (or None), and the
    options with the batch arguments and loss result in the module's numbering."""

    module: ir.Operation
    context: PassContext
    pieces: LayerPieces | None
    options: PlanOptions


@dataclass
class Plan:
    """A planned step: the MPMD program (`module`), each pass's report (`REPORT_KEYS`'s
    keys; None for a pass that did not run), the passes' warnings, the options as planned
    (the count of microbatches settled), and the layer pieces as planned (hlopar-reroll-
    stage-loops may have joined a stage's pieces into ranges)."""

    module: ir.Operation
    reports: dict[str, dict | None]
    diagnostics: list[Diagnostic]
    options: PlanOptions
    pieces: LayerPieces | None
    notes: list[str] = field(default_factory=list)  # what the microbatch policy decided
    seconds: dict[str, float] = field(default_factory=dict)  # pass name -> its time, summed over tries

    @property
    def warnings(self) -> list[str]:
        """The warnings, formatted, each once."""
        return list(dict.fromkeys(d.format() for d in self.diagnostics))


def import_step(
    module: ir.Operation, options: PlanOptions, diagnostics: list[Diagnostic] | None = None
) -> ImportedStep:
    """hlopar-import, then (where `unstack_layers`, and the method pipelines) hlopar-unstack-
    layer-scans, on `module` in place; the options renumbered to the module's arguments.
    The passes' warnings go to `diagnostics` (a pass context's, as they come) where given."""
    context = PassContext([] if diagnostics is None else diagnostics, reports={})
    context.timed(ImportPass(), module)
    if options.method == "shard" or not options.unstack_layers:  # one stage: the loops stay loops
        return ImportedStep(module, context, None, options)
    context.timed(UnstackLayerScansPass(), module)
    pieces = LayerPieces.of(planned_functions(module)[0])
    if pieces is not None:
        options = replace(
            options,
            batch_args=pieces.arguments_of(options.batch_args) if options.batch_args is not None else None,
            loss_result=_result_of(pieces, options.loss_result),
        )
    return ImportedStep(module, context, pieces, options)


def _result_of(pieces: LayerPieces, result: int | None) -> int | None:
    """The number of `@main`'s result that is the step's result `result` (a loss is never cut)."""
    if result is None:
        return None
    return next((k for k, o in enumerate(pieces.result_origin) if o == result), result)


def default_microbatches(step: ImportedStep, cluster: Cluster) -> int:
    """The policy's count (module docstring, 1.): the largest divisor of the batch size not
    above max(4, 2 × hosts); 1 for "shard" and where no batch argument has a leading dim."""
    if step.options.method == "shard":
        return 1
    graph = FuncGraph.from_func(planned_functions(step.module)[0])
    batch_args = step.options.batch_args
    if batch_args is None:
        batch_args = batch_arguments(graph)
    shapes = [graph.values[graph.args[i]].shape for i in batch_args]
    sizes = [shape[0] for shape in shapes if shape]
    if not sizes:
        return 1
    size = math.gcd(*sizes)
    limit = max(4, 2 * (cluster.num_hosts or 1))
    return max(d for d in range(1, min(size, limit) + 1) if size % d == 0)


def plan(
    step: ImportedStep,
    cluster: Cluster,
    *,
    chosen: bool = False,
    load: Callable[[], ImportedStep] | None = None,
) -> Plan:
    """Plans an imported step (in place) for a resolved cluster. Where the options give no
    count of microbatches, the policy's (module docstring) is used; `chosen` says that the
    count given is the policy's too (`default_microbatches`, asked before, as `parallelize`
    does for its cache key). Where the policy may plan again (a count that is hlopar's),
    `load` gives the step imported afresh; without it the first plan is kept."""
    options = step.options
    if options.split and options.microbatches is None:
        step = replace(step, options=replace(options, microbatches=default_microbatches(step, cluster)))
        chosen = True
    count = step.options.microbatches
    if not chosen or load is None or count == 1:
        return run_passes(step, cluster)
    whole_tried = step.options.schedule == AUTO_SCHEDULE
    if whole_tried:
        try:
            whole = run_passes(_one_microbatch(step), cluster, other_microbatches=True)
        except DiagnosticError as error:
            if not _no_fit(error):
                raise
            step = replace(
                load(), options=step.options
            )  # one microbatch does not fit: the policy's count, priced as in 3.
        else:
            return _better_count(whole, 1, step, cluster, load, refused_warns=True)
    try:
        planned = run_passes(step, cluster, other_microbatches=True)
    except DiagnosticError as error:
        refusal = _refusal(error)
        if refusal is None:
            raise
        planned = _after(run_passes(_one_microbatch(load()), cluster), step.context.seconds)
        planned.diagnostics.insert(0, _refused_warning(refusal, count))
        return planned
    planned = _better_count(planned, count, step, cluster, load, known_not_to_fit=(1,) if whole_tried else ())
    count = planned.options.microbatches
    if _stages(planned) == 1 and count > 1 and not whole_tried:
        try:
            single = run_passes(_one_microbatch(load()), cluster)
        except DiagnosticError:
            single = None
        if single is not None and _stages(single) == 1:
            single = _after(single, planned.seconds)
            single.notes.append(f"one stage: planned with one microbatch, not the {count} hlopar would have split into")
            return single
    return planned


# Stage construction's refusal where no plan of the split's count fits the memory.
_NO_FIT = f"{StageConstructionPass.name}: no pipeline fits"


def _no_fit(error: DiagnosticError) -> bool:
    """Whether stage construction refused for want of memory (`_NO_FIT`)."""
    return any(d.message.startswith(_NO_FIT) for d in error.diagnostics)


def _refusal(error: DiagnosticError) -> Diagnostic | None:
    """The split's refusal among an error's diagnostics, if it is one."""
    return next((d for d in error.diagnostics if d.message.startswith(f"{SplitMicrobatchesPass.name}:")), None)


def _refused_warning(refusal: Diagnostic, count: int) -> Diagnostic:
    return replace(
        refusal,
        severity="warning",
        message=(
            f"{refusal.message}; so the step is not split into the {count} microbatches hlopar would "
            "have chosen: planned with one microbatch (num_microbatches=1)"
        ),
    )


def _better_count(
    planned: Plan,
    count: int,
    step: ImportedStep,
    cluster: Cluster,
    load: Callable[[], ImportedStep],
    *,
    refused_warns: bool = False,
    known_not_to_fit: tuple[int, ...] = (),
) -> Plan:
    """Rule 3: where stage construction priced another count faster (`better_microbatches`),
    the step split again at it and planned; kept where its own simulated step is faster. A
    refusal of that split keeps `planned` (with a warning where `refused_warns`), and so does
    a plan at that count that does not fit the memory (priced scaled, it did; a count in
    `known_not_to_fit` is not planned)."""
    better = ((planned.reports.get("stages") or {}).get("schedule_choice") or {}).get("better_microbatches")
    if better is not None and better["microbatches"] not in known_not_to_fit:
        try:
            again = run_passes(
                replace(load(), options=replace(step.options, microbatches=better["microbatches"])), cluster
            )
        except DiagnosticError as error:
            refusal = _refusal(error)
            if refusal is None and not _no_fit(error):
                raise
            if refusal is not None and refused_warns:
                planned.diagnostics.insert(0, _refused_warning(refusal, better["microbatches"]))
        else:
            first_s, again_s = _simulated_step(planned), _simulated_step(again)
            if again_s is None or first_s is None or again_s < first_s:
                again.notes.append(
                    f"{better['microbatches']} microbatch(es), not the {count} of the first split (schedule=auto): predicted "
                    f"{better['simulated_step_seconds'] * 1e3:.3g} ms a step against "
                    f"{planned.reports['stages']['schedule_choice']['chosen']['simulated_step_seconds'] * 1e3:.3g} ms"
                )
                planned = _after(again, planned.seconds)
            else:
                # Priced from the first split's microbatch, the count looked faster; planned at
                # it, it is not: the first plan stays.
                planned = _after(planned, again.seconds)
                planned.notes.append(
                    f"{better['microbatches']} microbatch(es) were priced {better['simulated_step_seconds'] * 1e3:.3g} "
                    f"ms a step from the first split and planned at {again_s * 1e3:.3g} ms, not under the "
                    f"{count} microbatches' {first_s * 1e3:.3g} ms: kept {count}"
                )
    return planned


def _after(planned: Plan, before: dict[str, float]) -> Plan:
    """`planned` with the time of the passes of an earlier try added (`Plan.seconds`)."""
    for name, seconds in before.items():
        planned.seconds[name] = planned.seconds.get(name, 0.0) + seconds
    return planned


def _one_microbatch(step: ImportedStep) -> ImportedStep:
    return replace(step, options=replace(step.options, microbatches=1))


def _simulated_step(planned: Plan) -> float | None:
    """The chosen plan's simulated step time (schedule "auto"), None where not simulated."""
    chosen = ((planned.reports.get("stages") or {}).get("schedule_choice") or {}).get("chosen") or {}
    return chosen.get("simulated_step_seconds")


def _stages(planned: Plan) -> int:
    return len((planned.reports.get("stages") or {}).get("stages", ()))


def run_passes(step: ImportedStep, cluster: Cluster, *, other_microbatches: bool = False) -> Plan:
    """One try: the planning passes after the import, on the step's module as its options
    say (the count of microbatches given; with `other_microbatches` and schedule "auto", the
    other counts priced too: the policy's 3.); the passes' reports and warnings (also those
    of the import's passes) in a `Plan`, its options with the schedule chosen."""
    module, context, options = step.module, step.context, step.options
    if options.split:
        context.timed(
            SplitMicrobatchesPass(
                microbatches=options.microbatches,
                batch_args=options.batch_args,
                loss_result=options.loss_result,
                rng=options.rng,
            ),
            module,
        )
    stages = None
    if options.method == "shard":
        stages = _one_mesh_program(module, cluster, options.microbatches)
        stages["schedule"] = DEFAULT_SCHEDULE if options.schedule == AUTO_SCHEDULE else options.schedule.name
    else:
        context.timed(ClusterOperatorsPass(layers=options.layers), module)
        context.timed(
            StageConstructionPass(
                num_hosts=cluster.num_hosts,
                devices_per_host=cluster.devices_per_host,
                microbatches=None if options.split else options.microbatches,  # after the split: the IR says
                schedule=options.schedule_name,
                other_microbatches=other_microbatches and options.schedule == AUTO_SCHEDULE,
                memory_per_device=options.memory_per_device,
                preset=cluster.preset,
                plan_shardings=options.method != "pipeline",
                remat=options.remat,
                stages=options.stages,
                idle_hosts=options.idle_hosts,
            ),
            module,
        )
    context.timed(RematerializePass(all=options.remat == "always"), module)
    if options.method != "shard":
        context.timed(RerollStageLoopsPass(reroll="auto" if options.stage_loops else "never"), module)
    context.timed(CrossMeshReshardingPass(cluster=cluster.preset, devices_per_host=cluster.devices_per_host), module)
    reports = {key: context.reports.get(name) for name, key in REPORT_KEYS.items()}
    if stages is not None:
        reports["stages"] = stages
    pieces = step.pieces
    if pieces is not None:  # as planned: hlopar-reroll-stage-loops may have joined a stage's pieces into ranges
        pieces = LayerPieces.of(planned_functions(module)[0]) or pieces
    if options.schedule == AUTO_SCHEDULE:
        options = replace(options, schedule=get_schedule(reports["stages"]["schedule"]))
    return Plan(module, reports, list(context.diagnostics), options, pieces, seconds=dict(context.seconds))


def _one_mesh_program(module: ir.Operation, cluster: Cluster, microbatches: int | None) -> dict:
    """`method="shard"`: the split step as an MPMD program of one stage on one mesh of every
    device (x = hosts, y = devices per host), its shardings planned by hlopar-auto-sharding."""
    shape = (cluster.num_hosts, cluster.devices_per_host)
    devices = tuple(range(math.prod(shape)))
    with module.context, ir.Location.unknown():
        graph = FuncGraph.from_func(planned_functions(module)[0])
        layering, _ = ClusterOperatorsPass(layers=1).cluster(graph)
        write_mpmd_program(
            module,
            [0] * len(graph.ops),
            layering.roles,
            [StageMesh("m0", ("x", "y"), shape, devices)],
            preset=cluster.preset,
        )
    return {
        "microbatches": microbatches,
        "stages": [{"stage": 0, "logical_shape": list(shape), "devices": list(devices), "latency": 0.0}],
    }
