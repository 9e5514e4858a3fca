"""hlopar-stage-construction: layers → pipeline stages on submeshes (Alpa §5.2, Algorithm 1).

Reads the layering of `hlopar-cluster-operators` (and clusters first when the ops carry
none), plans every distinct layer on every logical shape of every submesh with the intra-op
ILP (`analysis/stages/layer_costs`), composes span costs (`span_costs`), runs the DP of
Eq. 3–4 with early pruning (`stage_dp`) for each microbatch count asked for (with
`schedule=auto`, for each schedule too, the plans ranked by simulated step time:
`pipeline_choice`), assigns
physical devices (`submeshes.assign_devices`, Appendix A) and rewrites the entry function
into an MPMD program (`mpmd_program.write_mpmd_program`): one mesh per stage (several stages
per mesh under interleaved-1f1b and zb-v, placed as the schedule places them: docs/
stage_construction.md, "Virtual stages"), each stage's forward and backward on its mesh,
update fragments where their parameters live. The backward
fragment of a stage planned rematerialized (`remat`, `span_costs`) carries the unit attribute
`hlopar.remat`: `hlopar-rematerialize` makes it recompute the forward from the stage's inputs;
a stage planned rematerialized per layer carries `hlopar.remat = "layers"`, and its forward
and backward ops keep their `hlopar.layer` (the layers the per-layer recompute follows; every
other op loses the clustering's attributes).
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, LogicalMesh, cluster_preset, logical_mesh
from hlopar.analysis.auto_sharding.graph_problem import tensor_info
from hlopar.analysis.auto_sharding.resharding import resharding_cost
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.analysis.limits import (
    check_cluster,
    check_cluster_dimension,
    check_count,
    check_positive,
    check_seconds,
    check_workers,
)
from hlopar.analysis.schedules import AUTO_SCHEDULE, DEFAULT_SCHEDULE, PLANNED_SCHEDULES, ScheduleOption, get_schedule
from hlopar.analysis.stages.layer_costs import (
    FORWARD,
    ROLES,
    boundary_values,
    kernel_counts,
    plan_layers,
    trivial_axes_key,
    value_bytes,
)
from hlopar.analysis.stages.layering import cluster_layers
from hlopar.analysis.stages.pipeline_choice import Candidate, Choice, HostLaunches, PipelineSpace, choose_pipeline
from hlopar.analysis.stages.span_costs import REMAT_MODES, LayerArrays, values_received_by_span
from hlopar.analysis.stages.submeshes import (
    Submesh,
    assign_devices,
    logical_mesh_shapes,
    submesh_shapes,
)
from hlopar.analysis.step_io import RolesError, batch_arguments, batch_candidates, state_pairs
from hlopar.dialect.attributes import BACKWARD, LAYER_ATTR, REMAT_ATTR, REMAT_LAYERS, REMAT_STAGE
from hlopar.dialect.layers import Layering, read_layering, strip_layering
from hlopar.dialect.mpmd import fragment_role, fragment_stage, fragments
from hlopar.dialect.split import read_microbatches
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, source_location
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions, run_function_pass
from hlopar.ir.signature import FuncSignature
from hlopar.passes.base import ModulePass, PassContext, option, parse_count_or_auto, report_option
from hlopar.passes.mpmd_program import StageMesh, is_floating, write_mpmd_program
from hlopar.units import parse_bytes

AXIS_NAMES = ("x", "y")
WEIGHT_UPDATE_SHARDING = "weight-update-sharding"
INTRA_OP_OPTIONS = ("default", WEIGHT_UPDATE_SHARDING)


@dataclass(frozen=True)
class PipelinePlan:
    """The decision, in plain data (what the report and the MPMD writer read)."""

    microbatches: int
    total_latency: float
    t_max: float
    stages: tuple[
        dict, ...
    ]  # per stage: layers, submesh, logical shape, devices, latency, memory, remat (and its form)
    runner_ups: tuple[dict, ...]
    candidates: tuple[dict, ...]  # per microbatch count tried: its best latency
    schedule: str  # the user's, or the one chosen (schedule=auto)
    choice: dict | None  # schedule=auto: what was chosen, the runner-up, every candidate
    simulated_step_seconds: float | None = None  # the plan's step in the simulator


@dataclass
class StageConstructionPass(ModulePass):
    name = "hlopar-stage-construction"
    summary = "slice layers into pipeline stages on submeshes (Alpa Eq. 3-5, Algorithm 1) and write an MPMD program"

    num_hosts: int = option(1, "hosts in the cluster (N)", check=check_cluster_dimension)
    devices_per_host: int = option(8, "devices per host (M)", check=check_cluster_dimension)
    microbatches: int | None = option(
        None,
        "microbatches per step, or auto (searched over divisors of the batch), for a step whose microbatching "
        "is not in the IR; after hlopar-split-microbatches the count is its hlopar.microbatches (leave this unset)",
        parse=parse_count_or_auto,
    )
    schedule: ScheduleOption = option(
        DEFAULT_SCHEDULE,
        "pipeline schedule (sets the memory check of Eq. 5), or auto: the registry's schedule, the microbatches "
        "and the stages of least simulated step time within memory",
    )
    other_microbatches: bool = option(
        False,
        "with schedule=auto after hlopar-split-microbatches: also price the other counts the batch divides into "
        "(powers of two), scaled from the split's microbatch; one predicted faster by 5% or more is reported "
        "as better_microbatches (for a new split: the planning pipeline's)",
    )
    memory_per_device: float | None = option(
        None, "bytes per device, e.g. 80GiB (default: the preset's)", parse=parse_bytes, check=check_positive
    )
    preset: str = option(
        "cpu", f"cluster preset for links, FLOP/s and memory ({', '.join(sorted(CLUSTER_PRESETS))}, or a preset file)"
    )
    layers: int | None = option(
        None, "layers when the input is not clustered yet (auto: chosen)", parse=parse_count_or_auto
    )
    time_limit: float = option(10.0, "solver time limit per layer ILP, seconds", check=check_seconds)
    workers: int | None = option(None, "processes solving layer ILPs (default: one per CPU core)", check=check_workers)
    epsilon: float = option(1e-6, "t_max step of the DP's enumeration, seconds (Alpa §5.2)")
    plan_shardings: bool = option(True, "plan each stage's intra-op shardings (false: stages replicated)")
    stages: int | None = option(
        None, "exactly this many pipeline stages (default: the DP chooses)", check=lambda n: check_count(n, low=1)
    )
    remat: Literal[REMAT_MODES] = option(
        "auto",
        "rematerialize stages: auto (where it pays, per stage or per layer), always (every stage that "
        "stashes activations, per stage), layers (likewise, per layer), never",
    )
    idle_hosts: bool = option(
        False,
        "let whole hosts stay idle where the pipeline is predicted faster on fewer of them (a small model on "
        "slow links between hosts): the stages are also planned on the first 1, 2, ... hosts",
    )
    report: str | None = report_option("write a JSON report of the plan to this path")

    def check_options(self) -> None:
        check_cluster(self.num_hosts, self.devices_per_host)

    def _check_entry(self, func: ir.Operation) -> None:
        """The MPMD program it writes is @main's, and passes tensors between meshes."""
        name = ir.StringAttr(func.attributes["sym_name"]).value
        if name != "main":
            self.fail(func, f"the module has no @main (its one public function is @{name})")
        signature = FuncSignature.of(func)
        function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        for kind, types, names in (
            ("argument", function_type.inputs, signature.arg_names),
            ("result", function_type.results, signature.result_names),
        ):
            for k, t in enumerate(types):
                if not _is_ranked_tensor(t):
                    called = f" ({names[k]})" if names[k] else ""
                    self.fail(
                        func,
                        f"{kind} {k}{called} of @main has type {t}, not a ranked tensor: pipeline stages "
                        f"pass tensors (jax.jit lowers a Python scalar as tensor<i32>)",
                    )

    def run(self, module: ir.Operation, context: PassContext) -> None:
        funcs = planned_functions(module)
        if len(funcs) != 1:
            self.fail(module, f"expects one entry function (@main), found {len(funcs)}")
        func = funcs[0]
        self._check_entry(func)
        if self.remat not in REMAT_MODES:
            self.fail(func, f"remat must be one of {', '.join(REMAT_MODES)}, got {self.remat!r}")
        start = time.perf_counter()
        with module.context, ir.Location.unknown():
            graph = FuncGraph.from_func(func)
            layering = read_layering(graph)
            if layering is None:
                layering = self._cluster(graph)
            timings = {"layering": time.perf_counter() - start}
            plan, stats = self.plan(module, func, graph, layering)
            timings.update(stats.pop("timings"))
            stage_of_op = _stage_of_ops(layering, plan)
            meshes = [
                StageMesh(
                    s["mesh"],
                    AXIS_NAMES,
                    tuple(s["logical_shape"]),
                    tuple(s["devices"]),
                    options=(("weight_update_sharding", s["intra_op"] == WEIGHT_UPDATE_SHARDING),),
                )
                for k, s in enumerate(plan.stages)
            ]
            per_layer = {k for k, s in enumerate(plan.stages) if s["remat_form"] == REMAT_LAYERS}
            kept = [
                (op.mlir_op, layer)
                for op, layer, role, stage in zip(  # constants: copied into every reader's fragment
                    graph.ops, layering.layers, layering.roles, stage_of_op
                )
                if stage in per_layer and role != "update" and op.operands
            ]
            strip_layering(func)
            i64 = ir.IntegerType.get_signless(64)
            for op, layer in kept:  # what hlopar-rematerialize's per-layer form follows
                op.attributes[LAYER_ATTR] = ir.IntegerAttr.get(i64, layer)
            emit = time.perf_counter()
            write_mpmd_program(
                module, stage_of_op, layering.roles, meshes, plan_shardings=self.plan_shardings, preset=self.preset
            )
            mark_rematerialized(module, {k: s["remat_form"] for k, s in enumerate(plan.stages) if s["remat"]})
            timings["mpmd_program"] = time.perf_counter() - emit
        if self.wants_report(context):
            timings["total"] = time.perf_counter() - start
            self.emit_report(module, context, self._report(plan, stats, timings))

    # ------------------------------------------------------------------ planning

    def plan(self, module, func, graph: FuncGraph, layering: Layering) -> tuple[PipelinePlan, dict]:
        """Layer ILPs on every logical mesh, then the DP for each microbatch count: the best
        pipeline and what the report says of the search."""
        timings = {}
        clock = time.perf_counter()
        run_function_pass(module, [func], "sdy-populate-op-sharding-rules")
        try:
            rules = {op.id: rule_of(op.mlir_op) for op in graph.walk()}
        finally:
            run_function_pass(module, [func], "sdy-drop-sharding-rules")
        timings["sharding_rules"] = time.perf_counter() - clock

        submeshes = submesh_shapes(self.num_hosts, self.devices_per_host)
        meshes, meshes_of_submesh, shapes = self._logical_meshes(submeshes)
        layers = [
            graph.subgraph([op.index for op in graph.ops if layering.layers[op.index] == l], name=f"layer{l}")
            for l in range(layering.num_layers)
        ]

        clock = time.perf_counter()
        new_state = {graph.results[r]: graph.args[a] for a, r in state_pairs(graph)}
        donated = frozenset(
            graph.results[r]
            for a, r in FuncSignature.of(func).aliases
            if new_state.get(graph.results[r]) == graph.args[a]
        )  # updated in place
        table = plan_layers(
            layers,
            rules,
            layering.roles,
            [(mesh, option == WEIGHT_UPDATE_SHARDING) for mesh, option in meshes],
            time_limit=self.time_limit,
            workers=self.workers or os.cpu_count() or 1,
            new_state=new_state,
            donated=donated,
        )
        plans, distinct, spawned = table.plans, table.solved, table.spawned
        timings["layer_ilps"] = time.perf_counter() - clock

        preset = cluster_preset(self.preset)
        arrays, received, handed = _layer_arrays(graph, layering, layers, plans, meshes, preset)
        host = None
        if preset.dispatch_s or preset.device_dispatch_s:
            devices = self.num_hosts * self.devices_per_host
            host = HostLaunches(
                preset.dispatch_s,
                preset.device_dispatch_s,
                handed,
                preset.value_dispatch_s,
                devices,
                preset.devices_share_host_cores,
                preset.value_launch_s,
            )
        chosen, (candidates, choice), hosts = self._best_pipeline(
            func, graph, layering, arrays, received, submeshes, meshes_of_submesh, shapes, timings, host
        )
        result = chosen.plan
        placement = chosen.placement  # stage -> mesh
        on_mesh = {}
        for stage, mesh in zip(result.stages, placement):
            on_mesh.setdefault(mesh, submeshes[stage.submesh_index])
        mesh_devices = assign_devices([on_mesh[j] for j in sorted(on_mesh)], hosts, self.devices_per_host)
        devices = [mesh_devices[mesh] for mesh in placement]
        plan = PipelinePlan(
            chosen.microbatches,
            result.total_latency,
            result.t_max,
            _stage_records(result, chosen.table, devices, placement, submeshes, meshes, shapes),
            _runner_ups(chosen.others, submeshes),
            tuple(candidates),
            chosen.schedule,
            choice,
            chosen.simulated,
        )
        stats = {
            "timings": timings,
            "layer_ilps": distinct,
            "layer_ilps_spawned": spawned,
            "logical_meshes": len(meshes),
            "hosts_used": hosts,
            "num_layers": layering.num_layers,
            "submeshes": [[s.hosts, s.devices] for s in submeshes],
        }
        return plan, stats

    def _best_pipeline(
        self, func, graph, layering, arrays, received, submeshes, meshes_of_submesh, shapes, timings, host
    ):
        """The best (schedule, count, stages) of `pipeline_choice.choose_pipeline`: the DP for
        each microbatch count (the split's where it ran, else the option's or the candidates)
        and, with schedule=auto, each schedule, ranked by simulated step time (else by Eq. 2);
        the candidate to write, the report's account of the choice, and how many hosts it uses
        (all of them; with `idle_hosts`, the first h where that is predicted faster, strictly)."""
        auto = self.schedule == AUTO_SCHEDULE
        split = read_microbatches(func)  # the one channel where the split ran
        if split is not None and self.microbatches is not None:
            self.fail(
                func,
                f"the program is already one of {split} microbatches (hlopar-split-microbatches): that count "
                f"is its hlopar.microbatches; leave microbatches unset (got microbatches={self.microbatches})",
            )
        if split is None:
            counts = self._microbatch_candidates(graph)
        elif auto and self.other_microbatches:
            counts = [split] + [c for c in _divisor_candidates(split * _batch_size(graph)) if c != split]
        else:
            counts = [split]
        space = PipelineSpace(
            arrays,
            received,
            meshes_of_submesh,
            [s.size for s in submeshes],
            self.num_hosts * self.devices_per_host,
            functools.partial(self._transfer_seconds, hosts=self.num_hosts),
            self._memory_per_device(),
            min(layering.num_layers, self.num_hosts * self.devices_per_host),
            remat=self.remat,
            num_stages=self.stages,
            epsilon=self.epsilon,
            split=split,
            mesh_shapes=shapes,
            host=host,
        )
        # Ties (one stage, or warm-ups clamped by few microbatches) go to the default schedule.
        schedules = (
            [get_schedule(DEFAULT_SCHEDULE)] + [get_schedule(n) for n in PLANNED_SCHEDULES if n != DEFAULT_SCHEDULE]
            if auto
            else [get_schedule(self.schedule)]
        )
        by = "simulation" if auto else "eq2"

        def chosen_on(hosts: int) -> Choice:
            devices = hosts * self.devices_per_host
            on_hosts = replace(
                space,
                num_devices=devices,
                transfer_seconds=functools.partial(self._transfer_seconds, hosts=hosts),
                max_stages=min(layering.num_layers, devices),
            )
            result = choose_pipeline(on_hosts, schedules, counts, by=by)
            for name, seconds in result.timings.items():
                timings[name] = timings.get(name, 0.0) + seconds
            return result

        choice, hosts = chosen_on(self.num_hosts), self.num_hosts
        written = _written(choice, counts, split)
        for fewer in range(1, self.num_hosts) if self.idle_hosts else ():
            other = chosen_on(fewer)
            candidate = _written(other, counts, split)
            if candidate is not None and (written is None or candidate.seconds < written.seconds):
                choice, written, hosts = other, candidate, fewer
        if written is None:
            reasons: dict[str, list[int]] = {}
            for c in choice.candidates:
                reasons.setdefault(c.why, [])
                if c.microbatches not in reasons[c.why]:
                    reasons[c.why].append(c.microbatches)
            why = "; ".join(f"{'B=' + ','.join(map(str, bs))}: {reason}" for reason, bs in reasons.items())
            self.fail(func, f"no pipeline fits the cluster: {why}")
        return written, _choice_report(choice, written, counts, split, auto), hosts

    def _logical_meshes(self, submeshes: tuple[Submesh, ...]):
        """Every (logical shape, intra-op option) of every submesh, deduplicated (shapes that
        differ only by axes of size 1, with the same links, plan identically). The options are
        the default plan and weight-update sharding (`INTRA_OP_OPTIONS`)."""
        meshes: list[tuple[LogicalMesh, str]] = []
        shapes: list[tuple[int, int]] = []
        index: dict = {}
        of_submesh = []
        for submesh in submeshes:
            mine = []
            for shape in logical_mesh_shapes(submesh):
                try:
                    mesh = logical_mesh(
                        shape,
                        AXIS_NAMES,
                        preset=self.preset,
                        devices_per_host=self.devices_per_host,
                        memory_budget=self.memory_per_device,
                    )
                except ValueError as error:
                    self.fail(ir.Location.unknown(), str(error))
                for intra_op in INTRA_OP_OPTIONS if mesh.size > 1 else INTRA_OP_OPTIONS[:1]:
                    key = (trivial_axes_key(mesh), tuple(sorted(shape)), intra_op)
                    if key not in index:
                        index[key] = len(meshes)
                        meshes.append((mesh, intra_op))
                        shapes.append(shape)
                    if index[key] not in mine:
                        mine.append(index[key])
            of_submesh.append(mine)
        return meshes, of_submesh, shapes

    def _cluster(self, graph: FuncGraph) -> Layering:
        """The layering when the input carries none; a refusal worded as
        `hlopar-cluster-operators` words it (the clustering is its)."""
        try:
            layering, _ = cluster_layers(graph, layers=self.layers)
        except ValueError as error:
            raise DiagnosticError(
                [Diagnostic("error", f"hlopar-cluster-operators: {error}", source_location(graph.mlir_func.location))]
            ) from None
        return layering

    def _microbatch_candidates(self, graph: FuncGraph) -> list[int]:
        if self.microbatches is not None:
            return [self.microbatches]
        return _divisor_candidates(_batch_size(graph))

    def _memory_per_device(self) -> float:
        return self.memory_per_device or cluster_preset(self.preset).device_memory_bytes

    def _transfer_seconds(self, nbytes: float, devices: int, *, hosts: int) -> float:
        """Alpha-beta time to bring `nbytes` into a stage of `devices` devices from another
        mesh: over the inter-host links when the stages are on several hosts (they may sit
        on different hosts), over the intra-host ones otherwise; every receiving device takes
        its share."""
        preset = cluster_preset(self.preset)
        if preset.transfer_bandwidth:  # the transport as calibrated (its cost per value: `span_costs`)
            return nbytes / preset.transfer_bandwidth
        if hosts > 1:
            return preset.inter_host_latency_s + nbytes / (preset.inter_host_bandwidth * devices)
        return preset.intra_host_latency_s + nbytes / (preset.intra_host_bandwidth * devices)

    def _report(self, plan: PipelinePlan, stats: dict, timings: dict) -> dict:
        stage_sum = sum(s["latency"] for s in plan.stages)
        busy = stage_sum * plan.microbatches
        bubble = 1.0 - busy / (len(plan.stages) * plan.total_latency) if plan.total_latency > 0 else 0.0
        return {
            "pass": self.name,
            "options": self.pipeline_text(),
            "cluster": {
                "num_hosts": self.num_hosts,
                "hosts_used": stats["hosts_used"],
                "devices_per_host": self.devices_per_host,
                "preset": self.preset,
                "memory_per_device": self._memory_per_device(),
            },
            "schedule": plan.schedule,
            **({"schedule_choice": plan.choice} if plan.choice is not None else {}),
            "microbatches": plan.microbatches,
            "predicted_step_seconds": plan.total_latency,
            "simulated_step_seconds": plan.simulated_step_seconds,
            "t_max": plan.t_max,
            "bubble_fraction": bubble,
            "stages": list(plan.stages),
            "runner_ups": list(plan.runner_ups),
            "microbatch_candidates": list(plan.candidates),
            "num_layers": stats["num_layers"],
            "submeshes": stats["submeshes"],
            "logical_meshes": stats["logical_meshes"],
            "layer_ilps_solved": stats["layer_ilps"],
            "layer_ilps_spawned": stats["layer_ilps_spawned"],
            "timings": timings,
        }


