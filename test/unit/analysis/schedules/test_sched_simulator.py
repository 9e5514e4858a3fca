"""The stream simulator: completion, dependency order, the eager-1F1B claims, memory, deadlocks."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlopar.analysis.schedules import (
    ONE_STAGE_SCHEDULES,
    SCHEDULES,
    ZERO_COST,
    AlphaBeta,
    DeadlockError,
    Edge,
    HostComm,
    HostThread,
    MeshStream,
    PipelineStreams,
    PipelineTopology,
    StageCost,
    build_streams,
    get_schedule,
    iteration_lower_bound,
    signal,
    simulate,
)


@st.composite
def pipelines(draw, max_stages=5, max_micro=10):
    stages = draw(st.integers(1, max_stages))
    micro = draw(st.integers(1, max_micro))
    skips = [
        Edge(i, j, draw(st.integers(1, 4)) * 10**6)
        for i in range(stages)
        for j in range(i + 2, stages)
        if draw(st.booleans())
    ]
    topo = PipelineTopology.chain(stages, draw(st.integers(0, 4)) * 10**6, 10**6, skips=skips)
    return topo, micro


def _uniform(stages, forward=1.0, backward=2.0):
    return [StageCost(forward, backward)] * stages


@settings(max_examples=30, deadline=None)
@given(pipelines(), st.sampled_from(ONE_STAGE_SCHEDULES), st.lists(st.floats(0.1, 3.0), min_size=10, max_size=10))
def test_streams_complete_and_respect_dependencies(pipeline, name, times):
    topo, micro = pipeline
    costs = [StageCost(times[k], times[k + 5], accumulate=0.01, update=0.1) for k in range(topo.num_stages)]
    streams = build_streams(topo, name, micro)
    result = simulate(streams, costs, AlphaBeta(1e-3, 1e9))
    events = {e.id: e for e in result.events}
    assert set(events) == set(streams.by_id())
    for inst in streams.instructions():
        for dep in inst.deps:
            assert events[inst.id].start >= events[dep].end - 1e-12
        if inst.op == "RECV":  # arrival marker: no time of its own
            assert events[inst.id].end == events[inst.id].start
    per_stream = defaultdict(list)
    for e in result.events:
        if e.stream:
            per_stream[(e.mesh, e.stream)].append(e)
    for evs in per_stream.values():  # in stream order, never overlapping
        assert all(a.end <= b.start + 1e-12 for a, b in zip(evs, evs[1:]))
    assert result.iteration_time == pytest.approx(max(e.end for e in result.events))
    assert 0 <= result.bubble_fraction < 1


@settings(max_examples=25, deadline=None)
@given(pipelines(max_stages=6, max_micro=12), st.floats(0.2, 3.0), st.floats(0.2, 3.0))
def test_zero_communication_1f1b_equals_eager(pipeline, forward, backward):
    """§4: without communication cost the two schedules take the same time (balanced stages)."""
    topo, micro = pipeline
    costs = _uniform(topo.num_stages, forward, backward)
    one = simulate(build_streams(topo, "1f1b", micro), costs, ZERO_COST).iteration_time
    eager = simulate(build_streams(topo, "eager-1f1b", micro), costs, ZERO_COST).iteration_time
    assert eager == pytest.approx(one)
    assert one == pytest.approx((micro + topo.num_stages - 1) * (forward + backward))


@st.composite
def u_shaped(draw):
    """A chain, with or without U-Net skips i -> S-1-i, and balanced stages."""
    stages, micro = draw(st.integers(1, 7)), draw(st.integers(1, 14))
    skips = (
        [Edge(i, stages - 1 - i, draw(st.integers(1, 8)) * 10**6) for i in range(stages // 2) if stages - 1 - i > i + 1]
        if draw(st.booleans())
        else []
    )
    chain = [draw(st.integers(0, 5)) * 10**6 for _ in range(stages - 1)]
    return PipelineTopology.chain(stages, chain, skips=skips), micro


@settings(max_examples=25, deadline=None)
@given(u_shaped(), st.floats(1e7, 1e10), st.integers(0, 3))
def test_with_communication_eager_is_no_slower(pipeline, bandwidth, hosts):
    """On chains and U-shaped pipelines whose transfers each take less than a stage's compute
    (the regime eager-1F1B is for: communication that can be hidden). When one transfer takes
    longer than a stage's work (e.g. 3 s against 1 s), eager's extra in-flight sends can queue
    ahead of critical ones and lose; hypothesis found such cases."""
    topo, micro = pipeline
    if hosts:
        host_of = {m: k * hosts // topo.num_stages for k, m in enumerate(topo.meshes)}
        comm = HostComm(host_of, AlphaBeta(1e-2, bandwidth), AlphaBeta(1e-3, 1e9))
    else:
        comm = AlphaBeta(1e-3, bandwidth)
    costs = _uniform(topo.num_stages)
    one = simulate(build_streams(topo, "1f1b", micro), costs, comm).iteration_time
    eager = simulate(build_streams(topo, "eager-1f1b", micro), costs, comm).iteration_time
    assert eager <= one + 1e-9


def test_eager_hides_what_1f1b_exposes():
    """4 stages, transfers of 0.3 s: 1F1B pays them on its critical path, eager-1F1B mostly not."""
    topo = PipelineTopology.chain(4, 3 * 10**8)
    costs, comm = _uniform(4), AlphaBeta(0.0, 10**9)
    times = {name: simulate(build_streams(topo, name, 8), costs, comm).iteration_time for name in ONE_STAGE_SCHEDULES}
    bound = simulate(build_streams(topo, "eager-1f1b", 8), costs, signal(comm)).iteration_time
    assert bound == pytest.approx(33.0, abs=1e-6)
    assert times["1f1b"] == pytest.approx(37.8)
    assert times["eager-1f1b"] == pytest.approx(34.8)
    assert times["eager-1f1b-wd"] < times["eager-1f1b"]


def test_bubble_and_memory_closed_forms():
    """Balanced, free communication: bubble (S-1)/(B+S-1); stage k stashes its warm-up forwards."""
    stages, micro, stash = 4, 8, 1000
    topo = PipelineTopology.chain(stages, 0, stash)
    for name, warm in (
        ("1f1b", lambda k: stages - k),
        ("eager-1f1b", lambda k: 2 * (stages - k) - 1),
        ("gpipe", lambda k: micro),
    ):
        result = simulate(build_streams(topo, name, micro), _uniform(stages), ZERO_COST)
        assert result.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
        assert [result.peak_memory[m] for m in topo.meshes] == [min(micro, warm(k)) * stash for k in range(stages)]
        assert all(b == pytest.approx(micro * 3.0) for b in result.compute_busy.values())


def test_memory_counts_transfer_buffers():
    topo = PipelineTopology.chain(2, 500, 0)
    result = simulate(build_streams(topo, "gpipe", 3), _uniform(2), AlphaBeta(0.0, 1e6))
    # m2 holds the three received activations until their backwards, plus the gradient its first
    # backward sends back (4 x 500); m1 at most two buffers at once, an outgoing activation and a
    # received gradient (2 x 500). Stashes are 0: transfer buffers are all that is counted.
    assert result.peak_memory == {"m1": 2 * 500, "m2": 4 * 500}


def test_links_are_shared():
    """Two meshes of a host sending across hosts queue on the host's NIC; with per-mesh links they
    do not, but two senders to one mesh queue on its inbound side."""
    topo = PipelineTopology(4, (Edge(0, 2, 10**9), Edge(1, 3, 10**9)))
    zero = [StageCost(0.0, 0.0)] * 4

    def act_sends(comm):
        result = simulate(build_streams(topo, "gpipe", 1), zero, comm)
        return sorted((e.start, e.end) for e in result.events if e.op == "SEND" and e.kind == "act")

    hosts = HostComm({"m1": 0, "m2": 0, "m3": 1, "m4": 1}, inter=AlphaBeta(0.0, 10**9))
    assert act_sends(hosts) == [(0.0, 1.0), (1.0, 2.0)]
    assert act_sends(lambda s, d, n: n / 1e9) == [(0.0, 1.0), (0.0, 1.0)]
    fan_in = PipelineTopology(3, (Edge(0, 2, 10**9), Edge(1, 2, 10**9)))
    result = simulate(build_streams(fan_in, "gpipe", 1), zero[:3], AlphaBeta(0.0, 10**9))
    assert sorted(e.end for e in result.events if e.op == "SEND" and e.kind == "act") == [1.0, 2.0]


def test_signal_moves_one_byte():
    comm = signal(AlphaBeta(0.5, 10.0))
    assert comm.time("m1", "m2", 10**9) == pytest.approx(0.6)


def test_deadlock_is_reported():
    streams = build_streams(PipelineTopology.chain(2, 8), "1f1b", 2)
    m1 = list(streams["m1"])
    first_b = next(i for i, inst in enumerate(m1) if inst.op == "RUN" and inst.kind == "B")
    m1.insert(0, m1.pop(first_b))  # B0 before F0 on m1's compute stream
    bad = PipelineStreams(streams.schedule, 2, False, (MeshStream("m1", 0, tuple(m1)), streams["m2"]))
    with pytest.raises(DeadlockError, match="deadlock") as info:
        simulate(bad, _uniform(2))
    assert m1[0].id in info.value.stuck


def test_costs_validated():
    streams = build_streams(PipelineTopology.chain(3, 8), "1f1b", 2)
    with pytest.raises(ValueError, match="no cost for stage 2"):
        simulate(streams, _uniform(2))
    with pytest.raises(ValueError, match="weight_fraction"):
        StageCost(1.0, 2.0, weight_fraction=1.5)


@pytest.mark.parametrize("stages, micro", [(2, 4), (3, 5), (4, 4), (4, 8), (4, 16), (5, 12), (8, 32)])
def test_zb_h1_bubble_is_a_third_of_1f1b(stages, micro):
    """Qi et al. (2024): with F, B and W of equal cost and free communication, ZB-H1 idles
    (p-1)/3m of the compute where 1F1B idles (p-1)/m, both stashing at most 1F1B's first stage."""
    topo = PipelineTopology.chain(stages, 0, 1000)
    costs = [StageCost(1.0, 2.0, weight_fraction=0.5)] * stages  # F = B = W = 1 s
    compute = 3.0 * micro
    idle = {}
    for name in ("1f1b", "zb-h1"):
        result = simulate(build_streams(topo, name, micro), costs, ZERO_COST)
        assert all(b == pytest.approx(compute) for b in result.compute_busy.values())
        assert max(result.peak_memory.values()) == min(stages, micro) * 1000
        idle[name] = (result.iteration_time - compute) / compute
    assert idle["1f1b"] == pytest.approx((stages - 1) / micro)
    assert idle["zb-h1"] == pytest.approx((stages - 1) / (3 * micro))


