"""The DP's table from per-layer plans: prefix sums equal the direct sums."""

from __future__ import annotations

import dataclasses

import numpy as np

from hlopar.analysis.stages.span_costs import LayerArrays, span_table, span_tables, values_received_by_span


def _random_layers(rng, G, L):
    pairs = np.triu(rng.uniform(0, 1, (G, L, L)), k=1)
    latency = rng.uniform(1, 2, (G, L))
    return LayerArrays(
        latency=latency,
        fixed_latency=latency * rng.uniform(0, 0.2, (G, L)),
        state_bytes=rng.uniform(0, 10, (G, L)),
        gradient_bytes=rng.uniform(0, 5, (G, L)),
        activation_bytes=rng.uniform(0, 10, (G, L)),
        updated_state_bytes=rng.uniform(0, 10, (G, L)),
        temporary_bytes=rng.uniform(0, 20, (G, L)),
        resharding=pairs,
    )


def test_span_table_equals_direct_sums_and_keeps_the_best_fitting_mesh():
    rng = np.random.default_rng(0)
    G, L, S, B = 3, 5, 4, 4
    layers = _random_layers(rng, G, L)
    received = rng.uniform(0, 20, (L, L))
    meshes_of_submesh = [[0], [1, 2]]
    sizes = [1, 4]
    memory = 60.0
    in_flight = lambda s: min(2 * s - 1, B)  # eager-1F1B
    transfer = lambda nbytes, devices: 0.01 + nbytes / (1000.0 * devices)
    table = span_table(
        layers,
        received,
        meshes_of_submesh,
        transfer,
        sizes,
        microbatches=B,
        in_flight=in_flight,
        memory_per_device=memory,
        max_stages=S,
    )
    for i in range(L):
        for j in range(L):
            for m, meshes in enumerate(meshes_of_submesh):
                for s in range(1, S + 1):
                    best, best_g, best_need = np.inf, -1, np.inf
                    if j >= i:
                        span = range(i, j + 1)
                        for g in meshes:
                            t = sum(
                                layers.fixed_latency[g, l] + (layers.latency[g, l] - layers.fixed_latency[g, l]) / B
                                for l in span
                            )
                            t += sum(layers.resharding[g, a, b] for a in span for b in span if a < b) / B
                            inbound = sum(received[a, b] for a in range(L) for b in span if a not in span)
                            t += (transfer(inbound, sizes[m]) if inbound > 0 else 0.0) / B
                            held = sum(layers.state_bytes[g, l] + layers.gradient_bytes[g, l] for l in span)
                            running = held + in_flight(s) * sum(layers.activation_bytes[g, l] for l in span) / B
                            outbound = sum(received[a, b] for a in span for b in range(L) if b not in span)
                            running += (sum(layers.temporary_bytes[g, l] for l in span) + inbound + outbound) / B
                            updating = held + sum(layers.updated_state_bytes[g, l] for l in span)
                            need = max(running, updating)
                            if need <= memory and t < best:
                                best, best_g, best_need = t, g, need
                    assert np.isclose(table.latency[i, j, m, s - 1], best) or (
                        np.isinf(best) and np.isinf(table.latency[i, j, m, s - 1])
                    )
                    assert table.mesh[i, j, m, s - 1] == best_g
                    assert np.isclose(table.memory[i, j, m, s - 1], best_need) or np.isinf(best_need)


def test_more_stages_after_a_stage_never_make_it_fit_better():
    rng = np.random.default_rng(1)
    layers = _random_layers(rng, 2, 6)
    table = span_table(
        layers,
        np.zeros((6, 6)),
        [[0, 1]],
        lambda b, d: 0.0,
        [2],
        microbatches=8,
        in_flight=lambda s: min(s, 8),
        memory_per_device=40.0,
        max_stages=6,
    )
    feasible = np.isfinite(table.latency[:, :, 0, :])
    # Feasible with s stages after implies feasible with fewer (1F1B stashes fewer microbatches).
    assert not (feasible[:, :, 1:] & ~feasible[:, :, :-1]).any()


def test_tables_of_several_in_flight_rules_equal_one_table_each():
    """`span_tables` shares what does not depend on the rule; each table is the one
    `span_table` makes alone, array for array."""
    rng = np.random.default_rng(3)
    layers = _random_layers(rng, 3, 5)
    layers = dataclasses.replace(
        layers,
        forward_latency=layers.latency / 3,
        forward_fixed_latency=layers.fixed_latency / 3,
        input_bytes=np.triu(rng.uniform(0, 1, (3, 5, 5)), k=1),
    )
    received = rng.uniform(0, 20, (5, 5))
    common = dict(microbatches=4, memory_per_device=60.0, max_stages=4, remat="auto")
    args = (layers, received, [[0], [1, 2]], lambda nbytes, devices: 0.01 + nbytes / (1000.0 * devices), [1, 4])
    rules = [lambda s: min(s, 4), lambda s: min(2 * s - 1, 4), lambda s: 4]
    together = span_tables(*args, in_flights=rules, **common)
    for rule, table in zip(rules, together):
        alone = span_table(*args, in_flight=rule, **common)
        for name in alone.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(table, name), getattr(alone, name), err_msg=name)


