"""What a step took, as a runtime measured it (`ParallelizedFunction.last_stats`): the
driver's wall time and, on Ray, each worker's timing and what it ran and sent, when."""

from __future__ import annotations

from dataclasses import dataclass, field

from hlopar.analysis.schedules.timeline import KINDS, Span, Timeline

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one step took: the driver's wall time and each worker's timing."""

    wall_s: float
    workers: dict[str, dict] = field(default_factory=dict)  # per worker: its timing
    sent: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments the driver sent
    kept: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments it kept
    mesh_of: dict[str, str] = field(default_factory=dict)  # worker -> its mesh
    spans: dict[str, list[tuple]] = field(default_factory=dict)  # per worker: what it ran and sent, when
    started: float = 0.0  # the driver's wall clock when the step began
    pulled: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per worker: arguments kept by another mesh

    def timeline(self) -> Timeline:
        """The step as the workers measured it, one row per worker, times from the driver's
        start of the step (wall clocks: on a real cluster as good as the hosts' clock sync)."""
        spans = [
            Span(
                name,
                lane,
                kind if kind in KINDS else "other",
                start - self.started,
                end - self.started,
                microbatch,
                peer,
            )
            for name, rows in self.spans.items()
            for lane, kind, microbatch, peer, start, end in rows
        ]
        return Timeline(f"measured step: {self.wall_s * 1e3:.3g} ms on the driver", tuple(self.spans), tuple(spans))

    @property
    def executable_s(self) -> float:
        """Sum over meshes of the time spent running executables (the workers of a spanning
        mesh run them together: its slowest worker's)."""
        per_mesh: dict[str, float] = {}
        for name, w in self.workers.items():
            mesh = self.mesh_of.get(name, name)
            per_mesh[mesh] = max(per_mesh.get(mesh, 0.0), w.get("run_s", 0.0))
        return sum(per_mesh.values())