def schedule_choice_lines(choice: dict | None) -> list[str]:
    """What `schedule="auto"` chose and the runner-up, with their simulated step times
    (stage construction's `schedule_choice`)."""
    if not choice:
        return []

    def said(c: dict) -> str:
        chunks = f" ({c['chunks']} stages per mesh)" if c.get("chunks", 1) > 1 else ""
        return (
            f"{c['schedule']}{chunks}, {c['microbatches']} microbatch(es): "
            f"{c['simulated_step_seconds'] * 1e3:.3g} ms a step"
        )

    line = f"  schedule chosen (auto, simulated): {said(choice['chosen'])}"
    if choice.get("runner_up"):
        line += f"; runner-up {said(choice['runner_up'])}"
    return [line]


def mark_rematerialized(module: ir.Operation, stages: dict[int, str]) -> None:
    """Marks the backward fragments of these stages with their form: `hlopar.remat` (the stage
    form) or `hlopar.remat = "layers"`."""
    if not stages:
        return
    main = planned_functions(module)[0]
    for op in fragments(main):
        stage = fragment_stage(op)
        if stage is not None and fragment_role(op) == BACKWARD and stage in stages:
            form = stages[stage]
            op.attributes[REMAT_ATTR] = (
                ir.StringAttr.get(REMAT_LAYERS, module.context)
                if form == REMAT_LAYERS
                else ir.UnitAttr.get(module.context)
            )


