"""Rematerialization as an option of the span table (`span_costs.span_table`, issue 15): its
memory and latency formulas exactly, chosen only where it pays, and the plan the DP makes
of it (a larger microbatch count that only rematerialized stages fit)."""

from __future__ import annotations

import numpy as np
import pytest

from hlopar.analysis.stages.span_costs import LayerArrays, _inputs_by_span, span_table
from hlopar.analysis.stages.stage_dp import stage_dp

GIB = 2.0**30


def arrays(
    G: int = 1,
    L: int = 2,
    *,
    latency=1.0,
    fixed=0.1,
    state=1.0,
    gradient=1.0,
    activation=8.0,
    forward=0.3,
    forward_fixed=0.05,
    inputs=0.5,
    updated=0.0,
    temporary=0.0,
) -> LayerArrays:
    """Hand-made per-layer numbers (bytes in GiB), every layer alike (`temporary` may also be
    one per layer); layer l reads `inputs` GiB per step from layer l-1."""
    full = lambda x: np.broadcast_to(np.asarray(x, dtype=float), (G, L)).copy()  # noqa: E731
    pairs = np.zeros((G, L, L))
    for a in range(L - 1):
        pairs[:, a, a + 1] = inputs * GIB
    return LayerArrays(
        latency=full(latency),
        fixed_latency=full(fixed),
        state_bytes=full(state * GIB),
        gradient_bytes=full(gradient * GIB),
        activation_bytes=full(activation * GIB),
        updated_state_bytes=full(updated * GIB),
        temporary_bytes=full(np.multiply(temporary, GIB)),
        resharding=np.zeros((G, L, L)),
        forward_latency=full(forward),
        forward_fixed_latency=full(forward_fixed),
        input_bytes=pairs,
    )


def table(layers: LayerArrays, *, B: int, memory_gib: float, remat: str, meshes=((0,),), flight=lambda s: s):
    L = layers.latency.shape[1]
    return span_table(
        layers,
        np.zeros((L, L)),
        [list(m) for m in meshes],
        lambda b, n: 0.0,
        [1] * len(meshes),
        microbatches=B,
        in_flight=flight,
        memory_per_device=memory_gib * GIB,
        max_stages=L,
        remat=remat,
    )


def test_memory_and_latency_of_every_option_exactly():
    layers = arrays(L=3)
    B = 4
    keep = table(layers, B=B, memory_gib=1e9, remat="never")
    forced = table(layers, B=B, memory_gib=1e9, remat="always")
    per_layer = table(layers, B=B, memory_gib=1e9, remat="layers")
    for i in range(3):
        for j in range(i, 3):
            n = j - i + 1
            for s in (1, 2, 3):
                t = n * (0.1 + 0.9 / B)
                assert keep.latency[i, j, 0, s - 1] == pytest.approx(t, rel=1e-12)
                assert keep.memory[i, j, 0, s - 1] == pytest.approx((2 * n + 8 * n / B * s) * GIB, rel=1e-12)
                assert not keep.remat[i, j, 0, s - 1]
                # One more forward per microbatch; state, one microbatch's activations, and
                # the inputs from layers before i (one 0.5 GiB edge, none for i = 0) per
                # microbatch in flight.
                assert forced.latency[i, j, 0, s - 1] == pytest.approx(t + n * (0.05 + 0.25 / B), rel=1e-12)
                inputs = 0.5 if i > 0 else 0.0
                assert forced.memory[i, j, 0, s - 1] == pytest.approx(
                    (2 * n + 8 * n / B + inputs / B * s) * GIB, rel=1e-12
                )
                assert forced.remat[i, j, 0, s - 1] and not forced.per_layer[i, j, 0, s - 1]
                # Per layer: the largest layer's activations of one microbatch, and every
                # boundary the span's layers read (from before i, and between its own) per
                # microbatch in flight; the same latency.
                boundaries = inputs + 0.5 * (n - 1)
                assert per_layer.latency[i, j, 0, s - 1] == forced.latency[i, j, 0, s - 1]
                assert per_layer.memory[i, j, 0, s - 1] == pytest.approx(
                    (2 * n + 8 / B + boundaries / B * s) * GIB, rel=1e-12
                )
                assert per_layer.remat[i, j, 0, s - 1] and per_layer.per_layer[i, j, 0, s - 1]


