"""t_intra of every (layer span, submesh, stages after) from per-layer plans: the DP's table.

Alpa's Algorithm 1 (lines 8–24) fills t_intra((l_i..l_j), Mesh(n, m), s) by planning and
profiling every span on every logical shape of every submesh, keeping the fastest shape
whose memory passes Eq. 5 for s. Here a span's cost on a logical mesh is composed from its
layers' plans (`layer_costs`), all arrays over layers, so the whole table is a few numpy
prefix sums:

- latency per microbatch: each layer's start-up latencies, plus the rest of its plan cost
  over B (compute and bandwidth terms shrink with the microbatch), plus the resharding
  between the layouts of consecutive layers of the span over B, plus the launches of the
  stage's fragments (a forward and a backward per microbatch, the update once a step:
  `LayerArrays.launch_s`, the preset's `executable_launch_s`; one launch for the span of
  every layer at one microbatch, which runs as one executable: `codegen.one_program`);
- beyond Alpa (its §7): the bytes the stage receives from other stages (activations going
  forward, their gradients coming back) over the link between meshes, over B, and, where the
  transport is calibrated, its cost per value moved (`LayerArrays.transfer_latency_s`);
- memory (Eq. 5 generalized to the schedule and to what the compiled fragments hold, as
  `codegen.memory_check` counts them): the most of the stage's two phases, not their sum.
  While the forward and backward run: state + gradient accumulators + the activations of
  the microbatches in flight, `in_flight(schedule, s, B)` of them, each 1/B of a step's, +
  the running fragment's temporaries and the values it receives and sends (per microbatch).
  The temporaries are the span's layers' summed: each layer's is `fragment_memory`'s peak
  at the layer's layouts, and the sum bounds what a fragment of several layers holds at
  once, XLA's own scratch beyond that model included (the tiny Wide-ResNet's backward:
  1.8x the model). While the update runs: the old state + the gradients + the new state's
  buffers, held at once; its elementwise math fuses into no temporaries. State the user
  donates (`donate_argnums`) and the update reads is updated in place (the update fragment
  writes the new value into the old one's buffers, `codegen.pipeline_program`): its new
  value takes no bytes of its own (`LayerPlan.updated_state_bytes`), so the update's phase
  holds the state once, as Alpa's and `jax.jit`'s do; undonated, twice (the old state
  lives until the step ends).

Rematerialization is one more option per (span, logical mesh), beside keeping the forward
activations: the stage stashes only its inputs per microbatch in flight and its backward
recomputes the forward from them. Memory in the forward and backward: state + gradients +
the span's inputs (per microbatch) × in flight + one microbatch's activations (the
recompute's peak, held once) + the temporaries; the update's as above.
Latency: the span's per-microbatch latency plus its forward share once more.

Per-layer rematerialization (`jax.checkpoint` around each layer; `hlopar.remat = "layers"`)
is a third option: the stage stashes the values each of its layers reads from earlier layers
(the span's inputs and its inner layer boundaries, `input_bytes`) per microbatch in flight,
and its backward recomputes one layer at a time, so it holds the LARGEST single layer's
activations of one microbatch, not the span's. Memory: state + gradients + boundaries ×
in flight + that largest layer's activations + the temporaries; latency as stage remat.

The table keeps the fastest option that fits; on ties, keeping activations, then stage
remat, then per layer: a span is rematerialized only where that is feasible and keeping is
not, or where it lets a faster logical mesh or intra-op option fit, and per layer only where
the stage form does not fit as well; the pass weighs the microbatch counts this opens.
`remat="always"` forces the stage form on every span that stashes activations,
`remat="layers"` the per-layer form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["LayerArrays", "REMAT_MODES", "SpanTable", "span_table", "span_tables", "values_received_by_span"]

REMAT_MODES = ("auto", "always", "never", "layers")
KEEP, STAGE, LAYERS = 0, 1, 2  # the options, in the order ties go


@dataclass(frozen=True)
class LayerArrays:
    """Per logical mesh g and layer l (arrays of shape (G, L)), from `layer_costs.LayerPlan`
    (bytes per device per step: the state, the gradients, the stashed activations, the new
    state the update makes, the temporaries of the layer's forward or backward, the larger);
    `resharding[g, a, b]` the seconds to convert layer a's output layouts to layer b's input
    layouts (a < b) on mesh g, per step. What prices rematerialization (None: not priced):
    the forward share of the latencies and `input_bytes[g, a, b]`, the per-device bytes of
    the values of layer a that the forward ops of layer b read (a < b), per step."""

    latency: np.ndarray
    fixed_latency: np.ndarray
    state_bytes: np.ndarray
    gradient_bytes: np.ndarray
    activation_bytes: np.ndarray
    updated_state_bytes: np.ndarray
    temporary_bytes: np.ndarray
    resharding: np.ndarray  # (G, L, L), zero on and below the diagonal
    forward_latency: np.ndarray | None = None
    forward_fixed_latency: np.ndarray | None = None
    input_bytes: np.ndarray | None = None  # (G, L, L), zero on and below the diagonal
    launch_s: float = 0.0  # one fragment's launch (`ClusterPreset.executable_launch_s`)
    # [i, j]: the distinct values layers i..j read from layers outside i..j (a count per
    # microbatch, not scaled: `values_received_by_span`), each moved at `transfer_latency_s`
    received_values: np.ndarray | None = None
    transfer_latency_s: float = 0.0  # the transport's cost per value (`ClusterPreset.transfer_latency_s`)

    def scaled(self, factor: float) -> LayerArrays:
        """The arrays of a step of `factor` times this one's batch: what grows with the batch
        (the latencies beyond their start-up part, activations, temporaries, resharding, inputs)
        scaled, the state and its gradients not. A split step's arrays times its count of
        microbatches price, as a whole step's, the other counts it could have been split into.
        A start-up part above its latency (the start-ups of collectives the ILP's objective
        prices lower) is taken as the whole latency, so that at `factor` 1 nothing changes."""
        grow = lambda a: None if a is None else a * factor  # noqa: E731

        def stretched(total, fixed):  # inf (no plan on that mesh) stays inf
            fixed = np.minimum(fixed, total)
            with np.errstate(invalid="ignore"):
                return np.where(np.isfinite(total), fixed + (total - fixed) * factor, total), fixed

        latency, fixed = stretched(self.latency, self.fixed_latency)
        forward = forward_fixed = None
        if self.forward_latency is not None:
            forward, forward_fixed = stretched(self.forward_latency, self.forward_fixed_latency)
        return LayerArrays(
            latency=latency,
            fixed_latency=fixed,
            state_bytes=self.state_bytes,
            gradient_bytes=self.gradient_bytes,
            activation_bytes=self.activation_bytes * factor,
            updated_state_bytes=self.updated_state_bytes,
            temporary_bytes=self.temporary_bytes * factor,
            resharding=self.resharding * factor,
            forward_latency=forward,
            forward_fixed_latency=forward_fixed,
            input_bytes=grow(self.input_bytes),
            launch_s=self.launch_s,
            received_values=self.received_values,
            transfer_latency_s=self.transfer_latency_s,
        )


@dataclass(frozen=True)
class SpanTable:
    """`latency[i, j, m, s-1]`: the best per-microbatch latency of layers i..j on submesh m
    with s stages from this one to the last (inf: out of memory or j < i); `mesh[i, j, m, s-1]`
    the logical mesh (index g) that achieves it; `memory[i, j, m, s-1]` its bytes per device
    (the larger of its two phases), `update_memory[i, j, m, s-1]` those of its update's phase;
    `remat[i, j, m, s-1]` whether it is a rematerialized option, `per_layer[i, j, m, s-1]`
    whether that is the per-layer one. What the schedule choice prices a stage by
    (`pipeline_choice`): `forward[i, j, m, s-1]` the forward's share of the latency (None
    where the layers give no forward latencies), `transfer[i, j, m]` the receiving share
    (the latency's part that is bytes from other meshes), and the memory as
    `max(base_memory + stash_bytes x microbatches in flight, update_memory)`."""

    latency: np.ndarray
    mesh: np.ndarray
    memory: np.ndarray
    remat: np.ndarray
    update_memory: np.ndarray
    per_layer: np.ndarray
    forward: np.ndarray | None = None
    transfer: np.ndarray | None = None
    base_memory: np.ndarray | None = None
    stash_bytes: np.ndarray | None = None


def span_table(
    layers: LayerArrays,
    received_bytes: np.ndarray,
    meshes_of_submesh: Sequence[Sequence[int]],
    transfer_seconds: Callable[[float, int], float],
    submesh_sizes: Sequence[int],
    *,
    in_flight: Callable[[int], int],
    **options,
) -> SpanTable:
    """The table Eq. 3 reads (`span_tables` with one in-flight rule)."""
    return span_tables(
        layers, received_bytes, meshes_of_submesh, transfer_seconds, submesh_sizes, in_flights=[in_flight], **options
    )[0]


def span_tables(
    layers: LayerArrays,
    received_bytes: np.ndarray,
    meshes_of_submesh: Sequence[Sequence[int]],
    transfer_seconds: Callable[[float, int], float],
    submesh_sizes: Sequence[int],
    *,
    microbatches: int,
    in_flights: Sequence[Callable[[int], int]],
    memory_per_device: float,
    max_stages: int,
    per_microbatch: bool = False,
    remat: Literal["auto", "always", "never"] = "never",
) -> list[SpanTable]:
    """The table Eq. 3 reads, one per in-flight rule of `in_flights` (schedules differ only
    there: what does not depend on it is computed once). `received_bytes[a, b]`: bytes layer b reads from layer a per step
    (a != b; what a stage receives and sends, in its time and its memory); `meshes_of_submesh[m]`
    the logical meshes (indices g) of submesh m; `transfer_seconds(bytes, submesh_size)` the time
    to bring bytes into a stage of that size from another mesh; an in-flight rule `in_flight(s)`
    the microbatches whose activations a stage with s stages after it (itself included) keeps
    at once. With
    `per_microbatch`, the layers were planned on the program of one microbatch already: their
    costs and activations are not scaled.
    `remat`: "auto" weighs the three options (module docstring), "always" rematerializes every
    span that stashes activations (the stage form), "layers" likewise per layer, "never" keeps
    them all."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)}, got {remat!r}")
    if remat != "never" and (
        layers.forward_latency is None or layers.forward_fixed_latency is None or layers.input_bytes is None
    ):
        raise ValueError(f"remat={remat} needs the layers' forward latencies and input bytes")
    num_layers = layers.latency.shape[1]
    B = 1.0 if per_microbatch else float(microbatches)
    spans = _spans(layers, received_bytes, B, remat)
    flights = [np.array([f(int(s)) for s in range(1, max_stages + 1)], dtype=float) for f in in_flights]  # (S,)

    shape = (num_layers, num_layers, len(meshes_of_submesh), max_stages)
    transfers = np.zeros(shape[:3])
    tables = [_Table(shape, spans.forward is not None) for _ in flights]
    options = {"never": (KEEP,), "auto": (KEEP, STAGE, LAYERS), "always": (KEEP, STAGE), "layers": (KEEP, LAYERS)}[
        remat
    ]
    rows, cols = np.ogrid[:num_layers, :num_layers]
    for m, meshes in enumerate(meshes_of_submesh):
        if not meshes:
            continue
        transfer = _transfer_per_step(spans.received, transfer_seconds, submesh_sizes[m]) / B
        transfers[:, :, m] = transfer
        # Every candidate (option, logical mesh), keeping first: the first fastest one wins ties.
        candidates = [(option, g) for option in options for g in meshes]
        found = _best_candidates(
            spans, candidates, transfer, flights, memory_per_device, forced=remat in ("always", "layers")
        )
        for table, best in zip(tables, found):
            table.fill(m, best, spans, rows, cols)
    return [table.result(transfers) for table in tables]


