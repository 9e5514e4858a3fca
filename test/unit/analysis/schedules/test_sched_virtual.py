"""Several stages per mesh: placement, interleaved 1F1B and ZB-V orders, their bubbles and memory."""

from __future__ import annotations

from collections import Counter

import pytest

from hlopar.analysis.schedules import (
    FREE,
    RECV,
    RUN,
    SCHEDULES,
    SEND,
    ZERO_COST,
    AlphaBeta,
    PipelineStreams,
    PipelineTopology,
    StageCost,
    build_streams,
    get_schedule,
    simulate,
    stage_placement,
)

INTERLEAVED, ZBV = SCHEDULES["interleaved-1f1b"], SCHEDULES["zb-v"]


def _placed(schedule, p: int, v: int, nbytes: int = 1000, stash: int = 100) -> PipelineTopology:
    meshes = [f"m{j + 1}" for j in schedule.placed(p, v)]
    return PipelineTopology.chain(p * v, nbytes, stash, meshes=meshes)


def test_placements():
    assert stage_placement("loop", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert stage_placement("v", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert stage_placement("loop", 2, 1) == (0, 1)
    with pytest.raises(ValueError, match="2 chunks per mesh"):
        stage_placement("v", 3, 3)
    with pytest.raises(ValueError, match="unknown placement"):
        stage_placement("zigzag", 3, 2)


def test_topology_with_chunks():
    topo = _placed(ZBV, 3, 2)
    assert topo.mesh_names == ("m1", "m2", "m3") and topo.chunks == 2
    assert topo.stages_on("m1") == (0, 5) and topo.stages_on("m3") == (2, 3)
    with pytest.raises(ValueError, match="holds stages"):
        topo.stage_of("m1")
    assert PipelineTopology.chain(3, 1).chunks == 1
    with pytest.raises(ValueError, match="as many stages"):
        PipelineTopology.chain(3, 1, meshes=["a", "b", "a"])


def test_interleaved_order_is_megatrons():
    """p = 2, v = 2, B = 4: mesh 0 warms up with 2 (p - 1) + (v - 1) p + 1 = 5 chunk forwards,
    in groups of p microbatches per chunk; backwards from the last chunk down."""
    assert " ".join(map(str, INTERLEAVED.mesh_tasks(2, 2, 0, 4))) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    )
    assert " ".join(map(str, INTERLEAVED.mesh_tasks(2, 2, 1, 4))) == (
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    )
    for p, m in [(1, 3), (3, 4), (4, 9)]:  # one chunk: eager-1f1b's order
        assert INTERLEAVED.tasks(p, m) == SCHEDULES["eager-1f1b"].tasks(p, m)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        INTERLEAVED.mesh_tasks(3, 2, 0, 4)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("forward,backward", [(1.0, 2.0), (1.0, 1.0)])
def test_interleaved_bubble_is_the_formula(p, v, groups, forward, backward):
    """Narayanan et al.: idle time over compute (p - 1) / (v B) on uniform stages, exactly:
    each chunk costs 1/v of a stage."""
    m = groups * p
    costs = [StageCost(forward / v, backward / v)] * (p * v)
    result = simulate(build_streams(_placed(INTERLEAVED, p, v), INTERLEAVED, m), costs, ZERO_COST)
    busy = m * (forward + backward)
    assert all(b == pytest.approx(busy, rel=1e-12) for b in result.compute_busy.values())
    assert (result.iteration_time - busy) / busy == pytest.approx((p - 1) / (v * m), rel=1e-12)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zero_bubble_v_has_no_gap(p):
    """F, B and W of one unit each (a chunk's backward 2 units, W half of it): from B = 2p on,
    each mesh works without a gap from its first task to its last (6 units a microbatch),
    so back to back without a barrier the bubble is 0; with the barrier only the staggered
    starts remain, p - 1 units."""
    for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 1}):
        streams = build_streams(_placed(ZBV, p, 2), ZBV, m)
        result = simulate(streams, [StageCost(1.0, 2.0)] * (2 * p), ZERO_COST)
        assert result.steady_period == 6 * m
        assert result.steady_bubble_fraction == 0
        assert result.iteration_time == 6 * m + p - 1
        assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_rules_with_chunks(p):
    """Eq. 5 with chunks, per mesh and in chunk stashes (1/v of a stage's each): interleaved
    mesh j holds its warm-up, 2 (p - j - 1) + (v - 1) p + 1, so mesh 0 holds p + (p - 1)/v
    stages' worth against 1F1B's p; ZB-V's forwards in flight stay within 2p chunks, 1F1B's p
    stages, its stashes kept to W within 4p."""
    for v in (2, 3):
        m = 4 * p
        for j in range(p):
            assert INTERLEAVED.mesh_in_flight(p, v, j, m) == 2 * (p - j - 1) + (v - 1) * p + 1
        per_stage = INTERLEAVED.chunk_in_flight(p, v, m)
        assert len(per_stage) == p * v
        for j in range(p):  # per chunk, the DP's bound: their sum holds the mesh's peak
            assert sum(per_stage[j::p]) >= INTERLEAVED.mesh_in_flight(p, v, j, m)
    for m in (2 * p, 4 * p + 1):
        assert max(ZBV.mesh_in_flight(p, 2, j, m) for j in range(p)) == 2 * p
        assert all(ZBV.mesh_stashes(p, 2, j, m) <= 4 * p for j in range(p))
        assert sum(ZBV.chunk_stashes(p, 2, m)[k] for k in (0, 2 * p - 1)) >= ZBV.mesh_stashes(p, 2, 0, m)


