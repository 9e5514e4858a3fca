"""The schedule, the microbatch count and the stages chosen together (`pipeline_choice`), on
uniform layers whose simulated step times have closed forms: 4 layers, 4 devices in submeshes
of one, so every plan is 4 stages of one layer; each layer 4 s of compute a step (F, B and W a
third each), one byte to its neighbours each way, links of no cost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hlopar.analysis.schedules import PLANNED_SCHEDULES, SCHEDULES, get_schedule
from hlopar.analysis.stages.pipeline_choice import (
    MESH_MARGIN,
    HostLaunches,
    PipelineSpace,
    choose_pipeline,
    simulated_step,
)
from hlopar.analysis.stages.span_costs import LayerArrays

L = 4  # layers, stages and devices


def layers(activations=(1.0,) * L, fixed=0.0, per_step=4.0) -> LayerArrays:
    """`activations`: bytes a layer stashes per step; `fixed`: a layer's start-up seconds per
    microbatch (kernel launches), paid whatever the microbatch's size."""
    row = lambda values: np.array([values], dtype=float)  # noqa: E731 (one logical mesh)
    zero = row([0.0] * L)
    return LayerArrays(
        latency=row([per_step] * L),
        fixed_latency=row([fixed] * L),
        state_bytes=zero,
        gradient_bytes=zero,
        activation_bytes=row(activations),
        updated_state_bytes=zero,
        temporary_bytes=zero,
        resharding=np.zeros((1, L, L)),
        forward_latency=row([per_step / 3] * L),
        forward_fixed_latency=row([fixed / 3] * L),
        input_bytes=np.zeros((1, L, L)),
    )


def space(arrays: LayerArrays, memory: float = 1e9, split: int | None = None) -> PipelineSpace:
    received = np.eye(L, k=1) + np.eye(L, k=-1)  # a byte to the next layer, its gradient back
    return PipelineSpace(
        arrays,
        received,
        meshes_of_submesh=[[0]],
        submesh_sizes=[1],
        num_devices=L,
        transfer_seconds=lambda nbytes, devices: 0.0,
        memory_per_device=memory,
        max_stages=L,
        split=split,
    )


ALL = [SCHEDULES[name] for name in PLANNED_SCHEDULES]


def test_a_zero_bubble_schedule_wins_on_time():
    """8 microbatches of 0.5 s (F, B, W 1/6 s each): 1F1B's step is (8 + 3) x 0.5 s; a
    zero-bubble schedule fills its bubble with W, and the choice is the fastest in simulation."""
    choice = choose_pipeline(space(layers()), ALL, [8])
    seconds = {c.schedule: c.seconds for c in choice.candidates}
    assert seconds["1f1b"] == pytest.approx(11 * 0.5, rel=1e-12)
    assert seconds["gpipe"] == pytest.approx(11 * 0.5, rel=1e-12)
    best = choice.best
    # ZB-H2 ties ZB-H1 here (its gain is in steady_period, beyond the barrier): order given.
    assert best.schedule == "zb-h1" and seconds["zb-h2"] == seconds["zb-h1"] and len(best.plan.stages) == L
    # ZB-H1 (Qi et al.): the bubble (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W).
    assert seconds["zb-h1"] == pytest.approx(8 * 0.5 + 3 * (1 / 6), rel=1e-9)
    assert best.seconds == min(seconds.values()) < seconds["1f1b"]
    # The runner-up is the best of the other schedules, with its time.
    runner = choice.runner_up(best)
    assert runner.schedule != best.schedule
    assert runner.seconds == min(s for name, s in seconds.items() if name != best.schedule)
    # What the choice says is what the simulator gives for that plan.
    again = simulated_step(
        space(layers()), get_schedule(best.schedule), 8, best.table, best.plan, space(layers()).received, False
    )
    assert again[0] == best.seconds