def _stage_records(result, table, devices, placement, submeshes, meshes, shapes) -> tuple[dict, ...]:
    """Per stage of the DP's result, what the report and the MPMD writer read; `placement`
    the mesh of each stage (m<j>: several stages share one under virtual stages)."""
    stages = []
    num_stages = len(result.stages)
    for k, (stage, ids, mesh) in enumerate(zip(result.stages, devices, placement)):
        i, j, m, s = stage.start_layer, stage.end_layer, stage.submesh_index, num_stages - k
        g = int(table.mesh[i, j, m, s - 1])
        stages.append(
            {
                "intra_op": meshes[g][1],
                "stage": k,
                "mesh": f"m{mesh}",
                "layers": [i, j],
                "submesh": [submeshes[m].hosts, submeshes[m].devices],
                "logical_shape": list(shapes[g]),
                "devices": list(ids),
                "latency": float(table.latency[i, j, m, s - 1]),
                "memory_bytes": float(table.memory[i, j, m, s - 1]),
                "update_memory_bytes": float(table.update_memory[i, j, m, s - 1]),
                "remat": bool(table.remat[i, j, m, s - 1]),
                "remat_form": (REMAT_LAYERS if table.per_layer[i, j, m, s - 1] else REMAT_STAGE)
                if table.remat[i, j, m, s - 1]
                else None,
            }
        )
    return tuple(stages)