def test_memory_is_the_larger_of_the_update_and_the_forward_backward_phase():
    """The update holds old state + gradients + new state; the forward and backward hold state
    + gradients + the stashes + the span's layers' temporaries (per microbatch); the table
    keeps the larger, kept and rematerialized alike. (No values cross stages here: `table`
    passes no received bytes; `test_span_costs` has them.)"""
    B = 4
    temporaries = [4.0, 12.0, 8.0]  # per step: 1, 3 and 2 GiB a microbatch
    for activation, updated in ((8.0, 1.0), (0.4, 3.0)):
        layers = arrays(L=3, activation=activation, updated=updated, temporary=temporaries)
        keep = table(layers, B=B, memory_gib=1e9, remat="never")
        forced = table(layers, B=B, memory_gib=1e9, remat="always")
        for i in range(3):
            for j in range(i, 3):
                n = j - i + 1
                most = sum(temporaries[i : j + 1]) / B
                update = 2 * n + updated * n
                inputs = 0.5 if i > 0 else 0.0
                for s in (1, 2, 3):
                    running = 2 * n + activation * n / B * s + most
                    assert keep.memory[i, j, 0, s - 1] == pytest.approx(max(running, update) * GIB, rel=1e-12)
                    running = 2 * n + activation * n / B + inputs / B * s + most
                    assert forced.memory[i, j, 0, s - 1] == pytest.approx(max(running, update) * GIB, rel=1e-12)
    # Both phases win somewhere in the second case: the first layer alone, the update's
    # 1 + 1 + 3 = 5 GiB against 2 + 0.4/4 + 1 = 3.1; the second alone with three in flight,
    # 2 + 0.4/4·3 + 3 = 5.3 against the update's 5; all three layers, the update's 15
    # against 6 + 0.3 + 6.
    assert keep.memory[0, 0, 0, 0] == pytest.approx(5 * GIB, rel=1e-12)
    assert keep.memory[1, 1, 0, 2] == pytest.approx(5.3 * GIB, rel=1e-12)
    assert keep.memory[0, 2, 0, 0] == pytest.approx(15 * GIB, rel=1e-12)


def test_auto_keeps_activations_where_they_fit_and_rematerializes_where_only_that_fits():
    layers = arrays(L=2)
    # One layer, s = 2: keeping needs 2 + 8/4·2 = 6 GiB; rematerializing 2 + 2 + 0.5/4·2.
    tight = table(layers, B=4, memory_gib=5.0, remat="auto")
    roomy = table(layers, B=4, memory_gib=6.0, remat="auto")
    never = table(layers, B=4, memory_gib=5.0, remat="never")
    assert roomy.remat[1, 1, 0, 1] == False and tight.remat[1, 1, 0, 1] == True  # noqa: E712
    assert np.isinf(never.latency[1, 1, 0, 1])
    assert tight.latency[1, 1, 0, 1] == pytest.approx(roomy.latency[1, 1, 0, 1] + 0.05 + 0.25 / 4, rel=1e-12)
    # Where both fit, the table is exactly the one without rematerialization.
    both = np.isfinite(never.latency)
    assert np.array_equal(tight.latency[both], never.latency[both])
    assert not tight.remat[both].any()
    # Fits neither way: infeasible.
    assert np.isinf(table(layers, B=4, memory_gib=3.0, remat="auto").latency[1, 1, 0, 1])


def test_auto_rematerializes_on_a_faster_mesh_when_it_beats_the_slower_one_that_fits():
    # Mesh 0 is light and slow (like weight-update sharding), mesh 1 fast and heavy.
    layers = arrays(G=2, L=1, latency=1.0, fixed=0.0, forward=0.3, forward_fixed=0.0, activation=2.0, inputs=0.0)
    slow = np.array([[2.0], [1.0]])
    lighter = np.array([[0.5], [1.0]]) * GIB
    layers = LayerArrays(**{**layers.__dict__, "latency": slow, "state_bytes": lighter})
    auto = table(layers, B=1, memory_gib=3.5, remat="auto", meshes=((0, 1),))
    # Keeping: mesh 0 needs 0.5 + 1 + 2 = 3.5 GiB (2.0 s); mesh 1 needs 4 (too much).
    # Rematerializing on mesh 1: 1 + 1 + 2 = 4: does not fit either, so mesh 0 keeps.
    assert (auto.mesh[0, 0, 0, 0], auto.remat[0, 0, 0, 0]) == (0, False)
    assert auto.latency[0, 0, 0, 0] == 2.0
    # With more microbatches in flight keeping costs more; at B = 2, s = 1, one in flight:
    # keeping on mesh 1 needs 1 + 1 + 1 = 3 GiB and fits: the fastest, no rematerialization.
    auto = table(layers, B=2, memory_gib=3.0, remat="auto", meshes=((0, 1),), flight=lambda s: 2)
    # Keeping two in flight: mesh 1 needs 4, mesh 0 3.5: neither fits; rematerializing on
    # mesh 1 needs 1 + 1 + 1 (one microbatch's activations) = 3 and takes 1.0/2 + 0.3/2.
    assert (auto.mesh[0, 0, 0, 0], auto.remat[0, 0, 0, 0]) == (1, True)
    assert auto.latency[0, 0, 0, 0] == pytest.approx(0.65, rel=1e-12)
    auto = table(layers, B=2, memory_gib=3.5, remat="auto", meshes=((0, 1),), flight=lambda s: 2)
    # Now mesh 0 keeps (3.5 GiB, 1.0 s per microbatch) but mesh 1 rematerialized is faster.
    assert (auto.mesh[0, 0, 0, 0], auto.remat[0, 0, 0, 0]) == (1, True)


