"""The planner's memory held against XLA's: every fragment compiled, its memory compared.

For each fragment of a pipeline program, `check_memory` puts side by side the predicted
per-device memory of its executable (`analysis.fragment_memory`: the planner's layouts,
never XLA's numbers) and what stock jaxlib allocates for it (`memory_analysis()` of the
same module compiled for its mesh's devices: arguments, outputs, temporaries, aliased).

What the schedule keeps alive on a mesh around a fragment is added to both (`resident`):
the step's state on the mesh that the fragment does not read (parameters, optimizer state),
the gradient accumulators it does not take, and the stashes of the other microbatches in
flight (the most `stash.*` buffers the mesh's instruction stream holds at once, less the
fragment's own microbatch). Not counted: the buffers of activations and gradients in
transit between meshes (received and not yet used, made and not yet sent), the runtime's
own allocations, and fragmentation.

A fragment whose compiled memory plus what stays resident exceeds the device memory is
refused (`check_memory(..., device_memory=...)` raises a `DiagnosticError` naming the
fragment, its mesh, both numbers and the device memory): the plan is rejected before any
worker starts. The executables compiled here are the ones that run (`executable_cache`); a
program that runs as one executable (`one_program`: one mesh, one microbatch) is checked as
that one executable. The check compiles for the devices this process has; a mesh with more
devices than that is reported unchecked (`skipped`), never refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hlopar.analysis.fragment_memory import FragmentMemory, fragment_memory, io_tiles
from hlopar.analysis.schedules import PipelineStreams
from hlopar.analysis.schedules.instructions import FREE
from hlopar.codegen.pipeline_program import BACKWARD, FORWARD, WEIGHT, PipelineProgram, ProgramFragment
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.units import format_bytes

if TYPE_CHECKING:
    from hlopar.codegen.executable_cache import ExecutableCache

__all__ = ["WHOLE", "FragmentCheck", "MemoryCheck", "check_memory", "compiled_memory"]

WHOLE = "whole"  # the role of the check of a program compiled as one executable (`one_program`)


@dataclass(frozen=True)
class FragmentCheck:
    """One fragment: predicted and compiled memory of its executable, per device, and what
    the schedule keeps resident beside it."""

    fragment: str
    mesh: str
    role: str
    devices: int
    predicted: FragmentMemory
    compiled: FragmentMemory | None  # None: not compiled (`MemoryCheck.skipped` says why)
    resident: int

    @property
    def ratio(self) -> float | None:
        """Predicted over compiled total (None when not compiled)."""
        if self.compiled is None or self.compiled.total == 0:
            return None
        return self.predicted.total / self.compiled.total

    @property
    def need(self) -> int:
        """Bytes per device while it runs: the compiled executable (else the prediction) and
        what stays resident."""
        return (self.compiled or self.predicted).total + self.resident

    def to_json(self) -> dict:
        return {
            "fragment": self.fragment,
            "mesh": self.mesh,
            "role": self.role,
            "devices": self.devices,
            "predicted": self.predicted.to_json(),
            "compiled": self.compiled.to_json() if self.compiled is not None else None,
            "ratio": self.ratio,
            "resident": self.resident,
            "need": self.need,
        }


@dataclass(frozen=True)
class MemoryCheck:
    """Every fragment's check, the device memory they were held against, and the meshes not
    compiled (with why)."""

    fragments: tuple[FragmentCheck, ...]
    device_memory: float | None
    platform: str | None  # the backend the fragments were compiled for
    skipped: Mapping[str, str]  # mesh -> why its fragments were not compiled
    stage_memory: Mapping[str, float]  # mesh -> stage construction's estimate for its stage (Eq. 5)

    def meshes(self) -> list[dict]:
        """Per mesh, the most a fragment needs (compiled, predicted) beside stage
        construction's estimate for the stage."""
        rows = []
        for mesh in dict.fromkeys(f.mesh for f in self.fragments):
            mine = [f for f in self.fragments if f.mesh == mesh]
            compiled = [f.need for f in mine if f.compiled is not None]
            rows.append(
                {
                    "mesh": mesh,
                    "predicted_peak": max(f.predicted.total + f.resident for f in mine),
                    "compiled_peak": max(compiled) if compiled else None,
                    "stage_construction": self.stage_memory.get(mesh),
                }
            )
        return rows

    def to_json(self) -> dict:
        return {
            "device_memory": self.device_memory,
            "platform": self.platform,
            "skipped": dict(self.skipped),
            "meshes": self.meshes(),
            "fragments": [f.to_json() for f in self.fragments],
        }

    def over(self) -> list[FragmentCheck]:
        """Per mesh, the fragment that needs the most memory, where it does not fit."""
        if self.device_memory is None:
            return []
        worst: dict[str, FragmentCheck] = {}
        for f in self.fragments:
            if f.compiled is not None and f.need > max(
                self.device_memory, worst[f.mesh].need if f.mesh in worst else 0
            ):
                worst[f.mesh] = f
        return list(worst.values())


def compiled_memory(executable) -> FragmentMemory:
    """XLA's per-device memory of a loaded executable (`memory_analysis()`)."""
    stats = executable.get_compiled_memory_stats()
    return FragmentMemory(
        int(stats.argument_size_in_bytes),
        int(stats.output_size_in_bytes),
        int(stats.alias_size_in_bytes),
        int(stats.temp_size_in_bytes),
    )