def _written(choice: Choice, counts: list[int], split: int | None) -> Candidate | None:
    """The candidate the program is written as: after a split, the best of the split's count
    (a better count is reported for a new split); else the best of all."""
    if split is None:
        return choice.best
    return next((c for c in choice.candidates if c.plan is not None and c.microbatches == counts[0]), None)


def _choice_report(
    choice: Choice, written: Candidate, counts: list[int], split: int | None, auto: bool
) -> tuple[list, dict | None]:
    """Per microbatch count, its best candidate (the report's `microbatch_candidates`); with
    schedule=auto also `schedule_choice`: the chosen, the runner-up (`Choice.runner_up`), every (schedule, count), and after a split a better count where one is
    predicted 5% faster (`BETTER_COUNT`)."""
    per_count: dict[int, dict] = {}
    for c in choice.candidates:
        if c.microbatches in per_count:
            continue
        if c.plan is None:
            per_count[c.microbatches] = {"microbatches": c.microbatches, "total_latency": None, "why": c.why}
        else:
            per_count[c.microbatches] = {
                "microbatches": c.microbatches,
                "total_latency": c.total_latency,
                "t_max": c.plan.t_max,
                "evaluated_t_max": c.evaluated_t_max,
                **({"schedule": c.schedule, "simulated_step_seconds": c.seconds} if auto else {}),
            }
    candidates = [per_count[b] for b in counts]
    if not auto:
        return candidates, None
    # After a split the other counts are estimates: the runner-up is of the count written.
    runner_up = choice.runner_up(written, same_count=split is not None)
    report = {
        "chosen": _candidate(written),
        "runner_up": None if runner_up is None else _candidate(runner_up),
        "candidates": [_candidate(c) for c in choice.candidates],
    }
    best = choice.best
    if (
        split is not None
        and best is not None
        and best.microbatches != split
        and best.seconds <= BETTER_COUNT * written.seconds
    ):
        report["better_microbatches"] = _candidate(best)
    return candidates, report