@pytest.mark.parametrize(
    "stages, micro", [(2, 1), (2, 3), (3, 4), (3, 5), (4, 4), (4, 7), (4, 8), (4, 16), (5, 12), (8, 32)]
)
def test_zb_h2_bubble_is_zero_from_2p_minus_1_microbatches(stages, micro):
    """Qi et al. (2024), ZB-H2: with F, B and W of equal cost and free communication each stage
    works without a gap from its first F to its last W once B >= 2p - 1 (their bubble
    (p-1)(T_F + T_B - 2 T_W) = 0, §2.2), so back-to-back steps without a barrier at the
    optimizer step (`steady_period`) idle nothing; below that, each stage's first B waits
    2p - 1 - B slots. One step alone still takes 3m + p - 1 there, ZB-H1's time."""
    topo = PipelineTopology.chain(stages, 0, 1000)
    costs = [StageCost(1.0, 2.0, weight_fraction=0.5)] * stages  # F = B = W = 1 s
    compute = 3.0 * micro
    result = simulate(build_streams(topo, "zb-h2", micro), costs, ZERO_COST)
    assert all(b == pytest.approx(compute) for b in result.compute_busy.values())
    assert result.steady_period == pytest.approx(compute + max(0, 2 * stages - 1 - micro))
    if micro >= 2 * stages - 1:
        assert result.steady_bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert result.iteration_time == pytest.approx(compute + stages - 1)
    # every stage keeps each stash from F to W: min(2p - 1, B), the paper's (2p - 1) M_B
    assert set(result.peak_memory.values()) == {min(2 * stages - 1, micro) * 1000}
    zb_h1 = simulate(build_streams(topo, "zb-h1", micro), costs, ZERO_COST)
    assert zb_h1.steady_period == pytest.approx(zb_h1.iteration_time)  # its first stage spans the step


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b", "eager-1f1b-wd", "zb-h1"])
def test_steady_period_of_schedules_whose_first_stage_spans_the_step(name):
    """The first stage runs the step's first F and its last B (or W), so back-to-back steps
    gain nothing over `iteration_time` for every schedule but ZB-H2."""
    topo = PipelineTopology.chain(4, 0, 1000)
    result = simulate(build_streams(topo, name, 8), [StageCost(1.0, 2.0, weight_fraction=0.5)] * 4, ZERO_COST)
    assert result.steady_period == pytest.approx(result.iteration_time)
    assert result.steady_bubble_fraction == pytest.approx(result.bubble_fraction)


