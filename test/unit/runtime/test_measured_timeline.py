"""The timeline the Ray workers measure for a step (`StepStats.timeline`): every RUN, SEND and
update of every worker's stream, in order, within the step, drawable and writable as a trace."""

from __future__ import annotations

import json

import jax

import hlopar
from hlopar.analysis.schedules import RUN, SEND, draw_timeline, write_chrome_trace
from hlopar.analysis.schedules.simulator import COMPUTE
from hlopar.analysis.schedules.timeline import SEND_LANE
from hlopar.models import get_train_step


def test_measured_timeline(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path / "cache"))
    model = get_train_step("mlp", "tiny")
    params = model.init(jax.random.PRNGKey(0))
    state = model.init_opt_state(params)
    batch = model.make_batch(jax.random.PRNGKey(1))
    step = hlopar.parallelize(
        model.step,
        cluster=hlopar.Cluster.local(2, 2, device_kind="cpu"),
        method="pipeline",
        runtime="ray",  # the workers' measured timelines
        num_microbatches=2,
        schedule="1f1b",
        batch_argnums=(2,),
        verbose=False,
    )
    try:
        step(params, state, batch)
        stats = step.last_stats
        runtime = step.runtime
        timeline = stats.timeline()
        assert set(timeline.meshes) == set(stats.workers) and len(timeline.meshes) >= 2
        for worker in timeline.meshes:
            stream = runtime.programs[runtime.layout.slots[worker].mesh].stream.instructions
            mine = [s for s in timeline.spans if s.mesh == worker]
            runs = [s for s in mine if s.lane == COMPUTE and s.kind != "other"]
            sends = [s for s in mine if s.lane == SEND_LANE]
            # one span per RUN and per SEND, in stream order, with its kind and microbatch
            assert [(s.kind, s.microbatch) for s in runs] == [(i.kind, i.microbatch) for i in stream if i.op == RUN]
            assert [(s.kind, s.microbatch, s.peer) for s in sends] == [
                (i.kind, i.microbatch, i.peer) for i in stream if i.op == SEND
            ]
            updates = [s for s in mine if s.kind == "other"]
            assert len(updates) == sum(
                1
                for f in runtime.program.fragments
                if f.role == "update" and f.mesh == runtime.layout.slots[worker].mesh
            )
            ordered = sorted(mine, key=lambda s: s.start)
            assert ordered == [s for s in mine]  # the stream runs one instruction after the other
            for a, b in zip(ordered, ordered[1:]):
                assert a.end <= b.start
            # within the step as the driver saw it (one clock: the workers run on this machine)
            assert ordered[0].start >= 0.0 and ordered[-1].end <= stats.wall_s
        trace = json.loads(write_chrome_trace(timeline, tmp_path / "trace.json").read_text())
        assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(timeline.spans)
        assert draw_timeline(timeline, tmp_path / "t.png").stat().st_size > 0
    finally:
        step.shutdown()