# A count other than the split's is worth a new split where predicted this much faster: the
# scaled pricing is an estimate, and the new split solves the layer ILPs again at its shapes.
BETTER_COUNT = 0.95


def _candidate(c: Candidate) -> dict:
    if c.plan is None:
        return {"schedule": c.schedule, "microbatches": c.microbatches, "simulated_step_seconds": None, "why": c.why}
    return {
        "schedule": c.schedule,
        "microbatches": c.microbatches,
        "simulated_step_seconds": c.seconds,
        "bubble_fraction": c.bubble_fraction,
        "total_latency": c.total_latency,
        "stages": len(c.plan.stages),
        **({"chunks": c.chunks} if c.chunks > 1 else {}),  # stages per mesh (virtual stages)
    }


def _divisor_candidates(batch: int) -> list[int]:
    """The counts `microbatches=auto` tries: every power of two that divides the batch."""
    return [b for b in (2**k for k in range(0, 12)) if b <= batch and batch % b == 0] or [1]


def _runner_ups(others, submeshes) -> tuple[dict, ...]:
    return tuple(
        {
            "total_latency": r.total_latency,
            "t_max": r.t_max,
            "stages": [
                {
                    "layers": [st.start_layer, st.end_layer],
                    "submesh": [submeshes[st.submesh_index].hosts, submeshes[st.submesh_index].devices],
                }
                for st in r.stages
            ],
        }
        for r in others[:3]
    )