@settings(max_examples=60, deadline=None)
@given(
    pipelines(),
    st.sampled_from(sorted(SCHEDULES)),
    st.integers(1, 3),
    st.lists(st.floats(0.0, 3.0), min_size=20, max_size=20),
    st.sampled_from([ZERO_COST, AlphaBeta(1e-3, 1e6), AlphaBeta(0.5, 1e5)]),
)
def test_lower_bound_never_above_the_simulated_step(pipeline, name, chunks, times, comm):
    """The planner skips plans by `iteration_lower_bound` (pipeline_choice): a bound above a
    simulated time would skip a plan that wins. Every schedule, with chunks on repeated meshes,
    with and without transfer costs; tight (equal) where one stage runs alone."""
    topo, micro = pipeline
    schedule = get_schedule(name)
    if schedule.mesh_order is not None:  # 2 meshes, v chunks each, a count of whole rounds
        placed = schedule.placed(2, schedule.chunks or chunks + 1)
        meshes = tuple(f"m{j + 1}" for j in placed)
        topo = PipelineTopology.chain(len(placed), 10**6, 10**6, skips=[Edge(0, len(placed) - 1, 10**5)], meshes=meshes)
        micro *= 2
    costs = [
        StageCost(times[k % 10], times[10 + k % 10], accumulate=times[k % 7] / 10, update=times[k % 5] / 5)
        for k in range(topo.num_stages)
    ]
    result = simulate(build_streams(topo, name, micro), costs, comm)
    bound = iteration_lower_bound(topo, costs, comm, micro, schedule.split_backward)
    assert bound <= result.iteration_time * (1 + 1e-12)
    if topo.num_stages == 1:
        assert bound == pytest.approx(result.iteration_time, rel=1e-12)