def test_fragment_launches_are_paid_per_stage_not_per_layer():
    """`launch_s` (a calibrated preset's `executable_launch_s`): every span pays a forward and a
    backward launch per microbatch and its update's once a step, (2 + 1/B) launches, whatever
    its length; so fewer, longer stages gain where launches are dear. The forward share gains
    one launch."""
    rng = np.random.default_rng(3)
    G, L, B = 1, 4, 4
    layers = _random_layers(rng, G, L)
    latency = layers.latency
    layers = dataclasses.replace(layers, forward_latency=latency / 3, forward_fixed_latency=layers.fixed_latency / 3)
    options = dict(microbatches=B, in_flight=lambda s: 1, memory_per_device=np.inf, max_stages=2)
    args = (layers, np.zeros((L, L)), [[0]], lambda nbytes, devices: 0.0, [1])
    bare = span_table(*args, **options)
    launched = span_table(dataclasses.replace(layers, launch_s=0.25), *args[1:], **options)
    upper = np.triu(np.ones((L, L), bool))  # the spans i <= j (below: no span, inf)
    added = launched.latency[..., 0, 0][upper] - bare.latency[..., 0, 0][upper]
    np.testing.assert_allclose(added, (2 + 1 / B) * 0.25, rtol=1e-12)
    forward = launched.forward[..., 0, 0][upper] - bare.forward[..., 0, 0][upper]
    np.testing.assert_allclose(forward, 0.25, rtol=1e-12)
    assert dataclasses.replace(layers, launch_s=0.25).scaled(2.0).launch_s == 0.25
    # One microbatch: the span of every layer is one stage run as one executable, one launch;
    # every shorter span still three (its forward, its backward, its update).
    options["microbatches"] = 1
    bare = span_table(*args, **options)
    launched = span_table(dataclasses.replace(layers, launch_s=0.25), *args[1:], **options)
    added = launched.latency[..., 0, 0] - bare.latency[..., 0, 0]
    whole = np.zeros((L, L), bool)
    whole[0, L - 1] = True
    np.testing.assert_allclose(added[whole], 0.25, rtol=1e-12)
    np.testing.assert_allclose(added[upper & ~whole], 3 * 0.25, rtol=1e-12)


def test_values_a_span_receives_are_counted_once_each():
    """`values_received_by_span` against the definition, on random values: a value is
    received by layers i..j when its layer is outside and one of its readers inside."""
    rng = np.random.default_rng(5)
    L = 7
    producers = [int(rng.integers(L)) for _ in range(40)]
    readers = [tuple(int(r) for r in rng.choice(L, size=int(rng.integers(1, 4)), replace=False)) for _ in producers]
    counts = values_received_by_span(producers, readers, L)
    expected = np.zeros((L, L))
    for i in range(L):
        for j in range(i, L):
            expected[i, j] = sum(
                1 for a, rs in zip(producers, readers) if not i <= a <= j and any(i <= r <= j for r in rs)
            )
    np.testing.assert_array_equal(counts, expected)


def test_the_transport_charges_each_value_a_stage_receives_per_microbatch():
    """A calibrated transport's cost per value (`transfer_latency_s`) is paid per microbatch for
    every value a span receives, whatever its bytes (which the transfer time prices apart)."""
    rng = np.random.default_rng(3)
    G, L, B = 1, 4, 4
    layers = _random_layers(rng, G, L)
    options = dict(microbatches=B, in_flight=lambda s: 1, memory_per_device=np.inf, max_stages=2)
    args = (np.zeros((L, L)), [[0]], lambda nbytes, devices: 0.0, [1])
    received = values_received_by_span([0, 1, 3], [(2,), (2, 3), (0,)], L)
    bare = span_table(layers, *args, **options)
    moved = span_table(dataclasses.replace(layers, received_values=received, transfer_latency_s=0.5), *args, **options)
    upper = np.triu(np.ones((L, L), bool))
    added = moved.latency[..., 0, 0][upper] - bare.latency[..., 0, 0][upper]
    np.testing.assert_allclose(added, 0.5 * received[upper], rtol=1e-12)
    assert received[0, 3] == 0 and received[2, 2] == 2 and received[0, 1] == 1  # the whole chain receives nothing
    # Not scaled with the batch: a count per microbatch.
    scaled = dataclasses.replace(layers, received_values=received, transfer_latency_s=0.5).scaled(2.0)
    np.testing.assert_array_equal(scaled.received_values, received)
