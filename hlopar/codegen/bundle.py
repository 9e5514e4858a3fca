"""The compiled bundle of a planned pipeline: what `hlopar-compile` writes (docs/codegen.md).

    DIR/plan.json              the hlopar-auto-parallel report (split, clustering, stages, cross_mesh)
    DIR/program.mlir           the planned MPMD program
    DIR/pipeline.json          the program as a pipeline reads it (`PipelineProgram.summary`)
    DIR/simulation.json        the simulated step: iteration time, bubble, peak memory, costs used
    DIR/memory.json            every fragment's per-device memory, predicted and as XLA compiles it
    DIR/timeline.png           the simulated timeline, one row per mesh (matplotlib; when asked)
    DIR/timeline.json          the same as a Chrome trace (Perfetto, chrome://tracing)
    DIR/meshes/<mesh>/<fragment>.mlir   each fragment's executable module
    DIR/meshes/<mesh>/stream.txt        the mesh's instruction stream, as text
    DIR/meshes/<mesh>/stream.json       the same, as JSON

The simulation prices each RUN from the stage-construction report: a stage's latency per
microbatch, split between its forward and backward by the FLOPs of its forward and backward
fragments (`analysis.flops`), and a split backward between B and W by the FLOPs of its B
and W fragments; each SEND by the `predicted_time` of the cross-mesh transfers
it carries (the cross-mesh resharding pass's simulator), summed; an `mpmd.transfer` that was
not planned costs what `fallback` (an alpha-beta model) says for its bytes.

Before anything is written, every executable is compiled and its memory checked against the
device memory of the plan's cluster (`codegen.memory_check`): a plan that does not fit is
refused (`DiagnosticError`). The executables compiled are kept for the runtime
(`codegen.executable_cache`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hlopar.analysis.schedules import (
    AlphaBeta,
    MeshStream,
    PipelineStreams,
    Schedule,
    SimResult,
    StageCost,
    Timeline,
    draw_timeline,
    simulate,
    write_chrome_trace,
)
from hlopar.analysis.schedules.instructions import Instruction
from hlopar.analysis.schedules.tasks import WEIGHT
from hlopar.codegen.memory_check import check_memory
from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.ir.module import print_module

if TYPE_CHECKING:
    from hlopar.codegen.executable_cache import ExecutableCache

__all__ = ["PlannedComm", "read_streams", "simulation_summary", "stage_costs", "write_bundle"]


def stage_costs(program: PipelineProgram, stage_latencies: Sequence[float]) -> list[StageCost]:
    """Per stage, its latency per microbatch split between forward and backward by FLOPs, and
    the backward between B and W by theirs when the program's backwards are split."""
    if len(stage_latencies) != program.topology.num_stages:
        raise ValueError(f"{len(stage_latencies)} stage latencies for {program.topology.num_stages} stages")
    costs = []
    for k, latency in enumerate(stage_latencies):
        forward, backward = program.stage_flops(k)
        share = forward / (forward + backward) if forward + backward > 0 else 0.5
        cost = StageCost(forward=latency * share, backward=latency * (1 - share))
        if program.split_backward and backward > 0:
            cost = replace(cost, weight_fraction=program.stage_weight_flops(k) / backward)
        costs.append(cost)
    return costs


@dataclass(frozen=True)
class PlannedComm:
    """The simulator's communication model from the plan: a SEND from mesh a to mesh b takes
    the predicted times of the transfers it carries (`seconds[a, b]`), whatever its byte count;
    the receiving mesh takes one transfer at a time (its inbound link)."""

    seconds: Mapping[tuple[str, str], float]

    def time(self, src: str, dst: str, nbytes: int) -> float:
        return self.seconds.get((src, dst), 0.0)

    def links(self, src: str, dst: str) -> tuple[str, ...]:
        return (f"{dst}/in",)

    @classmethod
    def of(cls, program: PipelineProgram, fallback: AlphaBeta = AlphaBeta()) -> PlannedComm:
        seconds = {}
        for (src, dst), indices in program.carried.items():
            total = 0.0
            for i in indices:
                t = program.transfers[i]
                total += t.plan.predicted_time if t.plan is not None else fallback.time(src, dst, t.nbytes)
            seconds[src, dst] = total
        return cls(seconds)


def simulation_summary(
    program: PipelineProgram,
    streams: PipelineStreams,
    costs: Sequence[StageCost],
    comm: PlannedComm,
    result: SimResult,
    predicted: float | None = None,
) -> dict:
    """`simulation.json`: the simulated step and the costs it was given."""
    return {
        "schedule": streams.schedule,
        "microbatches": streams.num_microbatches,
        "iteration_time_s": result.iteration_time,
        "bubble_fraction": result.bubble_fraction,
        "peak_memory_bytes": {m: result.peak_memory.get(m, 0) for m in result.meshes},
        "compute_busy_s": dict(result.compute_busy),
        "stage_construction_step_s": predicted,
        "stages": [
            {
                "stage": k,
                "mesh": program.topology.meshes[k],
                "forward_s": c.forward,
                "backward_s": c.backward,
                "weight_s": c.run_time(WEIGHT, True) if streams.split_backward else None,
                "forward_flops": program.stage_flops(k)[0],
                "backward_flops": program.stage_flops(k)[1],
                "weight_flops": program.stage_weight_flops(k),
            }
            for k, c in enumerate(costs)
        ],
        "sends": [
            {
                "src": src,
                "dst": dst,
                "seconds": seconds,
                "transfers": [program.transfers[i].name for i in program.carried[src, dst]],
            }
            for (src, dst), seconds in sorted(comm.seconds.items())
        ],
    }