def check_memory(
    program: PipelineProgram,
    streams: PipelineStreams,
    *,
    device_memory: float | None = None,
    devices: Sequence | None = None,
    executables: ExecutableCache | None = None,
    stage_memory: Mapping[str, float] | None = None,
) -> MemoryCheck:
    """Predicts, compiles (through `executables`, which keeps them for the runtime: they are
    what it runs) and compares every executable of the program: each fragment, or the
    program as one (`one_program`, where it runs so: one check named by its fragments, role
    `WHOLE`, nothing resident beside it); raises `DiagnosticError` when one does not fit
    `device_memory`. `devices`: the local devices, indexed by physical id (default
    `jax.devices()`); `stage_memory`: stage construction's estimate per mesh, reported
    beside."""
    import jax

    from hlopar.codegen.executable_cache import ExecutableCache
    from hlopar.codegen.one_program import one_program

    executables = executables if executables is not None else ExecutableCache()
    devices = list(jax.devices()) if devices is None else list(devices)
    skipped = {
        mesh: f"mesh {mesh} uses devices {list(ids)}; this process has {len(devices)}"
        for mesh, ids in program.devices.items()
        if max(ids, default=-1) >= len(devices)
    }
    whole = one_program(program)
    if whole is not None:
        units = [("+".join(f.name for f in program.fragments), program.meshes[0], WHOLE, whole)]
        resident = {units[0][0]: 0}
    else:
        units = [(f.name, f.mesh, f.role, f.module) for f in program.fragments]
        resident = _resident(program, streams, _value_tiles(program))
    # Compiled at once (`ExecutableCache.executables`: XLA's compilations in threads).
    here = [(name, mesh, module) for name, mesh, _, module in units if mesh not in skipped]
    made = executables.executables(
        [(module, [devices[i] for i in program.devices[mesh]], name) for name, mesh, module in here]
    )
    compiled_units = {name: compiled_memory(executable.spmd.executable) for (name, *_), executable in zip(here, made)}
    checks = []
    for name, mesh, role, module in units:
        compiled = compiled_units.get(name)
        checks.append(
            FragmentCheck(
                name, mesh, role, len(program.devices[mesh]), fragment_memory(module), compiled, resident[name]
            )
        )
    check = MemoryCheck(
        tuple(checks), device_memory, devices[0].platform if devices else None, skipped, dict(stage_memory or {})
    )
    over = check.over()
    if over:
        raise DiagnosticError([Diagnostic("error", _refusal(f, device_memory)) for f in over])
    return check


def _refusal(f: FragmentCheck, device_memory: float) -> str:
    c = f.compiled
    return (
        f"the plan does not fit the devices' memory: fragment {f.fragment} on mesh {f.mesh} needs {_bytes(f.need)} "
        f"per device as XLA compiles it (the executable {_bytes(c.total)}: arguments {_bytes(c.arguments)}, "
        f"outputs {_bytes(c.outputs)}, temporaries {_bytes(c.temporaries)}, less {_bytes(c.aliased)} aliased; "
        f"plus {_bytes(f.resident)} the schedule keeps resident on the mesh), the planner predicted "
        f"{_bytes(f.predicted.total + f.resident)}; a device has {_bytes(device_memory)} "
        "(memory_per_device, else the cluster preset's)"
    )


def _bytes(n: float) -> str:
    return f"{int(n)} B" if n < 1024 else f"{int(n)} B ({format_bytes(n)})"


def _value_tiles(program: PipelineProgram) -> dict[int, int]:
    """Bytes per device of every value a fragment reads or makes, from its module's layouts."""
    tiles: dict[int, int] = {}
    for f in program.fragments:
        arguments, results = io_tiles(f.module)
        for v, nbytes in zip(f.operands, arguments[len(f.accumulate) :]):
            tiles.setdefault(v, nbytes)
        for v, nbytes in zip(f.results, results):
            tiles.setdefault(v, nbytes)
    return tiles


def _resident(program: PipelineProgram, streams: PipelineStreams, tiles: Mapping[int, int]) -> dict[str, int]:
    """Per fragment, the bytes per device its mesh keeps alive while it runs and that its
    executable neither takes nor makes (module docstring)."""
    in_flight = {s.mesh: _most_stashes(s.instructions) for s in streams.streams}
    resident = {}
    for mesh in program.meshes:
        mine = [f for f in program.fragments if f.mesh == mesh]
        state = {
            v
            for f in mine
            for v in f.operands
            if program.values[v].argument is not None and not program.values[v].per_microbatch
        }
        sums = {f.results[k] for f in mine for k in f.accumulate}
        stash = sum(tiles.get(v, 0) for v in _stash_values(program, mine))
        for f in mine:
            held = set(f.operands) | set(f.results)
            others = sum(tiles.get(v, 0) for v in (state | sums) - held)
            if f.role in (FORWARD, BACKWARD, WEIGHT):
                others += stash * max(in_flight.get(mesh, 1) - 1, 0)
            resident[f.name] = others
    return resident


def _stash_values(program: PipelineProgram, fragments: Sequence[ProgramFragment]) -> set[int]:
    """What a mesh's backward reads per microbatch of its forward's results and of the
    microbatch's examples (as `PipelineProgram`'s stash_bytes, per device)."""
    read = {v for f in fragments if f.role in (BACKWARD, WEIGHT) for v in f.operands}
    forward = {v for f in fragments if f.role == FORWARD for v in f.results}
    return {
        v for v in read if v in forward or (program.values[v].argument is not None and program.values[v].per_microbatch)
    }


def _most_stashes(instructions) -> int:
    """The most `stash.*` buffers a stream holds at once."""
    live: set[str] = set()
    most = 0
    for inst in instructions:
        live.update(name for name, _ in inst.allocates if name.startswith("stash."))
        most = max(most, len(live))
        if inst.op == FREE:
            live.discard(inst.buffer)
    return most