class _Table:
    """One in-flight rule's `SpanTable` as its submeshes are filled in."""

    def __init__(self, shape: tuple[int, ...], with_forward: bool) -> None:
        self.latency = np.full(shape, np.inf)
        self.chosen = np.full(shape, -1, dtype=np.int64)
        self.memory = np.full(shape, np.inf)
        self.updating = np.full(shape, np.inf)
        self.option_of = np.full(shape, KEEP, dtype=np.int8)
        self.forward = np.full(shape, np.inf) if with_forward else None
        self.base_memory = np.full(shape, np.inf)
        self.stash_bytes = np.zeros(shape)

    def fill(self, m: int, best: tuple[np.ndarray, ...], spans: _Spans, rows, cols) -> None:
        (
            self.latency[:, :, m, :],
            self.chosen[:, :, m, :],
            self.memory[:, :, m, :],
            self.updating[:, :, m, :],
            self.option_of[:, :, m, :],
            self.base_memory[:, :, m, :],
            self.stash_bytes[:, :, m, :],
        ) = best
        if self.forward is not None:
            found = self.chosen[:, :, m, :] >= 0
            g = np.where(found, self.chosen[:, :, m, :], 0)
            self.forward[:, :, m, :] = np.where(found, spans.forward[g, rows[:, :, None], cols[:, :, None]], np.inf)

    def result(self, transfers: np.ndarray) -> SpanTable:
        return SpanTable(
            self.latency,
            self.chosen,
            self.memory,
            self.option_of != KEEP,
            self.updating,
            self.option_of == LAYERS,
            self.forward,
            transfers,
            self.base_memory,
            self.stash_bytes,
        )


