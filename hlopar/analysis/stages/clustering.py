"""Operator clustering: K operators in program order → L layers (Alpa §5.2, Eq. 6).

The stage DP is cubic in the number of units it slices, so operators are first merged into
L layers. Eq. 6 picks the cuts that minimize the largest input a layer receives from earlier
operators, G(K, L), subject to every layer having at most (1+δ)·FLOP_total/L FLOPs; among
clusterings with that minimum, the one with the least variance of per-layer FLOPs (the most
uniform one) wins, and among those the one whose last layers start earliest.

Inputs are plain data. Operators are positions 0..K-1 in topological order. Each value is
`(producer, consumers, bytes)`: the position of the op that makes it, the positions of the ops
that read it (all after the producer) and its size. C(i, k) of Eq. 6 counts a value once for
layer i..k when it is made before i and read by any op in i..k, however many ops read it.
Program inputs (parameters, data) are made by no operator and are not listed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Clustering", "brute_force_clustering", "choose_num_layers", "cluster_operators"]

Value = tuple[int, Sequence[int], int]

_CAP_SLACK = 1e-9  # relative: a layer of exactly the average FLOPs passes despite rounding


@dataclass(frozen=True)
class Clustering:
    """Layer l holds operators boundaries[l] .. boundaries[l+1]-1 (the last runs to the end).

    `layer_input_bytes[l]` is C(boundaries[l], end of l); `delta` the balance slack actually
    used (larger than asked when the asked one admits no clustering)."""

    boundaries: tuple[int, ...]
    num_ops: int
    max_input_bytes: int
    layer_input_bytes: tuple[int, ...]
    layer_flops: tuple[float, ...]
    flop_sum_squares: float
    delta: float

    @property
    def num_layers(self) -> int:
        return len(self.boundaries)

    @property
    def flop_variance(self) -> float:
        """Population variance of per-layer FLOPs (what the tie-break minimizes)."""
        mean = sum(self.layer_flops) / self.num_layers
        return max(self.flop_sum_squares / self.num_layers - mean * mean, 0.0)

    @property
    def layer_of_op(self) -> tuple[int, ...]:
        ends = list(self.boundaries[1:]) + [self.num_ops]
        return tuple(layer for layer, (a, b) in enumerate(zip(self.boundaries, ends)) for _ in range(a, b))


@dataclass(frozen=True)
class _Graph:
    """Validated inputs: FLOP prefix sums and, per consumer k, the C(·, k) increments.

    Reading value v at k adds its bytes to C(i, k) for every i in (previous reader of v, k]
    (or (producer, k] for its first reader): exactly the layers starting there first see v at k."""

    prefix: np.ndarray  # (K+1,) FLOPs of ops 0..k-1 at [k]
    heaviest: float  # the largest FLOPs of one op
    event_offsets: np.ndarray  # events of consumer k: [offsets[k], offsets[k+1])
    event_start: np.ndarray
    event_bytes: np.ndarray

    @property
    def num_ops(self) -> int:
        return len(self.prefix) - 1


def _graph(flops: Sequence[float], values: Sequence[Value]) -> _Graph:
    flop_array = np.asarray(flops, dtype=float)
    if flop_array.ndim != 1 or len(flop_array) == 0:
        raise ValueError("need a non-empty sequence of per-operator FLOPs")
    if not np.all(np.isfinite(flop_array)) or np.any(flop_array < 0):
        raise ValueError("operator FLOPs must be finite and non-negative")
    num_ops = len(flop_array)
    consumer, start, size = [], [], []
    for index, (producer, readers, nbytes) in enumerate(values):
        if not 0 <= producer < num_ops:
            raise ValueError(f"value {index}: producer {producer} is not an operator position (0..{num_ops - 1})")
        if nbytes < 0:
            raise ValueError(f"value {index}: negative size {nbytes}")
        previous = producer
        for reader in sorted(set(readers)):
            if not producer < reader < num_ops:
                raise ValueError(
                    f"value {index}: consumer {reader} must come after its producer {producer} "
                    f"and before {num_ops} (operators are in topological order)"
                )
            consumer.append(reader)
            start.append(previous + 1)
            size.append(nbytes)
            previous = reader
    order = np.argsort(np.asarray(consumer, dtype=np.int64), kind="stable")
    consumer_sorted = np.asarray(consumer, dtype=np.int64)[order]
    return _Graph(
        prefix=np.concatenate([[0.0], np.cumsum(flop_array)]),
        heaviest=float(flop_array.max()),
        event_offsets=np.searchsorted(consumer_sorted, np.arange(num_ops + 1)),
        event_start=np.asarray(start, dtype=np.int64)[order],
        event_bytes=np.asarray(size, dtype=float)[order],
    )


def _flop_cap(graph: _Graph, num_layers: int, delta: float) -> float:
    """Eq. 6's (1+δ)·FLOP_total/L, raised to the heaviest op (which no cut can split)."""
    total = graph.prefix[-1]
    return max((1.0 + delta) * total / num_layers, graph.heaviest) + _CAP_SLACK * total