def test_the_dp_takes_the_larger_microbatch_that_only_rematerialized_stages_fit():
    """Per microbatch a fixed 1 ms overhead: 8 microbatches cost 8 ms of it, 2 only 2 ms, but
    2 microbatches stash 4x the activations each; rematerialized, they fit and win."""
    layers = arrays(
        L=2,
        latency=0.008,
        fixed=0.001,
        forward=0.002,
        forward_fixed=0.0,
        state=1.0,
        gradient=0.0,
        activation=16.0,
        inputs=0.25,
    )
    plans = {}
    for mode in ("never", "auto"):
        for B in (2, 8):
            t = table(layers, B=B, memory_gib=12.0, remat=mode, flight=lambda s, b=B: min(s, b))
            try:
                plans[mode, B] = (stage_dp(t.latency, [1], 2, B), t)
            except ValueError:
                plans[mode, B] = None
    assert plans["never", 2] is None  # 1 + 16/2·2 = 17 GiB on the first stage
    never = plans["never", 8][0]
    auto, t = plans["auto", 2]
    assert auto.total_latency < never.total_latency
    remat = [bool(t.remat[s.start_layer, s.end_layer, 0, len(auto.stages) - k - 1]) for k, s in enumerate(auto.stages)]
    assert remat == [True, False]  # the last stage keeps one microbatch: 1 + 8 fits
    # At B = 8 auto finds the never-plan: keeping fits, so nothing is rematerialized.
    same, t8 = plans["auto", 8]
    assert same.total_latency == never.total_latency and not t8.remat[np.isfinite(t8.latency)].any()


def test_inputs_by_span_against_loops():
    rng = np.random.default_rng(0)
    pairs = np.triu(rng.uniform(0, 1, (2, 6, 6)), k=1)
    found = _inputs_by_span(pairs)
    for g in range(2):
        for i in range(6):
            for j in range(i, 6):
                expected = sum(pairs[g, a, b] for a in range(i) for b in range(i, j + 1))
                assert found[g, i, j] == pytest.approx(expected, abs=1e-12)


def test_remat_needs_its_arrays_and_a_known_mode():
    layers = arrays()
    bare = LayerArrays(**{**layers.__dict__, "forward_latency": None})
    with pytest.raises(ValueError, match="remat=auto needs the layers' forward latencies"):
        table(bare, B=1, memory_gib=100, remat="auto")
    assert not table(bare, B=1, memory_gib=100, remat="never").remat.any()
    with pytest.raises(ValueError, match="remat must be one of auto, always, never, layers, got 'yes'"):
        table(layers, B=1, memory_gib=100, remat="yes")


# --------------------------------------------------------------------------- per layer


def test_auto_takes_per_layer_only_where_it_alone_fits():
    """Four layers of 8 GiB activations a step, B = 4, one in flight. All four layers: keeping
    needs 8 + 8 = 16 GiB, the stage form 8 + 8 = 16, per layer 8 + 2 + 1.5/4 = 10.375 (1.75 s
    against 1.3 s kept)."""
    layers = arrays(L=4)
    tight = table(layers, B=4, memory_gib=12.0, remat="auto")
    assert tight.per_layer[0, 3, 0, 0] and tight.remat[0, 3, 0, 0]
    assert tight.memory[0, 3, 0, 0] == pytest.approx(10.375 * GIB, rel=1e-12)
    assert tight.latency[0, 3, 0, 0] == pytest.approx(4 * (0.1 + 0.9 / 4) + 4 * (0.05 + 0.25 / 4), rel=1e-12)
    assert np.isinf(table(layers, B=4, memory_gib=12.0, remat="always").latency[0, 3, 0, 0])
    # 16 GiB: keeping fits, and is faster: nothing is rematerialized.
    roomy = table(layers, B=4, memory_gib=16.0, remat="auto")
    assert not roomy.remat[0, 3, 0, 0] and roomy.latency[0, 3, 0, 0] == pytest.approx(1.3, rel=1e-12)
    # Two in flight with 17 GiB: keeping needs 24; both remat forms fit (16 and 10.75) at the
    # same time: the tie goes to the stage form.
    both = table(layers, B=4, memory_gib=17.0, remat="auto")
    assert both.remat[0, 3, 0, 1] and not both.per_layer[0, 3, 0, 1]
    assert both.memory[0, 3, 0, 1] == pytest.approx(16 * GIB, rel=1e-12)
    # One layer: both forms hold the same bytes, so per layer is never chosen.
    assert not tight.per_layer[:, :, :, :][np.eye(4, dtype=bool)].any()