@dataclass(frozen=True)
class _Spans:
    """Sums over the layers of each span that every submesh reads, per microbatch where a step
    is split: `[g, i, j]` for layers i..j on logical mesh g (`received`: `[i, j]`). The
    rematerialization terms are None under remat="never"."""

    latency: np.ndarray
    update_peak: np.ndarray
    activations: np.ndarray
    received: np.ndarray
    running: np.ndarray  # beside the stashes
    forward: np.ndarray | None  # the forward's share of `latency` (None: not given)
    recompute: np.ndarray | None
    inputs: np.ndarray | None
    boundaries: np.ndarray | None
    largest_layer: np.ndarray | None


def _spans(layers: LayerArrays, received_bytes: np.ndarray, B: float, remat: str) -> _Spans:
    per_micro = layers.fixed_latency + (layers.latency - layers.fixed_latency) / B  # (G, L)
    lat_span = _span_sums(per_micro)  # (G, L, L)
    lat_span += _inner_pair_sums(layers.resharding) / B
    state_span = _span_sums(layers.state_bytes + layers.gradient_bytes)
    update_peak = state_span + _span_sums(layers.updated_state_bytes)
    act_span = _span_sums(layers.activation_bytes) / B
    received = _received_by_span(received_bytes)  # (L, L)
    sent = _received_by_span(np.transpose(received_bytes))
    running = state_span + (_span_sums(layers.temporary_bytes) + received + sent) / B
    recompute_span = inputs_span = boundaries_span = largest_layer = forward_span = None
    if layers.forward_latency is not None and layers.forward_fixed_latency is not None:
        forward_span = _span_sums(
            layers.forward_fixed_latency + (layers.forward_latency - layers.forward_fixed_latency) / B
        )
    if remat != "never":
        recompute_span = forward_span  # run inside the backward's fragment: no launch of its own
        inputs_span = _inputs_by_span(layers.input_bytes) / B
        boundaries_span = inputs_span + _inner_pair_sums(layers.input_bytes) / B
        largest_layer = _span_maxima(layers.activation_bytes) / B
    if layers.launch_s:
        # A stage launches a forward and a backward fragment per microbatch and its update
        # once per step, whatever its layers: what many small stages or microbatches cost.
        lat_span = lat_span + (2.0 + 1.0 / B) * layers.launch_s
        if B == 1:  # every layer in one stage, one microbatch: one executable, one launch (`codegen.one_program`)
            lat_span[:, 0, -1] -= 2.0 * layers.launch_s
        if forward_span is not None:
            forward_span = forward_span + layers.launch_s
    if layers.transfer_latency_s and layers.received_values is not None:
        # Each value a stage receives (activations forward, their gradients back) is moved by
        # the runtime's transport once a microbatch, whatever its bytes.
        lat_span = lat_span + layers.transfer_latency_s * layers.received_values
    return _Spans(
        lat_span,
        update_peak,
        act_span,
        received,
        running,
        forward_span,
        recompute_span,
        inputs_span,
        boundaries_span,
        largest_layer,
    )


