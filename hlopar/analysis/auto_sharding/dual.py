"""A lower bound on Eq. 1 by message passing, and the strategies it proves useless.

Eq. 1 without the memory constraint is MAP inference in a pairwise model: node costs
`theta_v(i)`, edge costs `theta_uv(i, j)`. Moving any vector `phi(i)` from an edge into one of
its nodes (`theta_uv -= phi[:, None]`, `theta_u += phi`) changes no plan's cost; such a
*reparametrization* gives the lower bound `sum_v min theta_v + sum_uv min theta_uv`, and
maximizing it over reparametrizations is the dual of the LP relaxation of Alpa's linearized
ILP. Sequential tree-reweighted message passing (`trws`) climbs it fast; a sweep of min-sum
diffusion (`diffuse`: Kovalevsky and Koval, see Werner, "A linear programming approach to
max-sum problem: a review", TPAMI 2007, which spreads each node's cost evenly over the node
and the min-marginals of its edges) then puts the result in the form where the sum of minima
is the bound. On sharding problems that LP is usually tight, so the bound meets the best plan
after a few dozen sweeps.

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

__all__ = ["diffuse", "trws", "lower_bound", "decode", "reduced_costs", "energy"]

Costs = dict[int, np.ndarray]
Edges = dict[tuple[int, int], np.ndarray]


def _incidence(order: Sequence[int], edges: Edges) -> dict[int, list[np.ndarray]]:
    """Per node, its edge matrices as views with the node's strategies along the rows."""
    incident: dict[int, list[np.ndarray]] = {g: [] for g in order}
    for (a, b), matrix in edges.items():
        incident[a].append(matrix)
        incident[b].append(matrix.T)
    return incident


def diffuse(order: Sequence[int], costs: Costs, edges: Edges, sweeps: int) -> None:
    """`sweeps` forward-and-backward passes of min-sum diffusion over `order`, in place.

    The bound never decreases. Sweeping in program order and back carries information along
    the chain of layers in one pass, which is what makes a few dozen sweeps enough. (The loop
    is written for speed: numpy's ufuncs directly, in-place updates of the shared matrices.)
    """
    incident = _incidence(order, edges)
    plan = [(g, incident[g], 1.0 / (len(incident[g]) + 1)) for g in order if incident[g]]
    minimum = np.minimum.reduce
    for _ in range(sweeps):
        for sequence in (plan, plan[::-1]):
            for g, adjacent, weight in sequence:
                mins = [minimum(matrix, 1) for matrix in adjacent]
                share = costs[g] + mins[0]
                for low in mins[1:]:
                    share += low
                share *= weight
                for matrix, low in zip(adjacent, mins):
                    low -= share
                    matrix -= low[:, None]
                costs[g] = share


def trws(order: Sequence[int], costs: Costs, edges: Edges, sweeps: int) -> None:
    """`sweeps` forward-and-backward passes of sequential tree-reweighted message passing
    (TRW-S; Kolmogorov, "Convergent tree-reweighted message passing for energy minimization",
    TPAMI 2006), folded back into the representation in place.

    It climbs the same dual as diffusion, about twice as fast per sweep on layer chains, but
    its bound lives in the messages rather than in `lower_bound` of the result: end with a
    diffusion sweep, which moves the result to where the sum of minima is the bound.
    """
    rank = {g: r for r, g in enumerate(order)}
    incident: dict[int, list[tuple[int, np.ndarray]]] = {g: [] for g in order}
    for (a, b), matrix in edges.items():
        incident[a].append((b, matrix))
        incident[b].append((a, matrix.T))
    # messages[(g, w)]: what g sends w, over w's strategies.
    messages = {(g, w): np.zeros(len(costs[w])) for g in order for w, _ in incident[g]}
    weight = {}
    for g in order:
        later = sum(rank[w] > rank[g] for w, _ in incident[g])
        weight[g] = 1.0 / max(later, len(incident[g]) - later, 1)
    minimum = np.minimum.reduce
    for _ in range(sweeps):
        for forward, sequence in ((True, order), (False, order[::-1])):
            for g in sequence:
                adjacent = incident[g]
                if not adjacent:
                    continue
                total = costs[g].copy()
                for w, _ in adjacent:
                    total += messages[(w, g)]
                total *= weight[g]
                for w, matrix in adjacent:
                    if (rank[w] > rank[g]) == forward:
                        out = minimum((total - messages[(w, g)])[:, None] + matrix, 0)
                        out -= out.min()
                        messages[(g, w)] = out
    for g in order:
        for w, _ in incident[g]:
            costs[g] = costs[g] + messages[(w, g)]
    for (a, b), matrix in edges.items():
        matrix -= messages[(b, a)][:, None]
        matrix -= messages[(a, b)][None, :]


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
        for matrix in incident[g]:
            local += matrix.min(axis=1)
            base += float(matrix.min())
        result[g] = local - base
    return result