def test_1f1b_wins_on_memory():
    """Layer 0 stashes 2 bytes a microbatch, layer 3 10, the others 1; 12 bytes a device. Only
    1F1B fits: 4 stashes on the first stage (8), 1 on the last (10). Eager-1F1B holds 7 on the
    first (14); ZB-H1 passes the DP's Eq. 5 count (1F1B's) but its last stage keeps every
    stash until its W, 4 x 10: the choice checks that count and refuses it."""
    arrays = layers(activations=[2.0 * 8, 1.0 * 8, 1.0 * 8, 10.0 * 8])
    choice = choose_pipeline(space(arrays, memory=12.0), ALL, [8])
    assert choice.best.schedule == "1f1b"
    assert choice.best.seconds == pytest.approx(11 * 0.5, rel=1e-12)
    refused = {c.schedule: c.why for c in choice.candidates if c.plan is None}
    assert set(refused) == set(PLANNED_SCHEDULES) - {"1f1b"}
    assert "stashes (held until W)" in refused["zb-h1"]
    assert choice.runner_up(choice.best) is None
    # With the memory to hold them, ZB-H1's same 4 stages are faster.
    roomy = {c.schedule: c.seconds for c in choose_pipeline(space(arrays), ALL, [8]).candidates}
    assert roomy["zb-h1"] < roomy["1f1b"]


@pytest.mark.parametrize("fixed, count", [(0.0, 16), (0.5, 4)])
def test_the_microbatch_count_trades_the_bubble_for_start_up_costs(fixed, count):
    """1F1B's step on uniform stages is (B + 3) x (fixed + (4 - fixed) / B): with no start-up
    cost the most microbatches win; with 0.5 s a microbatch (B=1: 16 s, 2: 11.25, 4: 9.625,
    8: 10.3125, 16: 13.66) four do."""
    counts = [1, 2, 4, 8, 16]
    expected = {b: (b + L - 1) * (fixed + (4 - fixed) / b) for b in counts}
    for b in counts:
        (alone,) = choose_pipeline(space(layers(fixed=fixed)), [get_schedule("1f1b")], [b]).candidates
        assert alone.seconds == pytest.approx(expected[b], rel=1e-9)
    choice = choose_pipeline(space(layers(fixed=fixed)), [get_schedule("1f1b")], counts)
    assert choice.best.microbatches == count
    assert choice.best.seconds == pytest.approx(expected[count], rel=1e-9)
    # The counts whose lower bound (each microbatch's compute, one after another on a mesh)
    # is above the best's score (its time, 5% more a mesh beyond the first: x 1.05^3) are not
    # simulated; the others are, exactly.
    for c in choice.candidates[1:]:
        if c.plan is None:
            bound = float(c.why.split("at least ")[1].split(" s")[0])
            assert c.why.startswith("not simulated") and choice.best.seconds < bound <= expected[c.microbatches]
        else:
            assert c.seconds == pytest.approx(expected[c.microbatches], rel=1e-9)
    pruned = sorted(c.microbatches for c in choice.candidates if c.plan is None)
    assert pruned == {16: [1, 2], 4: [16]}[count]


def test_a_split_step_prices_other_counts_as_the_whole_step_would():
    """Arrays per microbatch of a step split in 4 price 4 microbatches as they are, and 2 and
    8 scaled to the whole step: the same as the whole step's arrays at every count."""
    per_microbatch = layers(fixed=0.2, per_step=1.0, activations=[2.0] * L)
    whole = per_microbatch.scaled(4)
    assert whole.latency[0, 0] == pytest.approx(0.2 + 0.8 * 4)
    split = choose_pipeline(space(per_microbatch, split=4), ALL, [4, 2, 8])
    direct = choose_pipeline(space(whole), ALL, [4, 2, 8])
    got = {(c.schedule, c.microbatches): c.seconds for c in split.candidates}
    want = {(c.schedule, c.microbatches): c.seconds for c in direct.candidates}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got)