def _transfer_per_step(
    received: np.ndarray, transfer_seconds: Callable[[float, int], float], submesh_size: int
) -> np.ndarray:
    """[i, j]: seconds to bring what layers i..j receive into a stage on a submesh of that size."""
    return np.vectorize(lambda b: transfer_seconds(b, submesh_size) if b > 0 else 0.0, otypes=[float])(received)


def _best_candidates(
    spans: _Spans,
    candidates: Sequence[tuple[int, int]],
    transfer: np.ndarray,
    flights: Sequence[np.ndarray],
    memory_per_device: float,
    *,
    forced: bool,
) -> list[tuple[np.ndarray, ...]]:
    """For one submesh and each in-flight count per stage count of `flights`, the fastest
    (option, logical mesh) of `candidates` for every span and stage count that fits in memory:
    its (latency, logical mesh, memory, memory while updating, option, memory beside the
    stashes, bytes per stash), each (L, L, S); inf, -1, KEEP, inf and 0 where none fits. What
    does not depend on the in-flight counts is computed once for all of them."""
    num_layers = transfer.shape[0]
    valid = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    base = np.empty((len(candidates), num_layers, num_layers))  # need = base + slope x in flight
    slope = np.empty_like(base)
    seconds = np.empty_like(base)
    for c, (option, g) in enumerate(candidates):
        usable = valid & ((spans.activations[g] > 0) == (option != KEEP)) if forced else valid
        t = spans.latency[g] + transfer
        if option == STAGE:
            base[c], slope[c] = spans.running[g] + spans.activations[g], spans.inputs[g]
        elif option == LAYERS:
            base[c], slope[c] = spans.running[g] + spans.largest_layer[g], spans.boundaries[g]
        else:
            base[c], slope[c] = spans.running[g], spans.activations[g]
        if option != KEEP:
            t = t + spans.recompute[g]
        seconds[c] = np.where(usable & (spans.update_peak[g] <= memory_per_device), t, np.inf)
    rows, cols = np.ogrid[:num_layers, :num_layers]
    rows, cols = rows[:, :, None], cols[:, :, None]
    g_all = np.array([g for _, g in candidates])
    option_all = np.array([option for option, _ in candidates])
    out = []
    for flight in flights:
        need = base[..., None] + slope[..., None] * flight  # (C, L, L, S)
        times = np.where(need <= memory_per_device, seconds[..., None], np.inf)
        best = times.argmin(axis=0)  # (L, L, S): the candidate
        fastest = np.take_along_axis(times, best[None], axis=0)[0]
        found = fastest < np.inf
        g_of = g_all[best]
        peak = spans.update_peak[g_of, rows, cols]
        out.append(
            (
                fastest,
                np.where(found, g_of, -1),
                np.where(found, np.maximum(base[best, rows, cols] + slope[best, rows, cols] * flight, peak), np.inf),
                np.where(found, peak, np.inf),
                np.where(found, option_all[best], KEEP),
                np.where(found, base[best, rows, cols], np.inf),
                np.where(found, slope[best, rows, cols], 0.0),
            )
        )
    return out