def _window_starts(graph: _Graph, cap: float) -> np.ndarray:
    """lo[k]: the first i with FLOP(o_i..o_k) <= cap (k+1 when o_k alone exceeds it); nondecreasing."""
    return np.searchsorted(graph.prefix, graph.prefix[1:] - cap, side="left")


def _feasible(lo: np.ndarray, num_layers: int) -> bool:
    """Whether some cut into exactly num_layers non-empty layers meets the cap: the fewest layers
    (greedy, each as long as the cap allows) must be at most num_layers, and ops are splittable."""
    num_ops = len(lo)
    if num_layers > num_ops or np.any(lo > np.arange(num_ops)):
        return False
    needed, end = 0, num_ops - 1
    while end >= 0:
        needed += 1
        end = int(lo[end]) - 1
    return needed <= num_layers


def _relaxed(graph: _Graph, num_layers: int, delta: float) -> tuple[float, float, np.ndarray]:
    """The FLOP cap actually used, as (effective δ, cap, windows under it).

    A user who asks for L layers wants L layers, and δ is a balance wish: an op heavier than
    the cap gets a layer of its own size (the cap rises to it), and when the ops still cannot
    be packed into L layers δ doubles until they can, rather than failing. The loop ends: at
    1+δ >= L the cap exceeds FLOP_total and any cut passes. The effective δ reported is
    cap·L/FLOP_total - 1 (δ itself when the program has no FLOPs)."""
    if delta < 0:
        raise ValueError(f"delta must be non-negative, got {delta}")
    if not 1 <= num_layers <= graph.num_ops:
        raise ValueError(
            f"cannot cluster {graph.num_ops} operators into {num_layers} layers (need 1 <= layers <= operators)"
        )
    total = graph.prefix[-1]
    while True:
        cap = _flop_cap(graph, num_layers, delta)
        lo = _window_starts(graph, cap)
        if _feasible(lo, num_layers):
            effective = (cap - _CAP_SLACK * total) * num_layers / total - 1.0 if total > 0 else delta
            return effective, cap, lo
        delta = max(2.0 * delta, 0.125)