def _is_ranked_tensor(t: ir.Type) -> bool:
    try:
        ir.RankedTensorType(t)
    except ValueError:
        return False
    return True


def _stage_of_ops(layering: Layering, plan: PipelinePlan) -> list[int]:
    stage_of_layer = {}
    for k, stage in enumerate(plan.stages):
        first, last = stage["layers"]
        for layer in range(first, last + 1):
            stage_of_layer[layer] = k
    return [stage_of_layer[layer] for layer in layering.layers]


def _batch_size(graph: FuncGraph) -> int:
    """The leading dim of the step's batch arguments (`step_io.batch_arguments`); 1
    when it has none. Where the batch is ambiguous (an inference program's input beside its
    weights), the common divisor of the candidates' leading dims: `microbatches=auto` only
    prices splits here, and a count dividing every candidate is one any of them allows."""
    pairs = state_pairs(graph)
    try:
        batch_args = batch_arguments(graph, pairs)
    except RolesError:
        batch_args = batch_candidates(graph, pairs)
    sizes = [graph.values[graph.args[i]].shape[0] for i in batch_args]
    return math.gcd(*(int(s) for s in sizes if s)) if any(sizes) else 1


def _streamed_readers(graph: FuncGraph, layering: Layering, v: int) -> set[int]:
    """The layers whose forward or backward read value v per microbatch, where the MPMD
    program streams it (`pipeline_program`): made by a forward or backward op that is not a
    constant (those are copied into each fragment that reads them); else none."""
    producer = graph.values[v].producer
    if producer is None or layering.roles[producer] not in (FORWARD, BACKWARD):
        return set()
    if is_floating(graph.ops[producer]):
        return set()
    return {layering.layers[u] for u in graph.values[v].users if layering.roles[u] in (FORWARD, BACKWARD)}


