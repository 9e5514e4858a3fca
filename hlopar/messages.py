"""What a `parallelize` user reads: its errors and warnings, pass messages in its terms, and
the plan described in a few lines (`hlopar.api`; `hlopar-compile` words its own, cli/compile.py)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from hlopar.codegen.one_program import fuses
from hlopar.dialect.layers import LayerPieces
from hlopar.passes.reroll_stage_loops import stage_loop_lines
from hlopar.passes.stage_construction import schedule_choice_lines
from hlopar.units import format_bytes

if TYPE_CHECKING:
    from hlopar.api import PlannedStep

__all__ = ["HloparWarning", "PlanningError", "defined_at", "describe_plan", "in_api_terms", "memory_lines"]


class HloparWarning(UserWarning):
    """A planning pass's warning (what the plan computes differently, or could not plan)."""


class PlanningError(ValueError):
    """The step cannot be parallelized as written: the message says why, where in the
    user's code, and which argument of `parallelize` settles it."""


# Pass options the messages name -> the `parallelize` arguments that set them.
_API_OPTIONS = (
    (re.compile(r"\bbatch-args=\.\.\."), "batch_argnums=... (the positional arguments that hold the batch)"),
    (re.compile(r"\bbatch-args="), "batch_argnums="),
    (re.compile(r"(?<![\w-])microbatches="), "num_microbatches="),
    (re.compile(r"\brng=per-microbatch"), 'rng="per-microbatch"'),
    (
        re.compile(r"\bgive loss-result=N\b"),
        "name the loss with loss=..., a result's path such as \"[2]['loss']\" or a function of the results",
    ),
    (re.compile(r"\bloss-result="), "loss_result="),
)


def in_api_terms(message: str, name: str | None = None) -> str:
    """A pass's message as a `parallelize` user reads it: options named as its arguments,
    `@main` as the step's `name`, no placeholder file for what has no source line (an
    argument, the whole step)."""
    for pattern, replacement in _API_OPTIONS:
        message = pattern.sub(replacement, message)
    if name is not None:
        message = re.sub(r"@main\b", name, message)
    return re.sub(r"(?m)^-: ", "", message)


def defined_at(fn: Callable) -> str:
    """` (file:line)` of a Python function's definition, or nothing."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def describe_plan(planned: PlannedStep) -> str:
    """The plan in a few lines: stages, meshes and devices, how many tensors are sharded."""
    program = planned.program
    report = planned.plan.get("stages") or {}
    lines = [
        f"plan: {_stages_on_meshes(program)}, {program.microbatches} microbatch(es), schedule "
        f"{planned.schedule.name}{' (cached)' if planned.cached else ''}"
    ]
    lines += schedule_choice_lines(report.get("schedule_choice"))
    stages = {s["stage"]: s for s in (report.get("stages") or [])}
    for mesh in program.meshes:
        held = program.stages_of_mesh.get(mesh) or (program.stage_of_mesh.get(mesh),)
        infos = [stages.get(stage, {}) for stage in held]
        fragments = [f for f in program.fragments if f.mesh == mesh]
        shardings = [dims for f in fragments for dims in _SHARDING.findall(f.text)]
        sharded = sum(1 for dims in shardings if '"' in dims)
        shape = "x".join(str(s) for s in infos[0].get("logical_shape", ())) or "?"
        latency = ", ".join(f"{info['latency'] * 1e3:.3g}" for info in infos if info.get("latency"))
        latency = f", predicted {latency} ms/microbatch" if latency else ""
        remat = [info for info in infos if info.get("remat")]
        per = "layer" if any(info.get("remat_form") == "layers" for info in remat) else "stage"
        latency += f"; forward recomputed in the backward (remat, per {per})" if remat else ""
        which = f"stage {held[0]}" if len(held) == 1 else f"stages {', '.join(map(str, held))}"
        lines.append(
            f"  {mesh}: {which}, mesh {shape} on devices {list(program.devices[mesh])}, "
            f"fragments {', '.join(f.name for f in fragments)}; {sharded} of {len(shardings)} "
            f"annotated tensors sharded{latency}"
        )
    if fuses(program):
        lines.append(
            "  runs as one executable: its fragments fused into one program (one mesh, one microbatch), "
            "as jax.jit compiles the step"
        )
    pieces = planned.plan.get("layer_pieces")
    if pieces:
        pieces = LayerPieces.from_json(pieces)
        stacks = len({o for o, p in zip(pieces.arg_origin, pieces.arg_piece) if p >= 0})
        layers = pieces.layers
        lines.append(
            f"  scanned layer stack unrolled: {stacks} stacked argument(s) split into {layers} per-layer "
            "pieces, each held by its stage"
        )
        reroll = planned.plan.get("reroll")
        if reroll is None:
            lines.append("  each stage runs its layers unrolled (parallelize(stage_loops=True) runs them as loops)")
        else:
            lines += stage_loop_lines(reroll)
    lines += memory_lines(planned.plan.get("memory"))
    return "\n".join(lines)


def _stages_on_meshes(program) -> str:
    """ "4 stage(s)", or "8 stage(s) on 4 meshes" where meshes hold several (virtual stages)."""
    count = sum(max(1, len(program.stages_of_mesh.get(mesh, ()))) for mesh in program.meshes)
    return f"{count} stage(s)" + (f" on {len(program.meshes)} meshes" if count != len(program.meshes) else "")


def memory_lines(memory: dict | None) -> list[str]:
    """Per mesh, the most memory a fragment needs as compiled (with what stays resident), and
    the device's (docs/codegen.md, memory.json)."""
    if not memory:
        return []
    device = memory.get("device_memory")
    of = f" of {format_bytes(device)} per device" if device else ""
    peaks = [
        f"{m['mesh']} {format_bytes(m['compiled_peak'])}"
        for m in memory.get("meshes", ())
        if m.get("compiled_peak") is not None
    ]
    return [f"  memory (compiled, peak fragment + resident){of}: {', '.join(peaks)}"] if peaks else []


_SHARDING = re.compile(r"#sdy\.sharding<@[\w.]+, \[(.*?)\]>")