def _span_sums(per_layer: np.ndarray) -> np.ndarray:
    """(G, L) → (G, L, L): sum over layers i..j at [g, i, j] (garbage below the diagonal)."""
    prefix = np.concatenate([np.zeros(per_layer.shape[:-1] + (1,)), np.cumsum(per_layer, axis=-1)], axis=-1)
    return prefix[..., None, 1:] - prefix[..., :-1, None]


def _span_maxima(per_layer: np.ndarray) -> np.ndarray:
    """(G, L) → (G, L, L): the largest over layers i..j at [g, i, j] (zero below the diagonal)."""
    out = np.zeros(per_layer.shape + per_layer.shape[-1:])
    for i in range(per_layer.shape[-1]):
        out[..., i, i:] = np.maximum.accumulate(per_layer[..., i:], axis=-1)
    return out


def _inner_pair_sums(pairs: np.ndarray) -> np.ndarray:
    """(G, L, L) strictly upper triangular → (G, L, L): sum of pairs[a, b] over i <= a < b <= j."""
    rows = np.cumsum(np.triu(pairs, k=1), axis=-1)  # [g, a, j] = sum over b <= j
    return np.flip(np.cumsum(np.flip(rows, axis=-2), axis=-2), axis=-2)  # sum over a >= i


def _inputs_by_span(pairs: np.ndarray) -> np.ndarray:
    """(G, L, L) strictly upper triangular → (G, L, L): sum of pairs[a, b] over a < i <= b <= j,
    what layers i..j read from layers before them (a value read by several of them counts
    once per reader)."""
    x = np.triu(np.asarray(pairs, dtype=float), k=1)
    before = np.cumsum(x, axis=-2) - x  # [g, i, b] = sum over a < i of x[g, a, b]
    rows = np.cumsum(before, axis=-1)  # [g, i, j] = sum over b <= j
    diagonal = np.diagonal(rows, offset=-1, axis1=-2, axis2=-1)  # rows[g, i, i-1] for i >= 1
    start = np.concatenate([np.zeros(rows.shape[:-2] + (1,)), diagonal], axis=-1)
    return rows - start[..., :, None]