def _layer_arrays(
    graph: FuncGraph, layering: Layering, layers: list[FuncGraph], plans, meshes, preset
) -> tuple[LayerArrays, np.ndarray, np.ndarray]:
    """The per-layer arrays of `span_costs`, the bytes each layer reads from each other, and
    per role and layer the values its fragments hand over (`handed`, where the preset prices
    them).
    Each layer's latencies gain the preset's per-kernel overheads (`ClusterPreset.op_seconds`):
    its forward and backward kernels' in the part paid per microbatch, its update kernels'
    (run once per step) in the rest; and, likewise, what its fragments pay per value they
    read or write (`boundary_values`; not in the forward share a rematerializing backward
    recomputes: that runs inside the backward's fragment)."""
    meshes = [mesh for mesh, _ in meshes]
    L, G = len(layers), len(meshes)

    def field_of(name):
        return np.array([[getattr(plans[l][g], name) for l in range(L)] for g in range(G)], dtype=float)

    overhead = np.zeros((len(ROLES), L))
    handed = np.zeros((len(ROLES), L))  # values per role and layer
    for l, layer in enumerate(layers):
        counts = kernel_counts(layer, layering.roles)
        overhead[:, l] = [preset.op_seconds(*counts[role]) for role in ROLES]
        if preset.value_launch_s or preset.value_dispatch_s:
            values = boundary_values(graph, layering.layers, layering.roles, l, layer)
            handed[:, l] = [values[role] for role in ROLES]
    forward_overhead = overhead[0]
    overhead += handed * preset.value_launch_s
    per_microbatch_overhead = overhead[0] + overhead[1]

    received = np.zeros((L, L))
    producers, readers_of = [], []  # each tensor another layer reads: its layer, its readers'
    inputs = np.zeros((G, L, L))
    resharding = np.zeros((G, L, L))
    result_position = [{v: k for k, v in enumerate(layer.results)} for layer in layers]
    arg_position = [{v: k for k, v in enumerate(layer.args)} for layer in layers]
    for a, layer in enumerate(layers):
        for v in layer.results:
            readers = {layering.layers[u] for u in graph.values[v].users} - {a}
            info = tensor_info(graph, v)
            forward_readers = {layering.layers[u] for u in graph.values[v].users if layering.roles[u] == FORWARD}
            streamed = _streamed_readers(graph, layering, v) - {a} if preset.transfer_latency_s else ()
            if streamed and info.is_tensor:
                producers.append(a)
                readers_of.append(tuple(streamed))
            for b in readers:
                received[a, b] += info.dtype_bytes * math.prod(info.shape) if info.is_tensor else 0
                if b > a and b in forward_readers:
                    for g, mesh in enumerate(meshes):
                        inputs[g, a, b] += value_bytes(info, plans[b][g].arg_layouts[arg_position[b][v]], mesh)
                if not info.is_tensor or not info.shape:
                    continue
                low, high = min(a, b), max(a, b)
                for g, mesh in enumerate(meshes):
                    src = plans[a][g].result_layouts[result_position[a][v]]
                    dst = plans[b][g].arg_layouts[arg_position[b][v]]
                    if src is not None and dst is not None and src != dst:
                        resharding[g, low, high] += resharding_cost(info.shape, info.dtype_bytes, src, dst, mesh)
    arrays = LayerArrays(
        latency=field_of("latency") + overhead.sum(axis=0),
        fixed_latency=field_of("fixed_latency") + per_microbatch_overhead,
        state_bytes=field_of("state_bytes"),
        gradient_bytes=field_of("gradient_bytes"),
        activation_bytes=field_of("activation_bytes"),
        updated_state_bytes=field_of("updated_state_bytes"),
        temporary_bytes=field_of("temporary_bytes"),
        resharding=resharding,
        forward_latency=field_of("forward_latency") + forward_overhead,
        forward_fixed_latency=field_of("forward_fixed_latency") + forward_overhead,
        input_bytes=inputs,
        launch_s=preset.executable_launch_s,
        received_values=values_received_by_span(producers, readers_of, L) if preset.transfer_latency_s else None,
        transfer_latency_s=preset.transfer_latency_s,
    )
    return arrays, received, handed