@pytest.mark.parametrize(
    "name,p,v,m", [("interleaved-1f1b", 3, 2, 6), ("interleaved-1f1b", 1, 3, 2), ("zb-v", 3, 2, 5)]
)
def test_streams_with_chunks(name, p, v, m):
    """Every task of every stage once, tagged with its stage; no SEND/RECV between two stages
    of one mesh (their RUNs wait for each other); every buffer allocated and freed once."""
    schedule = get_schedule(name)
    topo = _placed(schedule, p, v)
    streams = build_streams(topo, schedule, m)
    kinds = "FBW" if schedule.split_backward else "FB"
    by_id = streams.by_id()
    for stream in streams.streams:
        assert stream.stages == topo.stages_on(stream.mesh)
        runs = Counter((i.stage, i.kind, i.microbatch) for i in stream if i.op == RUN)
        assert runs == Counter({(k, kind, b): 1 for k in stream.stages for kind in kinds for b in range(m)})
        allocated = Counter(name for i in stream for name, _ in i.allocates)
        freed = Counter(i.buffer for i in stream if i.op == FREE)
        assert allocated == freed and set(allocated.values()) == {1}
        for inst in stream:
            if inst.op in (SEND, RECV):
                assert inst.peer != stream.mesh
            if inst.op == RUN and inst.kind == "F" and inst.stage > 0 and topo.meshes[inst.stage - 1] == stream.mesh:
                assert any(by_id[d].op == RUN and by_id[d].stage == inst.stage - 1 for d in inst.deps)
    again = PipelineStreams.from_json(streams.to_json())
    assert again == streams and str(again) == str(streams)
    result = simulate(streams, [StageCost(1.0, 2.0, update=0.5)] * (p * v), AlphaBeta(1e-3, 1e6))
    assert result.iteration_time > 0


def test_refusals():
    with pytest.raises(ValueError, match="runs one stage per mesh, not 2"):
        build_streams(_placed(INTERLEAVED, 2, 2), "1f1b", 4)
    with pytest.raises(ValueError, match="runs 2 stages per mesh, not 1"):
        build_streams(PipelineTopology.chain(2, 1), ZBV, 4)
    with pytest.raises(ValueError, match="zb-v places stage 2 on mesh m2"):
        build_streams(_placed(INTERLEAVED, 2, 2), ZBV, 4)