def values_received_by_span(producers: Sequence[int], readers: Sequence[Sequence[int]], num_layers: int) -> np.ndarray:
    """[i, j]: how many of the values (value k made by layer `producers[k]`, read by the layers
    `readers[k]`) layers i..j read from outside i..j: each once, however many of the span's
    layers read it (the transport moves it once)."""
    counts = np.zeros((num_layers, num_layers))
    i = np.arange(num_layers)[:, None]
    j = np.arange(num_layers)[None, :]
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    for a, rs in zip(producers, readers):
        key = (a, tuple(sorted(set(rs) - {a})))
        if key[1]:
            groups[key] = groups.get(key, 0) + 1
    for (a, rs), count in groups.items():
        # the first reader at or after each i (num_layers: none)
        first = np.full(num_layers + 1, num_layers)
        for r in reversed(rs):
            first[: r + 1] = r
        reads = first[:num_layers, None] <= j
        outside = (a < i) | (a > j)
        counts += count * (reads & outside & (j >= i))
    return counts


def _received_by_span(received_bytes: np.ndarray) -> np.ndarray:
    """[i, j]: bytes that layers i..j read from layers outside i..j."""
    x = np.array(received_bytes, dtype=float)
    np.fill_diagonal(x, 0.0)
    columns = np.concatenate([[0.0], np.cumsum(x.sum(axis=0))])
    into = columns[None, 1:] - columns[:-1, None]  # everything the span's layers read
    prefix = np.zeros((x.shape[0] + 1, x.shape[1] + 1))
    prefix[1:, 1:] = np.cumsum(np.cumsum(x, axis=0), axis=1)
    n = x.shape[0]
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    inside = prefix[j + 1, j + 1] - prefix[i, j + 1] - prefix[j + 1, i] + prefix[i, i]
    return np.where(j >= i, into - inside, 0.0)
