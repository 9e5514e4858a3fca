"""Per-mesh instruction streams: text, JSON, deps, sends right after their RUN, FREEs from liveness."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopar.analysis.schedules import (
    ACCUMULATE,
    FREE,
    ONE_STAGE_SCHEDULES,
    RECV,
    RUN,
    SEND,
    UPDATE,
    Edge,
    Instruction,
    PipelineStreams,
    PipelineTopology,
    build_streams,
)


@st.composite
def topologies(draw, max_stages=5):
    stages = draw(st.integers(1, max_stages))
    skips = [
        Edge(i, j, draw(st.integers(0, 3)) * 1000)
        for i in range(stages)
        for j in range(i + 2, stages)
        if draw(st.booleans())
    ]
    chain = [draw(st.integers(0, 5)) * 1000 for _ in range(stages - 1)]
    stash = [draw(st.integers(0, 9)) * 100 for _ in range(stages)]
    topo = PipelineTopology.chain(stages, chain, stash, skips=skips)
    return replace(topo, carry_bytes=tuple(draw(st.integers(0, 9)) * 10 for _ in range(stages)))


def test_text_of_a_small_pipeline():
    topo = PipelineTopology.chain(2, 4_000_000, activation_bytes=10_000_000)
    text = str(build_streams(topo, "1f1b", 1))
    assert (
        text
        == """\
# schedule 1f1b, 2 meshes, 1 microbatch
mesh m1 (stage 0)
  m1:0  RUN F mb=0
  m1:1  SEND act mb=0 -> m2 (3.8 MiB)  after m1:0
  m1:2  FREE act.0->m2 (3.8 MiB)  after m1:1
  m1:3  RECV grad mb=0 <- m2 (3.8 MiB)  after m2:3
  m1:4  RUN B mb=0  after m1:0, m1:3
  m1:5  ACCUMULATE mb=0  after m1:4
  m1:6  FREE stash.0 (9.5 MiB)  after m1:4
  m1:7  FREE grad.0<-m2 (3.8 MiB)  after m1:4
  m1:8  UPDATE  after m1:5
mesh m2 (stage 1)
  m2:0  RECV act mb=0 <- m1 (3.8 MiB)  after m1:1
  m2:1  RUN F mb=0  after m2:0
  m2:2  RUN B mb=0  after m2:1
  m2:3  SEND grad mb=0 -> m1 (3.8 MiB)  after m2:2
  m2:4  FREE grad.0->m1 (3.8 MiB)  after m2:3
  m2:5  ACCUMULATE mb=0  after m2:2
  m2:6  FREE stash.0 (9.5 MiB)  after m2:2
  m2:7  FREE act.0<-m1 (3.8 MiB)  after m2:2
  m2:8  UPDATE  after m2:5
"""
    )


def test_skip_edges_and_weight_split():
    """A U-shaped pipeline: m1 also sends to m4 and gets m4's gradient back; W frees the stash."""
    topo = PipelineTopology.chain(4, 100, 50, skips=[Edge(0, 3, 700), Edge(1, 2, 300)])
    assert [(e.src, e.dst, e.nbytes) for e in topo.edges] == [(0, 1, 100), (1, 2, 400), (2, 3, 100), (0, 3, 700)]
    streams = build_streams(topo, "eager-1f1b-wd", 2)
    m1 = [i.describe() for i in streams["m1"]]
    assert m1[:5] == [
        "RUN F mb=0",
        "SEND act mb=0 -> m2 (100 B)",
        "FREE act.0->m2 (100 B)",
        "SEND act mb=0 -> m4 (700 B)",
        "FREE act.0->m4 (700 B)",
    ]
    assert "RECV grad mb=0 <- m4 (700 B)" in m1
    by_id = streams.by_id()
    stash_free = next(i for i in streams["m2"] if i.op == FREE and i.buffer == "stash.0")
    assert [by_id[d].describe() for d in stash_free.deps] == ["RUN W mb=0"]
    acc = next(i for i in streams["m2"] if i.op == ACCUMULATE)
    assert [by_id[d].describe() for d in acc.deps] == ["RUN W mb=0"]


@settings(max_examples=40, deadline=None)
@given(topologies(), st.integers(1, 6), st.sampled_from(ONE_STAGE_SCHEDULES))
def test_json_round_trip(topo, micro, name):
    streams = build_streams(topo, name, micro)
    again = PipelineStreams.from_json(streams.to_json())
    assert again == streams
    assert str(again) == str(streams)


@settings(max_examples=40, deadline=None)
@given(topologies(), st.integers(1, 6), st.sampled_from(ONE_STAGE_SCHEDULES))
def test_stream_structure(topo, micro, name):
    _check_stream_structure(topo, micro, name)


