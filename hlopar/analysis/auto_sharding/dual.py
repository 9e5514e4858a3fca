"""A lower bound on Eq. 1 by min-sum diffusion, and the strategies it proves useless.

Eq. 1 without the memory constraint is MAP inference in a pairwise model: node costs
`theta_v(i)`, edge costs `theta_uv(i, j)`. Moving any vector `phi(i)` from an edge into one of
its nodes (`theta_uv -= phi[:, None]`, `theta_u += phi`) changes no plan's cost; such a
*reparametrization* gives the lower bound `sum_v min theta_v + sum_uv min theta_uv`, and
maximizing it over reparametrizations is the dual of the LP relaxation of Alpa's linearized
ILP. Min-sum diffusion (Kovalevsky and Koval; see Werner, "A linear programming approach to
max-sum problem: a review", TPAMI 2007) climbs it by visiting nodes in turn and spreading
each node's cost evenly over the node and the min-marginals of its edges. On sharding
problems that LP is usually tight, so the bound meets the best plan after a few dozen sweeps.

The bound then fixes strategies exactly (reduced-cost fixing): with `LB` the bound and `UB` the
cost of a plan that fits the memory budget, every plan that picks `i` at `v` costs at least
`LB + rc_v(i)`, where `rc_v(i) = theta_v(i) + sum_uv min_j theta_uv(i, j)` minus the same
terms' minima. A strategy with `LB + rc_v(i) > UB` is never in a plan better than the one in
hand, so it can go. The memory constraint only removes plans, so `LB` stays a bound under it.

Everything works in place on the dicts of `merging.Reduced` (costs per group, edge matrices
keyed `(a, b)` with `a < b`, rows indexed by `a`'s strategies): a reparametrization is one
more exact rewrite of the problem, like moving row minima into a node.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["diffuse", "lower_bound", "decode", "reduced_costs", "energy"]

Costs = dict[int, np.ndarray]
Edges = dict[tuple[int, int], np.ndarray]


def _incidence(order: Sequence[int], edges: Edges) -> dict[int, list[tuple[np.ndarray, int]]]:
    """Per node, its edge matrices with the axis that indexes the *other* node."""
    incident: dict[int, list[tuple[np.ndarray, int]]] = {g: [] for g in order}
    for (a, b), matrix in edges.items():
        incident[a].append((matrix, 1))
        incident[b].append((matrix, 0))
    return incident


def diffuse(order: Sequence[int], costs: Costs, edges: Edges, sweeps: int) -> None:
    """`sweeps` forward-and-backward passes of min-sum diffusion over `order`, in place.

    The bound never decreases. Sweeping in program order and back carries information along
    the chain of layers in one pass, which is what makes a few dozen sweeps enough.
    """
    incident = _incidence(order, edges)
    for _ in range(sweeps):
        for sequence in (order, order[::-1]):
            for g in sequence:
                adjacent = incident[g]
                if not adjacent:
                    continue
                mins = [matrix.min(axis=axis) for matrix, axis in adjacent]
                share = (costs[g] + sum(mins)) / (len(adjacent) + 1)
                for (matrix, axis), low in zip(adjacent, mins):
                    if axis == 1:
                        matrix -= (low - share)[:, None]
                    else:
                        matrix -= (low - share)[None, :]
                costs[g] = share


def lower_bound(costs: Costs, edges: Edges) -> float:
    """No plan of the current representation costs less than this."""
    return float(sum(float(c.min()) for c in costs.values()) + sum(float(m.min()) for m in edges.values()))


def energy(costs: Costs, edges: Edges, choice: dict[int, int]) -> float:
    """The cost of a plan given by local strategy indices."""
    total = sum(float(costs[g][i]) for g, i in choice.items())
    return total + sum(float(m[choice[a], choice[b]]) for (a, b), m in edges.items())


def decode(order: Sequence[int], costs: Costs, edges: Edges, rounds: int = 4) -> dict[int, int]:
    """A good plan (local indices): each node in order takes its best strategy given the
    choices already made and the best case of the rest, then a few rounds of coordinate
    descent (each node re-picks given all others) polish it."""
    incident: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in order}
    for (a, b), matrix in edges.items():
        incident[a].append((b, matrix))
        incident[b].append((a, matrix.T))
    choice: dict[int, int] = {}
    for g in order:
        local = costs[g].copy()
        for n, matrix in incident[g]:
            local += matrix[:, choice[n]] if n in choice else matrix.min(axis=1)
        choice[g] = int(np.argmin(local))
    for _ in range(rounds):
        changed = False
        for g in order:
            local = costs[g].copy()
            for n, matrix in incident[g]:
                local += matrix[:, choice[n]]
            best = int(np.argmin(local))
            if local[best] < local[choice[g]]:
                choice[g] = best
                changed = True
        if not changed:
            break
    return choice


def reduced_costs(order: Sequence[int], costs: Costs, edges: Edges) -> dict[int, np.ndarray]:
    """`rc_v(i)`: how much above the lower bound any plan choosing `i` at `v` must be."""
    result = {}
    incident = _incidence(order, edges)
    for g in order:
        local = costs[g].copy()
        base = float(local.min())
        for matrix, axis in incident[g]:
            local += matrix.min(axis=axis)
            base += float(matrix.min())
        result[g] = local - base
    return result
