"""A pipeline step's timeline, simulated or measured: drawn with matplotlib and written as a
Chrome trace.

A `Timeline` is plain data: per mesh, the compute spans (F forward, B backward, W weight
gradients, other compute: the update) and the transfers it sends (activations, gradients),
with their microbatch. `Timeline.of(result)` takes it from the schedule simulator;
`runtime.step_stats.StepStats.timeline` from a step the Ray workers measured.

- `draw_timeline`: a PNG like Figure 4 of the cross-mesh paper: one row per mesh (compute
  above, its sends in a thin band below), time in round units (s, ms or us) on a labelled
  axis, a legend of only what is drawn.
- `chrome_trace`: the trace event format (a JSON object with `traceEvents`; complete events,
  `ph` "X", `ts` and `dur` in microseconds; one process per mesh, one thread for compute and
  one for sends) that Perfetto (ui.perfetto.dev) and chrome://tracing open, as `ray timeline`
  and JAX's profiler also write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hlopar.analysis.schedules.instructions import RUN, SEND
from hlopar.analysis.schedules.simulator import COMPUTE, SEND_STREAM, SimResult

__all__ = ["Span", "Timeline", "chrome_trace", "draw_timeline", "write_chrome_trace"]

# kind -> (legend text, colour); compute kinds first, then what a SEND carries
KINDS = {
    "F": ("forward", "#4285f4"),
    "B": ("backward", "#34a853"),
    "W": ("weight gradients", "#fb8c00"),
    "other": ("accumulate / update", "#a0a0a0"),
    "act": ("send activations", "#8e44ad"),
    "grad": ("send gradients", "#c2185b"),
}
SEND_LANE = "send"


@dataclass(frozen=True)
class Span:
    """One interval of a mesh's timeline: on its compute lane or its send lane."""

    mesh: str
    lane: str  # COMPUTE or SEND_LANE
    kind: str  # a key of KINDS
    start: float  # seconds from the step's start
    end: float
    microbatch: int | None = None
    peer: str = ""  # the receiving mesh of a send


@dataclass(frozen=True)
class Timeline:
    title: str
    meshes: tuple[str, ...]
    spans: tuple[Span, ...]

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @classmethod
    def of(cls, result: SimResult) -> Timeline:
        """The simulated step: RUNs by their kind, accumulate and update as other compute,
        SENDs on the send lane."""
        spans = []
        for e in result.events:
            if e.stream == COMPUTE:
                kind = e.kind if e.op == RUN and e.kind in KINDS else "other"
                spans.append(Span(e.mesh, COMPUTE, kind, e.start, e.end, e.microbatch))
            elif e.stream == SEND_STREAM and e.op == SEND:
                spans.append(
                    Span(e.mesh, SEND_LANE, e.kind if e.kind in KINDS else "act", e.start, e.end, e.microbatch, e.peer)
                )
        title = (
            f"{result.schedule}: step {_with_unit(result.iteration_time)} (simulated), "
            f"bubble {100 * result.bubble_fraction:.1f}%"
        )
        return cls(title, tuple(result.meshes), tuple(spans))


def _unit(seconds: float) -> tuple[str, float]:
    """The unit whose numbers for a span this long are round: s, ms or us."""
    for name, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return name, scale
    return "us", 1e-6


def _with_unit(seconds: float) -> str:
    name, scale = _unit(seconds)
    return f"{seconds / scale:.3g} {name}"


def draw_timeline(timeline: Timeline, path: str | Path, width_inches: float = 12.0) -> Path:
    """Writes the timeline as a PNG (matplotlib, Agg) and returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg on this figure only, not pyplot's global
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    unit, scale = _unit(timeline.end or 1.0)
    rows = len(timeline.meshes)
    figure = Figure(figsize=(width_inches, 1.4 + 0.75 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    row_of = {mesh: k for k, mesh in enumerate(timeline.meshes)}
    drawn: set[str] = set()
    pixels_per_unit = 0.8 * width_inches * figure.dpi / ((timeline.end or scale) / scale)  # the plot is ~80% wide
    for span in timeline.spans:
        y = row_of[span.mesh]
        low, height = (y - 0.35, 0.5) if span.lane == COMPUTE else (y + 0.2, 0.15)
        left, width = span.start / scale, (span.end - span.start) / scale
        axes.broken_barh(
            [(left, width)], (low, height), facecolors=KINDS[span.kind][1], edgecolors="white", linewidth=0.5
        )
        drawn.add(span.kind)
        label_fits = width * pixels_per_unit >= 7 * len(str(span.microbatch)) + 4
        if span.lane == COMPUTE and span.microbatch is not None and label_fits:
            axes.text(
                left + width / 2,
                low + height / 2,
                str(span.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    axes.set_yticks(range(rows), [f"mesh {m}" for m in timeline.meshes])
    axes.set_ylim(rows - 0.5, -0.5)
    axes.set_xlim(0, (timeline.end or scale) / scale)
    axes.set_xlabel(f"time ({unit})")
    axes.set_title(timeline.title, loc="left", fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(
        handles=[Patch(color=color, label=label) for kind, (label, color) in KINDS.items() if kind in drawn],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    path = Path(path)
    figure.savefig(path)
    return path


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline in the trace event format (module docstring): times in microseconds."""
    events: list[dict] = []
    lanes = (COMPUTE, SEND_LANE)
    for pid, mesh in enumerate(timeline.meshes):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"mesh {mesh}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, lane in enumerate(lanes):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
    pid_of = {mesh: k for k, mesh in enumerate(timeline.meshes)}
    for span in timeline.spans:
        name = KINDS[span.kind][0] if span.lane == COMPUTE else f"{KINDS[span.kind][0]} to {span.peer}"
        args = {"microbatch": span.microbatch} if span.microbatch is not None else {}
        events.append(
            {
                "name": name if span.microbatch is None else f"{name} {span.microbatch}",
                "cat": span.kind,
                "ph": "X",
                "pid": pid_of[span.mesh],
                "tid": lanes.index(span.lane),
                "ts": span.start * 1e6,
                "dur": (span.end - span.start) * 1e6,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": timeline.title}}


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timeline)) + "\n")
    return path