@pytest.mark.parametrize("micro", [1, 3, 7, 8])
def test_zb_h2_streams(micro):
    """ZB-H2's streams on a 4-stage chain with skip edges (hypothesis samples it among the others)."""
    topo = PipelineTopology.chain(4, [3000, 2000, 1000], [500, 400, 300, 200], skips=[Edge(0, 2, 700), Edge(1, 3, 0)])
    _check_stream_structure(replace(topo, carry_bytes=(40, 30, 20, 10)), micro, "zb-h2")


def _check_stream_structure(topo: PipelineTopology, micro: int, name: str) -> None:
    """Every F, B (and W) of each microbatch once per stage, F before B before W; sends and
    receives matched one to one; every buffer allocated and freed once."""
    streams = build_streams(topo, name, micro)
    by_id = streams.by_id()
    split = streams.split_backward
    for stream in streams.streams:
        insts = list(stream)
        k = stream.stage
        runs = Counter((i.kind, i.microbatch) for i in insts if i.op == RUN)
        assert runs == Counter({(kind, m): 1 for kind in ("FBW" if split else "FB") for m in range(micro)})
        position = {i.id: p for p, i in enumerate(insts)}
        run = {(i.kind, i.microbatch): i for i in insts if i.op == RUN}
        for m in range(micro):
            assert run["F", m].id in run["B", m].deps and position[run["F", m].id] < position[run["B", m].id]
            if split:  # W(m) after its B(m), which allocates what it hands to W(m)
                assert run["B", m].id in run["W", m].deps and position[run["B", m].id] < position[run["W", m].id]
                assert (f"carry.{m}", topo.carry_bytes[k]) in run["B", m].allocates
        assert Counter(i.microbatch for i in insts if i.op == ACCUMULATE) == Counter(range(micro))
        assert [i.op for i in insts].count(UPDATE) == 1 and insts[-1].op == UPDATE
        assert {by_id[d].op for d in insts[-1].deps} == {ACCUMULATE}
        # Sends follow their RUN with nothing but sends and frees in between.
        for pos, inst in enumerate(insts):
            if inst.op == SEND:
                (run,) = inst.deps
                between = insts[[i.id for i in insts].index(run) + 1 : pos]
                assert by_id[run].op == RUN and all(i.op in (SEND, FREE) for i in between)
            if inst.op == RECV:
                (send,) = inst.deps
                peer = by_id[send]
                assert (peer.op, peer.mesh, peer.peer, peer.kind, peer.microbatch, peer.nbytes) == (
                    SEND,
                    inst.peer,
                    stream.mesh,
                    inst.kind,
                    inst.microbatch,
                    inst.nbytes,
                )
        # Every buffer is allocated once and freed once, after every instruction that reads it.
        allocated = Counter(name for i in insts for name, _ in i.allocates)
        freed = Counter(i.buffer for i in insts if i.op == FREE)
        assert allocated == freed and set(allocated.values()) == {1}
        expected_sends = len(topo.outputs(k)) + len(topo.inputs(k))
        assert sum(i.op == SEND for i in insts) == micro * expected_sends
        assert sum(i.op == RECV for i in insts) == micro * expected_sends
        for inst in insts:
            if inst.op == FREE and inst.buffer.startswith(("stash.", "carry.")):
                (last,) = inst.deps
                assert by_id[last].kind == ("W" if split else "B")
    sends = [i.id for i in streams.instructions() if i.op == SEND]
    received = [d for i in streams.instructions() if i.op == RECV for d in i.deps]
    assert sorted(received) == sorted(sends)


def test_errors():
    with pytest.raises(ValueError, match="need 0 <= src < dst"):
        PipelineTopology(3, (Edge(2, 1, 10),))
    with pytest.raises(ValueError, match="given twice"):
        PipelineTopology(3, (Edge(0, 1, 10), Edge(0, 1, 5)))
    with pytest.raises(ValueError, match="one entry per stage"):
        PipelineTopology(3, (), activation_bytes=(1, 2))
    with pytest.raises(ValueError, match="one entry per stage"):
        PipelineTopology(3, (), carry_bytes=(1, 2))
    with pytest.raises(ValueError, match="unknown instruction 'JUMP'"):
        Instruction("m1:0", "JUMP")
    streams = build_streams(PipelineTopology.chain(2, 8), "1f1b", 2)
    broken = streams.to_json().replace('"m2:3"', '"m9:3"', 1)
    with pytest.raises(ValueError, match="unknown instructions|listed on mesh"):
        PipelineStreams.from_json(broken)