def test_one_host_thread_makes_the_step_at_least_its_launches_and_copies():
    """2 stages of F 1 s, B 2 s, 4 microbatches, transfers of 0.5 s: the event loop's step is
    17 s. One host thread that launches each run and each mesh's update in 1 s (16 + 2) and
    makes the 8 transfers itself (4 activations, 4 gradients: 4 s) works 22 s: the step.
    Where the devices compute on its cores (half of the devices each), their 2 x 4 x 3 s of
    compute take the machine 12 s more: 34 s."""
    topo = PipelineTopology.chain(2, 10**6)
    costs, comm = _uniform(2), AlphaBeta(0.5, math.inf)
    streams = build_streams(topo, "1f1b", 4)
    alone = simulate(streams, costs, comm)
    assert alone.iteration_time == pytest.approx(17.0)
    launches = {0: (1.0, 1.0, 1.0), 1: (1.0, 1.0, 1.0)}
    assert simulate(streams, costs, comm, HostThread(launches)).iteration_time == pytest.approx(22.0)
    shared = simulate(streams, costs, comm, HostThread(launches, share={"m1": 0.5, "m2": 0.5}))
    assert shared.iteration_time == pytest.approx(34.0)
    # Where 0.5 s of each F and of each B are their launches (the host's work, priced above),
    # the devices' work is 2 x 4 x (3 - 1) s at half the machine: 8 s, 30 s in all.
    counted = {0: (0.5, 0.5), 1: (0.5, 0.5)}
    launched = HostThread(launches, share={"m1": 0.5, "m2": 0.5}, counted=counted)
    assert simulate(streams, costs, comm, launched).iteration_time == pytest.approx(30.0)
    # Launches no one pays: the event loop's step, to the bit.
    idle = HostThread({0: (0.0, 0.0, 0.0), 1: (0.0, 0.0, 0.0)})
    assert simulate(streams, costs, comm, idle).iteration_time == alone.iteration_time


def test_a_host_thread_charges_forward_and_backward_launches_apart():
    """One stage, 3 microbatches, F 1 s, B 2 s, an update of 1 s: 10 s on the devices. Launches
    of 2 s for a forward, 5 s for a backward and 4 s for the update: 3 x 2 + 3 x 5 + 4 = 25 s."""
    topo = PipelineTopology.chain(1, 0)
    streams = build_streams(topo, "1f1b", 3)
    costs = [StageCost(1.0, 2.0, update=1.0)]
    assert simulate(streams, costs, ZERO_COST).iteration_time == pytest.approx(10.0)
    result = simulate(streams, costs, ZERO_COST, HostThread({0: (2.0, 5.0, 4.0)}))
    assert result.iteration_time == pytest.approx(25.0)