@pytest.mark.parametrize(
    "fixed, memory, split, stashed, skips",
    [
        (0.0, 1e9, None, (2.0, 1.0, 1.0, 3.0), True),
        (0.3, 1e9, None, (2.0, 1.0, 1.0, 3.0), True),
        (0.1, 6.0, None, (2.0, 1.0, 1.0, 3.0), True),
        # Only some schedules' stashes fit (four candidates, none skipped): the others keep
        # saying why, whatever their bounds (none: no plan).
        (0.1, 12.0, None, (16.0, 8.0, 8.0, 80.0), False),
        (0.2, 1e9, 2, (2.0, 1.0, 1.0, 3.0), True),
        (0.05, 1e9, 16, (2.0, 1.0, 1.0, 3.0), True),
    ],
)
def test_skipping_by_lower_bounds_keeps_the_choice_and_its_runner_up(fixed, memory, split, stashed, skips):
    """Each (schedule, count) priced alone is simulated whatever its bound: the reference. All
    of them priced together: the choice, its runner-up, the split's own count, every candidate
    simulated and every one without a plan that fits are the reference's; a candidate not
    simulated has a plan that fits, a bound above the choice, and is slower in the reference."""
    counts = [1, 2, 4, 8, 16]
    per_step = 4.0 if split is None else 4.0 / split  # a split step's arrays are one microbatch's
    arrays = layers(fixed=fixed, activations=list(stashed), per_step=per_step)
    alone = {}
    for schedule in ALL:
        for b in counts:
            (c,) = choose_pipeline(space(arrays, memory, split), [schedule], [b]).candidates
            alone[(c.schedule, b)] = c
    choice = choose_pipeline(space(arrays, memory, split), ALL, counts)
    ranked = sorted((c for c in alone.values() if c.plan is not None), key=lambda c: c.seconds)
    best = choice.best
    assert (best.schedule, best.microbatches, best.seconds) == (
        ranked[0].schedule,
        ranked[0].microbatches,
        ranked[0].seconds,
    )
    runner_up = choice.runner_up(best)
    want = next(c for c in ranked if c.schedule != best.schedule)
    assert (runner_up.schedule, runner_up.microbatches, runner_up.seconds) == (
        want.schedule,
        want.microbatches,
        want.seconds,
    )
    skipped = 0
    for c in choice.candidates:
        reference = alone[(c.schedule, c.microbatches)]
        if c.why.startswith("not simulated"):
            skipped += 1
            assert c.microbatches != split and reference.plan is not None  # a plan that fits, not simulated
            bound = float(c.why.split("at least ")[1].split(" s")[0])
            assert best.seconds < bound <= reference.seconds * (1 + 1e-3)  # the why rounds to 4 digits
        else:
            assert (c.seconds, c.why, c.plan) == (reference.seconds, reference.why, reference.plan)
    assert (skipped > 0) == skips


def test_ranking_by_eq2_keeps_the_dp_s_plan():
    """One schedule ranked by Eq. 2 (what stage construction does with a schedule given):
    Σ t + (B - 1) max t per count, no simulation."""
    choice = choose_pipeline(space(layers()), [get_schedule("eager-1f1b")], [2, 8], by="eq2")
    assert [(c.microbatches, c.seconds) for c in choice.candidates] == [
        (8, pytest.approx(4 * 0.5 + 7 * 0.5)),
        (2, pytest.approx(4 * 2.0 + 1 * 2.0)),
    ]


def test_ranking_by_eq2_simulates_the_plan_it_picks_only():
    """The DP's pick is also run in the simulator (what the report predicts the step by);
    the other counts' plans are not."""
    sp = space(layers())
    choice = choose_pipeline(sp, [get_schedule("1f1b")], [2, 8], by="eq2")
    best, other = choice.candidates
    received = np.eye(L, k=1) + np.eye(L, k=-1)
    expected = simulated_step(sp, get_schedule("1f1b"), 8, best.table, best.plan, received, False)[0]
    assert best.simulated == expected == pytest.approx((8 + 3) * 0.5)
    assert other.simulated is None