def _input_windows(graph: _Graph, lo: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """(k, lo[k], C(lo[k]..k, k)) for k = 0..K-1, C kept incrementally in one array.

    Only entries i >= lo[k] are ever read again (lo is nondecreasing), so each increment is
    clipped there: the work is the window sizes, not K^2. The yielded array is a view that
    the next step overwrites."""
    inputs = np.zeros(graph.num_ops)
    offsets, starts, sizes = graph.event_offsets, graph.event_start, graph.event_bytes
    for k in range(graph.num_ops):
        low = int(lo[k])
        for e in range(offsets[k], offsets[k + 1]):
            inputs[max(int(starts[e]), low) : k + 1] += sizes[e]
        yield k, low, inputs[low : k + 1]


def _layer_band(graph: _Graph, cap: float, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """For a prefix of n ops, the layer counts r that can still end in a valid clustering:
    r layers must hold its FLOPs (r·cap >= FLOP(prefix)) and the other L-r the rest, with one
    op per layer at least. With δ = 0.5 that is about a third of 1..L: the DPs touch no other.
    Rounded outwards, as a wider band only costs time."""
    n = np.arange(graph.num_ops + 1)
    low = np.maximum(1, num_layers - (graph.num_ops - n))
    high = np.minimum(num_layers, n)
    if cap > 0:
        total = graph.prefix[-1]
        low = np.maximum(low, np.ceil(graph.prefix / cap - 1e-6).astype(np.int64))
        high = np.minimum(high, num_layers - np.ceil((total - graph.prefix) / cap - 1e-6).astype(np.int64))
    return low, high


def _min_max_input(graph: _Graph, lo: np.ndarray, band: tuple[np.ndarray, np.ndarray], num_layers: int) -> float:
    """G(K, L) of Eq. 6 over a table G[r, n]: prefixes of n ops in r layers (rows r, so each
    step reduces contiguous rows)."""
    best = np.full((num_layers + 1, graph.num_ops + 1), np.inf)
    best[0, 0] = 0.0
    low_r, high_r = band
    for k, low, inputs in _input_windows(graph, lo):
        a, b = low_r[k + 1], high_r[k + 1]
        if a <= b:
            best[a : b + 1, k + 1] = np.maximum(best[a - 1 : b, low : k + 1], inputs).min(axis=1)
    return float(best[num_layers, graph.num_ops])


def _min_sum_squares(
    graph: _Graph, lo: np.ndarray, band: tuple[np.ndarray, np.ndarray], num_layers: int, max_input: float
) -> list[int]:
    """The tie-break: least Σ FLOP(layer)^2 over clusterings whose every layer receives at most
    `max_input` (= G(K, L), so exactly the optimal ones); returns the layer starts.

    A second DP rather than lexicographic (G, Σ) pairs in one: a prefix with a larger max input
    but fewer squares can win once the last layer's C dominates, so (G, Σ) has no optimal
    substructure. argmin keeps the first i on ties: the last layer starts earliest."""
    prefix = graph.prefix
    best = np.full((num_layers + 1, graph.num_ops + 1), np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((num_layers + 1, graph.num_ops + 1), dtype=np.int64)
    low_r, high_r = band
    for k, low, inputs in _input_windows(graph, lo):
        a, b = low_r[k + 1], high_r[k + 1]
        if a > b:
            continue
        squares = (prefix[k + 1] - prefix[low : k + 1]) ** 2
        squares[inputs > max_input] = np.inf
        candidates = best[a - 1 : b, low : k + 1] + squares
        pick = candidates.argmin(axis=1)
        best[a : b + 1, k + 1] = candidates[np.arange(b - a + 1), pick]
        choice[a : b + 1, k + 1] = low + pick
    starts, end = [], graph.num_ops
    for layers in range(num_layers, 0, -1):
        end = int(choice[layers, end])
        starts.append(end)
    return starts[::-1]


def _layer_inputs(graph: _Graph, starts: Sequence[int]) -> list[int]:
    """C(start, end) of each layer from the increments: a value enters layer [a, b) through its
    first reader there, the one increment with k in [a, b) whose range reaches back to a."""
    ends = list(starts[1:]) + [graph.num_ops]
    out = []
    for start, end in zip(starts, ends):
        low, high = graph.event_offsets[start], graph.event_offsets[end]
        entering = graph.event_start[low:high] <= start
        out.append(int(graph.event_bytes[low:high][entering].sum()))
    return out


def _layer_inputs_by_definition(graph: _Graph, values: Sequence[Value], starts: Sequence[int]) -> list[int]:
    """C(start, end) of each layer, straight from the definition (for the brute force)."""
    ends = list(starts[1:]) + [graph.num_ops]
    out = []
    for start, end in zip(starts, ends):
        out.append(
            sum(
                int(nbytes)
                for producer, readers, nbytes in values
                if producer < start and any(start <= r < end for r in readers)
            )
        )
    return out


def _result(graph: _Graph, starts: Sequence[int], inputs: Sequence[int], delta: float) -> Clustering:
    ends = list(starts[1:]) + [graph.num_ops]
    layer_flops = tuple(float(graph.prefix[b] - graph.prefix[a]) for a, b in zip(starts, ends))
    return Clustering(
        boundaries=tuple(int(s) for s in starts),
        num_ops=graph.num_ops,
        max_input_bytes=max(inputs),
        layer_input_bytes=tuple(inputs),
        layer_flops=layer_flops,
        flop_sum_squares=float(sum(f * f for f in layer_flops)),
        delta=float(delta),
    )


def cluster_operators(
    flops: Sequence[float], values: Sequence[Value], num_layers: int, delta: float = 0.5
) -> Clustering:
    """The Eq. 6 clustering of ops 0..K-1 into `num_layers` layers (see the module docstring).

    Two O(K·W·L) sweeps, W the widest FLOP window: the min-max DP for G(K, L), then the
    least-variance DP restricted to layers whose input is at most G(K, L). When no cut meets
    the FLOP bound the bound is relaxed (`_relaxed`) and `Clustering.delta` says to what."""
    graph = _graph(flops, values)
    delta, cap, lo = _relaxed(graph, num_layers, delta)
    band = _layer_band(graph, cap, num_layers)
    max_input = _min_max_input(graph, lo, band, num_layers)
    starts = _min_sum_squares(graph, lo, band, num_layers, max_input)
    return _result(graph, starts, _layer_inputs(graph, starts), delta)


def brute_force_clustering(
    flops: Sequence[float], values: Sequence[Value], num_layers: int, delta: float = 0.5
) -> Clustering:
    """Every cut, scored from the definitions (for tests on small K): least (max input,
    Σ FLOP^2, starts of the last layers first), with δ relaxed as `cluster_operators` does."""
    graph = _graph(flops, values)
    delta, cap, _ = _relaxed(graph, num_layers, delta)
    prefix = graph.prefix
    best_key, best = None, None
    for cuts in itertools.combinations(range(1, graph.num_ops), num_layers - 1):
        starts = (0,) + cuts
        ends = cuts + (graph.num_ops,)
        if any(prefix[a] < prefix[b] - cap for a, b in zip(starts, ends)):
            continue
        layer_flops = [float(prefix[b] - prefix[a]) for a, b in zip(starts, ends)]
        inputs = _layer_inputs_by_definition(graph, values, starts)
        key = (max(inputs), sum(f * f for f in layer_flops), starts[::-1])
        if best_key is None or key < best_key:
            best_key, best = key, (starts, inputs)
    return _result(graph, best[0], best[1], delta)


def choose_num_layers(
    flops: Sequence[float],
    values: Sequence[Value],
    *,
    max_layers: int,
    heavy: Sequence[bool],
    tolerance: float = 0.5,
    delta: float = 0.5,
) -> int:
    """L for `layers=auto`: as many layers as the program can be cut into cheaply.

    Alpa picks a small L "based on the number of devices and the number of heavy operators"
    (§5.2). Here L is at most `max_layers` (the caller's bound from devices and DP cost) and
    at most one layer per heavy op (more would only split cheap ops); within that, the largest
    L whose best balanced set of L-1 cuts is within (1+tolerance) of the best balanced single
    cut. A cut is scored by the bytes live across it (made before, read after: an upper bound
    of the C of the layer it starts), which makes the test a bisection per L over O(K) greedy
    checks instead of a DP. Past a model's natural block boundaries the cuts must fall inside
    blocks and the score jumps (a transformer's residual stream is cheap to cut, its attention
    scores are not), so L stays at the block granularity when the blocks are many. No heavy
    op: 1 layer (nothing to balance). Callers that know the repeated blocks may override."""
    graph = _graph(flops, values)
    if len(heavy) != graph.num_ops:
        raise ValueError(f"heavy has {len(heavy)} entries for {graph.num_ops} operators")
    if max_layers < 1:
        raise ValueError(f"max_layers must be positive, got {max_layers}")
    upper = min(max_layers, sum(bool(h) for h in heavy), graph.num_ops)
    if upper <= 2:
        return max(upper, 1)
    live = _live_bytes(graph)
    limit = (1.0 + tolerance) * _best_cut_score(graph, live, 2, delta)
    for num_layers in range(upper, 2, -1):
        if _best_cut_score(graph, live, num_layers, delta) <= limit:
            return num_layers
    return 2


def _live_bytes(graph: _Graph) -> np.ndarray:
    """live[j], 1 <= j < K: bytes of the values made before op j and read at j or later.

    From the increments: a value is live across cut j iff one of its reads has its range
    [start, k] over j, and those ranges of one value are disjoint."""
    change = np.zeros(graph.num_ops + 1)
    consumers = np.repeat(np.arange(graph.num_ops), np.diff(graph.event_offsets))
    np.add.at(change, graph.event_start, graph.event_bytes)
    np.add.at(change, consumers + 1, -graph.event_bytes)
    return np.cumsum(change)[: graph.num_ops]


def _best_cut_score(graph: _Graph, live: np.ndarray, num_layers: int, delta: float) -> float:
    """The least t such that L-1 cuts, each with live bytes <= t, split the ops into layers
    within the FLOP cap of Eq. 6 (δ relaxed as in `cluster_operators`); bisection over t."""
    _, _, lo = _relaxed(graph, num_layers, delta)
    scores = np.unique(live[1:])
    low, high = 0, len(scores) - 1
    while low < high:
        middle = (low + high) // 2
        if _cuttable(lo, np.flatnonzero(live <= scores[middle]), num_layers):
            high = middle
        else:
            low = middle + 1
    return float(scores[low])


def _cuttable(lo: np.ndarray, allowed: np.ndarray, num_layers: int) -> bool:
    """Whether exactly num_layers layers fit the windows `lo` using only cuts in `allowed`
    (sorted positions; 0 may be among them and is ignored). The fewest layers come from the
    greedy (each layer reaching back as far as the cap lets it); adding allowed cuts one by
    one keeps every layer under the cap, so every count up to len(cuts)+1 is reachable too."""
    cuts = allowed[allowed > 0]
    if len(cuts) + 1 < num_layers:
        return False
    end, layers = len(lo), 0
    while True:
        layers += 1
        first = int(lo[end - 1])
        if first == 0:
            return layers <= num_layers
        position = int(np.searchsorted(cuts, first))
        if position == len(cuts) or cuts[position] >= end or layers >= num_layers:
            return False
        end = int(cuts[position])
