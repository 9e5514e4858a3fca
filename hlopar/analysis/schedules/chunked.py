"""Per-mesh task orders of schedules that run several stages (chunks) on each mesh.

Interleaved 1F1B (Narayanan et al., SC'21, §2.2): p meshes, v chunks each, stage c p + j on
mesh j. Forwards go in groups of p microbatches through chunk 0, then the same group through
chunk 1, ..., then the next group; backwards likewise from chunk v-1 down. Mesh j warms up
with 2 (p - j - 1) + (v - 1) p + 1 forwards, then alternates a backward and a forward. Each
chunk holds 1/v of a stage's layers, so the warm-up and cool-down cost 1/v as much: the
bubble is (p - 1) / (v m) of the compute against 1F1B's (p - 1) / m. The groups need m
divisible by p (v > 1). With v = 1 the order is eager-1F1B's.

ZB-V (Qi et al., ICLR 2024, §4): p meshes, 2 chunks each placed as a V (stage j and stage
2p - 1 - j on mesh j), backwards split into B and W. The order is found by running F, B and
W of one unit each on a clock (no transfer time): at each tick each mesh runs a ready B
(chunk 1 first: the B of the later stage feeds the other chunk's), else a ready F (chunk 1
first) while fewer than 2p of its chunk forwards wait for their B and fewer than 4p for
their W, else the W of its oldest B. 2p chunk forwards in flight are p stages' worth:
1F1B's first stage's (Eq. 5); a stash kept until its W (hlopar keeps it whole) is held by up
to 4p, twice that, where the paper counts the smaller part W reads. With F, B and W of equal
time and B >= 2p, every mesh then works without a gap from its first task to its last
(checked for p <= 12 and B up to 6p + 1; the tests check it on the simulator): the step has
the bubble only of the meshes' staggered starts, p - 1 units of 6B, which back-to-back steps
without a barrier overlap (`SimResult.steady_period`).
"""

from __future__ import annotations

import functools

from hlopar.analysis.schedules.tasks import BACKWARD, FORWARD, V_SHAPE, WEIGHT, Task, stage_placement

__all__ = ["interleaved_order", "zero_bubble_v_order"]


def interleaved_order(num_meshes: int, chunks: int, mesh: int, num_microbatches: int) -> list[Task]:
    """Mesh `mesh`'s tasks under interleaved 1F1B (module docstring)."""
    p, v, m = num_meshes, chunks, num_microbatches
    if v > 1 and m % p:
        raise ValueError(
            f"interleaved-1f1b with {v} chunks per mesh runs microbatches in groups of the {p} meshes: "
            f"{m} microbatches is not a multiple of {p}"
        )
    total = m * v

    def task(kind: str, k: int) -> Task:
        chunk = (k // p) % v
        return Task(kind, (k // (p * v)) * p + k % p, v - 1 - chunk if kind == BACKWARD else chunk)

    warmup = min(total, 2 * (p - mesh - 1) + (v - 1) * p + 1)
    order = [task(FORWARD, k) for k in range(warmup)]
    for k in range(total):
        order.append(task(BACKWARD, k))
        if warmup + k < total:
            order.append(task(FORWARD, warmup + k))
    return order


def zero_bubble_v_order(num_meshes: int, chunks: int, mesh: int, num_microbatches: int) -> list[Task]:
    """Mesh `mesh`'s tasks under ZB-V (module docstring)."""
    return list(_zero_bubble_v(num_meshes, num_microbatches)[mesh])


@functools.lru_cache(maxsize=64)
def _zero_bubble_v(num_meshes: int, num_microbatches: int) -> tuple[tuple[Task, ...], ...]:
    """Every mesh's ZB-V order, from the unit-time run of the module docstring."""
    p, m = num_meshes, num_microbatches
    num_stages = 2 * p
    mesh_of = stage_placement(V_SHAPE, p, 2)
    stages_of = [sorted(s for s in range(num_stages) if mesh_of[s] == j) for j in range(p)]  # [chunk 0, chunk 1]
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> tick it ends
    next_of = {(kind, s): 0 for kind in (FORWARD, BACKWARD, WEIGHT) for s in range(num_stages)}
    in_flight, stashed = [0] * p, [0] * p  # per mesh: chunk forwards whose B, whose W has not run
    orders: list[list[Task]] = [[] for _ in range(p)]
    remaining, tick = 3 * num_stages * m, 0

    def ready(kind: str, s: int) -> bool:
        mb = next_of[kind, s]
        if mb >= m:
            return False
        if kind == FORWARD:
            deps = [(FORWARD, s - 1, mb)] if s > 0 else []
        elif kind == BACKWARD:
            deps = [(FORWARD, s, mb)] + ([(BACKWARD, s + 1, mb)] if s < num_stages - 1 else [])
        else:
            deps = [(BACKWARD, s, mb)]
        return all(finished.get(d, tick + 1) <= tick for d in deps)

    while remaining:
        picks = []
        for j in range(p):
            later_first = stages_of[j][::-1]
            pick = next(((BACKWARD, s) for s in later_first if ready(BACKWARD, s)), None)
            if pick is None and in_flight[j] < num_stages and stashed[j] < 2 * num_stages:
                pick = next(((FORWARD, s) for s in later_first if ready(FORWARD, s)), None)
            weights = [s for s in stages_of[j] if ready(WEIGHT, s)]
            if pick is None and weights:  # the oldest B's W
                pick = (WEIGHT, min(weights, key=lambda s: (finished[BACKWARD, s, next_of[WEIGHT, s]], -s)))
            if pick is not None:
                picks.append((j, pick))
        for j, (kind, s) in picks:
            mb = next_of[kind, s]
            next_of[kind, s] += 1
            finished[kind, s, mb] = tick + 1
            orders[j].append(Task(kind, mb, stages_of[j].index(s)))
            in_flight[j] += {FORWARD: 1, BACKWARD: -1}.get(kind, 0)
            stashed[j] += {FORWARD: 1, WEIGHT: -1}.get(kind, 0)
            remaining -= 1
        tick += 1
    return tuple(tuple(order) for order in orders)