def test_a_host_thread_that_pays_each_launch_makes_fewer_microbatches_win():
    """Without a host thread, 8 microbatches win ((8 + 3) x 0.5 s against (2 + 3) x 2 s). One
    thread that launches every run in 1 s: 4 stages x 2 runs x B + 4 updates, 20 s at 2
    microbatches, 68 s at 8: the fewer win, priced at the thread's work."""
    one = [get_schedule("1f1b")]
    assert choose_pipeline(space(layers()), one, [2, 8]).best.microbatches == 8
    host = HostLaunches(launch_s=1.0, device_s=0.0, values=np.zeros((3, L)), value_s=0.0, devices=L)
    choice = choose_pipeline(replace(space(layers()), host=host), one, [2, 8])
    assert [(c.microbatches, c.seconds) for c in choice.candidates] == [
        (2, pytest.approx(20.0)),
        (8, pytest.approx(68.0)),
    ]
    # The same 1 s a launch from its three parts: 0.25 s, 0.5 s for the stage's one device,
    # 0.25 s for the 5 values its one layer hands over (forward, backward, update alike).
    parts = HostLaunches(launch_s=0.25, device_s=0.5, values=np.full((3, L), 5.0), value_s=0.05, devices=L)
    assert choose_pipeline(replace(space(layers()), host=parts), one, [2]).best.seconds == pytest.approx(20.0)


def test_one_stage_of_one_microbatch_is_its_latency_whatever_the_host():
    """Every layer on one device, one microbatch: one executable, its one launch in its
    latency; the host thread is not priced for it: 16 s, launches dear or not."""
    host = HostLaunches(launch_s=1.0, device_s=0.0, values=np.ones((3, L)), value_s=0.1, devices=1)
    sp = replace(space(layers()), num_devices=1, host=replace(host, shares_cores=True))
    best = choose_pipeline(sp, [get_schedule("1f1b")], [1]).best
    assert (len(best.plan.stages), best.seconds) == (1, pytest.approx(16.0))
    # Two microbatches: 2 forwards, 2 backwards, 1 update, each 1 s + 4 values x 0.1 s, and
    # the device's 16 s on the same cores: 23 s.
    best = choose_pipeline(sp, [get_schedule("1f1b")], [2]).best
    assert (len(best.plan.stages), best.seconds) == (1, pytest.approx(23.0))


def test_more_meshes_must_be_faster_by_a_margin():
    """Simulated candidates rank by `score`: the time, 5% more a mesh beyond the first. 4
    stages of one mesh each at 16 s score 16 x 1.05^3 = 18.52 s: a one-mesh plan of 18.5 s
    ranks first, one of 18.6 s after; stages on one mesh (chunks) count once."""
    assert MESH_MARGIN == 0.05
    choice = choose_pipeline(space(layers()), [get_schedule("1f1b")], [1])
    four = choice.best
    assert (len(four.plan.stages), four.seconds) == (4, pytest.approx(16.0))
    assert four.score == pytest.approx(16.0 * 1.05**3)
    one_mesh = replace(four.plan, stages=four.plan.stages[:1])
    assert (
        replace(four, plan=one_mesh, seconds=18.5).score < four.score < replace(four, plan=one_mesh, seconds=18.6).score
    )
    assert replace(four, chunks=4).score == four.seconds and replace(four, plan=None).score == np.inf


