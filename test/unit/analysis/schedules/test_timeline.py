"""The step timeline: taken from the simulator, drawn with matplotlib, written as a Chrome trace."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pytest

from hlopar.analysis.schedules import (
    SCHEDULES,
    AlphaBeta,
    Edge,
    PipelineTopology,
    StageCost,
    Timeline,
    build_streams,
    chrome_trace,
    draw_timeline,
    simulate,
    write_chrome_trace,
)
from hlopar.analysis.schedules.simulator import COMPUTE
from hlopar.analysis.schedules.timeline import KINDS, SEND_LANE, Span, _unit


def _result(schedule="eager-1f1b-wd", stages=3, microbatches=4):
    topo = PipelineTopology.chain(stages, 10**8, skips=[Edge(0, 2, 10**8)] if stages > 2 else [])
    return simulate(
        build_streams(topo, SCHEDULES[schedule], microbatches),
        [StageCost(forward=1.0, backward=2.0) for _ in range(stages)],
        AlphaBeta(0.0, 10**9),
    )


def test_timeline_of_simulation_keeps_every_compute_and_send_event():
    result = _result()
    timeline = Timeline.of(result)
    assert timeline.meshes == result.meshes
    compute = [e for e in result.events if e.stream == COMPUTE]
    sends = [e for e in result.events if e.op == "SEND"]
    assert len(timeline.spans) == len(compute) + len(sends)
    assert sorted((s.mesh, s.start, s.end) for s in timeline.spans if s.lane == COMPUTE) == sorted(
        (e.mesh, e.start, e.end) for e in compute
    )
    assert {s.kind for s in timeline.spans if s.lane == COMPUTE} == {"F", "B", "W", "other"}
    assert {s.kind for s in timeline.spans if s.lane == SEND_LANE} == {"act", "grad"}
    assert timeline.end == pytest.approx(result.iteration_time, rel=1e-12)
    assert timeline.title.startswith("eager-1f1b-wd: step ") and "bubble" in timeline.title


@pytest.mark.parametrize("seconds, unit", [(2.5, "s"), (1.0, "s"), (0.0015, "ms"), (4e-5, "us")])
def test_time_unit_keeps_tick_numbers_round(seconds, unit):
    assert _unit(seconds)[0] == unit


def test_chrome_trace_format():
    timeline = Timeline.of(_result())
    trace = json.loads(json.dumps(chrome_trace(timeline)))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(timeline.spans)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(k, f"mesh {m}") for k, m in enumerate(timeline.meshes)}
    by_start = sorted(timeline.spans, key=lambda s: (s.start, s.mesh, s.lane))
    got = sorted(complete, key=lambda e: (e["ts"], timeline.meshes[e["pid"]], e["tid"]))
    for span, event in zip(by_start, got):
        assert event["ts"] == pytest.approx(span.start * 1e6, rel=1e-12)  # microseconds
        assert event["dur"] == pytest.approx((span.end - span.start) * 1e6, rel=1e-12, abs=1e-9)
        assert event["pid"] == timeline.meshes.index(span.mesh) and event["tid"] == (0 if span.lane == COMPUTE else 1)
        assert event["cat"] == span.kind and event["args"].get("microbatch") == span.microbatch


def test_drawn_png_shows_only_what_is_drawn(tmp_path):
    # Two meshes, forward and backward only, no sends: the legend may not name W or sends.
    timeline = Timeline(
        "two spans", ("a", "b"), (Span("a", COMPUTE, "F", 0.0, 1e-3, 0), Span("b", COMPUTE, "B", 1e-3, 3e-3, 0))
    )
    path = draw_timeline(timeline, tmp_path / "t.png", width_inches=6)
    image = matplotlib.image.imread(path)
    assert image.shape[1] == 600 and image.shape[0] == int((1.4 + 0.75 * 2) * 100)
    rgb = (image[..., :3] * 255).round().astype(int)

    def has(color: str) -> bool:
        target = [int(color[k : k + 2], 16) for k in (1, 3, 5)]
        return bool((np.abs(rgb - target).sum(axis=2) == 0).any())

    assert has(KINDS["F"][1]) and has(KINDS["B"][1])
    assert not has(KINDS["W"][1]) and not has(KINDS["act"][1]) and not has(KINDS["grad"][1])


def test_write_chrome_trace(tmp_path):
    timeline = Timeline.of(_result("1f1b", stages=2, microbatches=2))
    path = write_chrome_trace(timeline, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(chrome_trace(timeline)))