def write_bundle(
    directory: str | Path,
    program: PipelineProgram,
    module_text: str,
    plan: Mapping,
    schedule: str | Schedule,
    memory_check: bool = True,
    *,
    executables: ExecutableCache | None = None,
    timeline_png: bool = False,
) -> dict:
    """Writes the bundle into `directory` (which must exist and be empty); returns the
    simulation summary. `plan` is the hlopar-auto-parallel report (its `stages` give the
    per-stage latencies, its `stages.cluster` the device memory). With `memory_check`, every
    executable is compiled first (through `executables`, which keeps them for the runtime)
    and a plan that does not fit the device memory is refused
    (`codegen.memory_check.check_memory` raises), nothing written; else the check is
    `memory.json` and `plan["memory"]` (`plan` must then be a dict). `timeline_png`: also
    draw the simulated timeline (matplotlib, a second or two: only when asked)."""
    directory = Path(directory)
    streams = program.streams(schedule)
    memory = None
    if memory_check:
        report = plan.get("stages") or {}
        estimates: dict[str, float] = {}  # per mesh, its stages' estimates summed (virtual stages: several)
        for s in report.get("stages") or ():
            if "memory_bytes" in s and s["stage"] < program.topology.num_stages:
                mesh = program.topology.meshes[s["stage"]]
                estimates[mesh] = estimates.get(mesh, 0) + s["memory_bytes"]
        memory = check_memory(
            program,
            streams,
            device_memory=(report.get("cluster") or {}).get("memory_per_device"),
            executables=executables,
            stage_memory=estimates,
        ).to_json()
        plan["memory"] = memory
    stages = (plan.get("stages") or {}).get("stages") or []
    latencies = {s["stage"]: float(s["latency"]) for s in stages}
    missing = [k for k in range(program.topology.num_stages) if k not in latencies]
    if missing:
        raise ValueError(f"the plan report gives no latency for stages {missing}")
    costs = stage_costs(program, [latencies[k] for k in range(program.topology.num_stages)])
    comm = PlannedComm.of(program)
    result = simulate(streams, costs, comm)
    summary = simulation_summary(
        program, streams, costs, comm, result, (plan.get("stages") or {}).get("predicted_step_seconds")
    )

    (directory / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    (directory / "program.mlir").write_text(module_text if module_text.endswith("\n") else module_text + "\n")
    (directory / "pipeline.json").write_text(json.dumps(program.summary(), indent=1) + "\n")
    for mesh in program.meshes:
        (directory / "meshes" / mesh).mkdir(parents=True)
    for fragment in program.fragments:
        (directory / "meshes" / fragment.mesh / f"{fragment.name}.mlir").write_text(
            print_module(fragment.module) + "\n"
        )
    for stream in streams.streams:
        where = directory / "meshes" / stream.mesh
        (where / "stream.txt").write_text(_stream_text(streams, stream))
        (where / "stream.json").write_text(
            json.dumps(
                {
                    "schedule": streams.schedule,
                    "num_microbatches": streams.num_microbatches,
                    "split_backward": streams.split_backward,
                    "mesh": stream.mesh,
                    "stage": stream.stage,
                    "instructions": [i.to_dict() for i in stream.instructions],
                },
                indent=1,
            )
            + "\n"
        )
    (directory / "simulation.json").write_text(json.dumps(summary, indent=1) + "\n")
    if memory is not None:
        (directory / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
    timeline = Timeline.of(result)
    if timeline_png:
        draw_timeline(timeline, directory / "timeline.png")
    write_chrome_trace(timeline, directory / "timeline.json")
    return summary


def _stream_text(streams: PipelineStreams, stream: MeshStream) -> str:
    plural = "" if streams.num_microbatches == 1 else "es"
    head = f"# schedule {streams.schedule}, {streams.num_microbatches} microbatch{plural}"
    return f"{head}\n{stream}\n"


def read_streams(directory: str | Path) -> PipelineStreams:
    """Every mesh's `stream.json` of a bundle, as one `PipelineStreams` (meshes in stage order)."""
    directory = Path(directory)
    parts = [json.loads(p.read_text()) for p in sorted((directory / "meshes").glob("*/stream.json"))]
    if not parts:
        raise ValueError(f"{directory}: no meshes/*/stream.json")
    parts.sort(key=lambda p: p["stage"])
    first = parts[0]
    streams = tuple(
        MeshStream(p["mesh"], int(p["stage"]), tuple(Instruction.from_dict(i) for i in p["instructions"]))
        for p in parts
    )
    return PipelineStreams(first["schedule"], int(first["num_microbatches"]), bool(first["split_backward"]), streams)