def test_interleaving_two_chunks_per_mesh_wins_on_uniform_layers():
    """8 layers of 4 s a step on 4 one-device meshes, 8 microbatches (F a third of a layer's
    0.5 s, B two thirds), links free. One stage per mesh: 2 layers a stage, 1F1B's step (8 + 3)
    x 1 s. Interleaved 1F1B with v = 2: 8 stages of one layer, stage k on mesh k mod 4, the
    bubble a chunk's (p - 1) x 0.5 s: 8 + 1.5 s. With v = 3 or 4 the layers do not fill the
    chunks (12, 16 stages > 8 layers): v = 2 is the one plan, and the pass's pick over eager-1F1B."""
    num_layers = 8
    row = lambda values: np.array([values], dtype=float)  # noqa: E731
    zero = row([0.0] * num_layers)
    arrays = LayerArrays(
        latency=row([4.0] * num_layers),
        fixed_latency=zero,
        state_bytes=zero,
        gradient_bytes=zero,
        activation_bytes=row([1.0] * num_layers),
        updated_state_bytes=zero,
        temporary_bytes=zero,
        resharding=np.zeros((1, num_layers, num_layers)),
        forward_latency=row([4.0 / 3] * num_layers),
        forward_fixed_latency=zero,
        input_bytes=np.zeros((1, num_layers, num_layers)),
    )
    space_ = PipelineSpace(
        arrays,
        np.eye(num_layers, k=1) + np.eye(num_layers, k=-1),
        meshes_of_submesh=[[0]],
        submesh_sizes=[1],
        num_devices=4,
        transfer_seconds=lambda nbytes, devices: 0.0,
        memory_per_device=1e9,
        max_stages=4,
    )
    schedules = [get_schedule(name) for name in ("eager-1f1b", "1f1b", "interleaved-1f1b")]
    choice = choose_pipeline(space_, schedules, [8])
    seconds = {c.schedule: c.seconds for c in choice.candidates}
    assert seconds["1f1b"] == pytest.approx(11.0, rel=1e-12)
    best = choice.best
    assert best.schedule == "interleaved-1f1b" and best.chunks == 2
    assert best.seconds == pytest.approx(8 + 3 * 0.5, rel=1e-12)
    assert [(s.start_layer, s.end_layer) for s in best.plan.stages] == [(k, k) for k in range(8)]
    assert best.placement == (0, 1, 2, 3, 0, 1, 2, 3)
    # The bubble is 1/v of one-stage-per-mesh 1F1B's: (p - 1) / (v B + p - 1) of the step.
    assert best.bubble_fraction == pytest.approx(3 / (2 * 8 + 3), rel=1e-9)
    # Each mesh holds its two chunks: mesh 1 stages 1 and 5, 8 and 4 stashes of 1/8 byte, and
    # each chunk a microbatch's 2 bytes received and 2 sent (1/8 each): 1.5 + 1 bytes. With
    # room for 2.25 each chunk alone fits (1.5 at most) and mesh 1 does not: no plan.
    interleaved = get_schedule("interleaved-1f1b")
    assert interleaved.chunk_stashes(4, 2, 8) == (8, 8, 7, 5, 4, 4, 3, 1)
    assert choose_pipeline(replace(space_, memory_per_device=2.5), [interleaved], [8]).best is not None
    tight = choose_pipeline(replace(space_, memory_per_device=2.25), [interleaved], [8])
    assert tight.best is None and "2 chunks per mesh (their memories summed)" in tight.candidates[0].why
    # Where remat is allowed, the chunks are planned again within half the memory each (1.125):
    # stage 0 (8 stashes, 1.25 kept) recomputes its forward from inputs of no bytes here, stage 7
    # (1 stash) keeps its own, and the step pays for the recompute.
    rematerialized = choose_pipeline(replace(space_, memory_per_device=2.25, remat="auto"), [interleaved], [8]).best
    stages = rematerialized.plan.stages
    assert rematerialized.chunks == 2 and len(stages) == 8
    remat = [bool(rematerialized.table.remat[s.start_layer, s.end_layer, 0, 7 - k]) for k, s in enumerate(stages)]
    assert remat[0] and not remat[7]
    assert rematerialized.seconds > best.seconds
    # The count must be a multiple of the 4 meshes (Megatron's groups).
    odd = choose_pipeline(space_, [get_schedule("interleaved-1f1b")], [6])
    assert odd.best is None and "not a multiple of 4" in odd.candidates[0].why
