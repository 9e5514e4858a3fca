"""Shrinking the auto-sharding ILP before CP-SAT sees it, without changing its optimum.

`reduce_problem`: exact simplifications of Eq. 1 over a factor graph (a node per group of
nodes that `follows` ties to one choice, an edge per pair of groups with a nonzero
resharding matrix). Each step keeps the optimum of the problem it is given: a plan of the
smaller problem is expanded into a plan of the whole at the same cost, and no plan of the
whole is cheaper. (Alpa's merging of cheap ops into an operand, `graph_problem`'s
`merge=True`, is no such step: it removes plans that can be the cheapest.) The steps:

  * followers are collapsed into their leader (costs added, edges re-targeted, an edge between a
    follower and its own leader becomes its diagonal, added to the node's costs);
  * edges between the same pair of groups are added into one matrix;
  * every edge matrix is reparametrized: its row minima move into the source's costs and its
    column minima into the destination's; a matrix that becomes all-zero (every additive one)
    is dropped;
  * strategies that the memory budget alone rules out are removed, and live sets that can never
    exceed the budget are dropped;
  * a strategy `a` of a node is removed when another strategy `b` is never worse:
    `cost[b] - cost[a] + sum over incident edges of max_j (M[b, j] - M[a, j]) <= 0` and
    `b` uses no more memory in any live set. Switching any plan from `a` to `b` then costs
    nothing more and stays feasible, so the optimum over the remaining strategies is unchanged;
  * a node outside every live set with at most two neighbours is eliminated by dynamic
    programming: a leaf adds `min_i (cost[i] + M[i, j])` to its neighbour, a node between two
    neighbours becomes the edge `N[j, k] = min_i (cost[i] + A[i, j] + B[i, k])`; the argmin
    tables bring its choice back after the solve. Nodes with one strategy left are constants.
    The dominance check comes first even where the fold alone would do (it only shrinks a
    domain the fold minimizes over): the order decides which of equally cheap strategies the
    fold keeps, and stage construction composes its layers' plans by their boundary layouts,
    so a tie broken otherwise is a different pipeline. Folding first (a third fewer checks on
    GPT-1.3B) moved the tiny MLP on 2x4 with cross-host links as fast as a host's from one
    mesh (predicted 21.1 us per step) to two (31.2 us): the layers' optima were equal, their
    layouts no longer met;
  * then rounds of reduced-cost fixing (`dual.py`): a lower bound from message passing on the
    LP dual (with the live sets that can bind priced in, Lagrangian style), a plan that fits as
    upper bound, and every strategy that the bound proves worse than that plan goes, after
    which the steps above run again on what is left.

  What remains (the core) is what CP-SAT has to decide. On transformer-like graphs the LP
  relaxation is tight, the bound meets the plan, and the core is usually empty: the
  optimum is then proven without a search.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hlopar.analysis.auto_sharding.dual import decode, diffuse, energy, lower_bound, reduced_costs, trws
from hlopar.analysis.auto_sharding.problem import Problem

__all__ = ["reduce_problem", "Reduced", "Infeasible", "Simplify"]


@dataclass(frozen=True)
class Simplify:
    """Which simplifications `reduce_problem` applies (all by default; tests turn them off one
    by one to check that each keeps the optimum). Collapsing followers and adding parallel
    edges always happen: the model is built over groups."""

    normalize_edges: bool = True  # reparametrize matrices, drop additive ones
    memory: bool = True  # drop strategies that cannot fit, and live sets that cannot bind
    dominance: bool = True  # drop dominated strategies
    eliminate: bool = True  # one-strategy nodes and nodes of degree <= 2 folded away
    bound: bool = True  # reduced-cost fixing with a message-passing bound (`dual.py`)
    sweeps: int = 6  # message-passing sweeps between two rounds of fixing
    rounds: int = 8  # rounds of fixing at most


class Infeasible(Exception):
    """No choice of strategies satisfies the fixed strategies and the memory budget."""


@dataclass
class _Live:
    """One live set over groups: sum of vec[g][choice of g] + const <= budget."""

    vecs: dict[int, np.ndarray]
    const: float
    active: bool = True


@dataclass
class Reduced:
    """The core left for the ILP, and how to bring the eliminated nodes' choices back.

    `domains[g]` lists the original strategy indices still allowed for group `g` (its leader's
    node index), and `costs[g]`, the edge matrices and live-set vectors are indexed like it.
    """

    leader: list[int]
    domains: dict[int, np.ndarray]
    costs: dict[int, np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    lives: list[_Live]
    budget: float | None
    constant: float
    steps: list[tuple] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    incumbent: dict[int, int] = field(default_factory=dict)  # best plan seen (original indices)
    lower_bound: float = -np.inf  # on the whole objective, from the dual (when computed)

    def expand(self, core_choice: dict[int, int]) -> tuple[int, ...]:
        """Original strategy per node from the choice (original index) of each core group."""
        chosen = dict(core_choice)
        for step in reversed(self.steps):
            kind, g = step[0], step[1]
            if kind == "fixed":
                chosen[g] = step[2]
            elif kind == "leaf":
                _, _, n, table = step
                chosen[g] = table[chosen[n]]
            else:  # "series"
                _, _, n1, n2, table = step
                chosen[g] = table[chosen[n1], chosen[n2]]
        return tuple(int(chosen[self.leader[v]]) for v in range(len(self.leader)))


def _leaders(problem: Problem) -> list[int]:
    """The root of every node's `follows` chain; rejects cycles and count mismatches."""
    nodes = problem.nodes
    leader = [-1] * len(nodes)
    for v in range(len(nodes)):
        path = []
        u = v
        while leader[u] < 0 and nodes[u].follows is not None:
            if u in path:
                raise ValueError(f"node {v}: `follows` chain has a cycle through node {u}")
            path.append(u)
            u = nodes[u].follows
            if not 0 <= u < len(nodes):
                raise ValueError(f"node {path[-1]}: follows unknown node {u}")
            if len(nodes[u].costs) != len(nodes[path[-1]].costs):
                raise ValueError(
                    f"node {path[-1]} ({len(nodes[path[-1]].costs)} strategies) follows node {u} "
                    f"({len(nodes[u].costs)} strategies): counts must match"
                )
        root = u if leader[u] < 0 else leader[u]
        for w in path + [u]:
            leader[w] = root
    return leader


def _matrices(problem: Problem) -> list[np.ndarray]:
    """Every edge's matrix as an array, checked against its nodes' strategy counts. The pass
    shares one matrix object between the many edges with the same shapes and layouts, so
    each object is converted once (on GPT-1.3B, 1.5k conversions instead of 17k)."""
    converted: dict[int, np.ndarray] = {}
    result = []
    for e, edge in enumerate(problem.edges):
        shape = (len(problem.nodes[edge.src].costs), len(problem.nodes[edge.dst].costs))
        matrix = converted.get(id(edge.costs))
        if matrix is None:
            try:
                matrix = np.asarray(edge.costs, dtype=np.float64)
            except ValueError:
                matrix = np.zeros(0)
            converted[id(edge.costs)] = matrix
        if matrix.shape != shape:
            raise ValueError(f"edge {e} ({edge.src} -> {edge.dst}): cost matrix is not {shape[0]}x{shape[1]}")
        result.append(matrix)
    return result


def _validate(problem: Problem) -> None:
    for v, node in enumerate(problem.nodes):
        k = len(node.costs)
        if k == 0:
            raise ValueError(f"node {v} ({node.name}) has no strategy")
        if node.memory and len(node.memory) != k:
            raise ValueError(f"node {v} ({node.name}): {len(node.memory)} memory values for {k} strategies")
        if node.fixed is not None and not 0 <= node.fixed < k:
            raise ValueError(f"node {v} ({node.name}): fixed strategy {node.fixed} out of range")
    n = len(problem.nodes)
    for e, edge in enumerate(problem.edges):
        if not (0 <= edge.src < n and 0 <= edge.dst < n):
            raise ValueError(f"edge {e}: node out of range ({edge.src} -> {edge.dst})")
    for s, live in enumerate(problem.live_sets):
        if any(not 0 <= v < n for v in live):
            raise ValueError(f"live set {s}: node out of range")


class _Reducer:
    """The worklist that applies the simplifications of this module's docstring to a fixpoint."""

    def __init__(self, problem: Problem, options: Simplify):
        _validate(problem)
        self.options = options
        self.leader = _leaders(problem)
        self.nbrs: dict[int, set[int]] = {}
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.costs: dict[int, np.ndarray] = {}
        self.domains: dict[int, np.ndarray] = {}
        self.constant = 0.0
        self.steps: list[tuple] = []
        self.stats = {"strategies_removed": 0, "eliminated": 0, "constants": 0, "fixed_by_bound": 0, "sweeps": 0}
        self.incumbent: dict[int, int] = {}
        self.lower_bound = -np.inf
        self.budget = problem.memory_budget
        self.group_queue: deque[int] = deque()
        self.live_queue: deque[int] = deque()
        self.queued_groups: set[int] = set()
        self.queued_lives: set[int] = set()
        # Groups whose dominance check may find something new: the criterion is unchanged by
        # reparametrization, so only a neighbour losing strategies, an edge added, a folded
        # neighbour or a live set let go calls for another look.
        self.dirty: set[int] = set()

        fixed: dict[int, int] = {}
        converted: dict[int, np.ndarray] = {}  # nodes share cost tuples, as edges share matrices
        for v, node in enumerate(problem.nodes):
            g = self.leader[v]
            cost = converted.get(id(node.costs))
            if cost is None:
                cost = converted[id(node.costs)] = np.asarray(node.costs, dtype=np.float64)
            if g in self.costs:
                self.costs[g] = self.costs[g] + cost
            else:
                self.costs[g] = cost.copy()
                self.domains[g] = np.arange(len(cost))
                self.nbrs[g] = set()
            if node.fixed is not None:
                if fixed.setdefault(g, node.fixed) != node.fixed:
                    raise Infeasible(
                        f"node {v} ({node.name}) is fixed to strategy {node.fixed} but follows a node "
                        f"fixed to strategy {fixed[g]}"
                    )
        for edge, matrix in zip(problem.edges, _matrices(problem)):
            a, b = self.leader[edge.src], self.leader[edge.dst]
            if a == b:
                self.costs[a] = self.costs[a] + np.diagonal(matrix)
            else:
                self._add_edge(a, b, matrix, normalize=False)
        self.stats["nodes_merged"] = len(self.costs)
        self.stats["edges_merged"] = len(self.edges)

        self.lives: list[_Live] = []
        self.lives_of: dict[int, set[int]] = {g: set() for g in self.costs}
        if self.budget is not None:
            for members in problem.live_sets:
                vecs: dict[int, np.ndarray] = {}
                for v in sorted(set(members)):
                    memory = problem.nodes[v].memory
                    if memory:
                        g = self.leader[v]
                        vec = np.asarray(memory, dtype=np.float64)
                        vecs[g] = vecs[g] + vec if g in vecs else vec
                c = len(self.lives)
                self.lives.append(_Live(vecs, 0.0))
                for g in vecs:
                    self.lives_of[g].add(c)
                self._queue_live(c)

        for g, choice in fixed.items():
            self._restrict(g, self.domains[g] == choice)
        if options.normalize_edges:
            for key in list(self.edges):
                if key in self.edges:
                    self._normalize(*key)
        for g in self.costs:
            self._queue_group(g)
        self.dirty.update(self.costs)

    # -- bookkeeping -------------------------------------------------------------------------

    def _queue_group(self, g: int) -> None:
        if g not in self.queued_groups:
            self.queued_groups.add(g)
            self.group_queue.append(g)

    def _queue_live(self, c: int) -> None:
        if c not in self.queued_lives:
            self.queued_lives.add(c)
            self.live_queue.append(c)

    def _matrix(self, a: int, b: int) -> np.ndarray:
        """The edge between a and b, rows indexed by a's strategies."""
        return self.edges[(a, b)] if a < b else self.edges[(b, a)].T

    def _drop_edge(self, a: int, b: int) -> None:
        del self.edges[(min(a, b), max(a, b))]
        self.nbrs[a].discard(b)
        self.nbrs[b].discard(a)
        self._queue_group(a)
        self._queue_group(b)

    def _add_edge(self, a: int, b: int, matrix: np.ndarray, normalize: bool = True) -> None:
        """Adds `matrix` (rows: a) to the edge a-b, creating it if needed."""
        if a > b:
            a, b, matrix = b, a, matrix.T
        if (a, b) in self.edges:
            self.edges[(a, b)] = self.edges[(a, b)] + matrix
        else:
            self.edges[(a, b)] = np.array(matrix, dtype=np.float64)
            self.nbrs[a].add(b)
            self.nbrs[b].add(a)
        self.dirty.update((a, b))
        if normalize and self.options.normalize_edges:
            self._normalize(a, b)

    def _normalize(self, a: int, b: int) -> None:
        """Moves row minima into a's costs and column minima into b's; drops a zero matrix."""
        matrix = self.edges[(a, b)]
        rows = np.minimum.reduce(matrix, axis=1)
        matrix = matrix - rows[:, None]
        cols = np.minimum.reduce(matrix, axis=0)
        matrix = matrix - cols[None, :]
        self.costs[a] = self.costs[a] + rows
        self.costs[b] = self.costs[b] + cols
        if not matrix.any():
            self._drop_edge(a, b)
        else:
            self.edges[(a, b)] = matrix
            self._queue_group(a)
            self._queue_group(b)

    def _restrict(self, g: int, keep: np.ndarray) -> None:
        """Keeps only the strategies of g where `keep` is true."""
        if keep.all():
            return
        if not keep.any():
            raise Infeasible(f"node {g}: no strategy is left that fits the memory budget")
        self.stats["strategies_removed"] += int((~keep).sum())
        self.domains[g] = self.domains[g][keep]
        self.costs[g] = self.costs[g][keep]
        for n in sorted(self.nbrs[g]):
            key = (min(g, n), max(g, n))
            self.edges[key] = self.edges[key][keep] if g < n else self.edges[key][:, keep]
            self.dirty.add(n)
            self._queue_group(n)
        if self.options.normalize_edges:
            for n in sorted(self.nbrs[g]):
                self._normalize(min(g, n), max(g, n))
        for c in sorted(self.lives_of[g]):
            live = self.lives[c]
            live.vecs[g] = live.vecs[g][keep]
            self._queue_live(c)
        self._queue_group(g)

    def _remove_group(self, g: int) -> None:
        for n in sorted(self.nbrs.pop(g)):
            del self.edges[(min(g, n), max(g, n))]
            self.nbrs[n].discard(g)
            self.dirty.add(n)
            self._queue_group(n)
        self.dirty.discard(g)
        del self.costs[g]
        del self.domains[g]

    # -- the simplifications -----------------------------------------------------------------

    def _refresh_live(self, c: int) -> None:
        """Moves per-group minima into the constant, drops never-binding live sets, and
        removes strategies that cannot fit even with every other member at its minimum."""
        live = self.lives[c]
        if not live.active or not self.options.memory:
            return
        for g in list(live.vecs):
            vec = live.vecs[g]
            low = vec.min()
            live.const += float(low)
            vec = vec - low
            if vec.any():
                live.vecs[g] = vec
            else:
                del live.vecs[g]
                self.lives_of[g].discard(c)
                self.dirty.add(g)
                self._queue_group(g)
        slack = self.budget - live.const
        tol = 1e-9 * max(abs(self.budget), 1.0)
        if slack < -tol:
            raise self._over_budget(c)
        if sum(float(v.max()) for v in live.vecs.values()) <= slack + tol:
            live.active = False
            for g in live.vecs:
                self.lives_of[g].discard(c)
                self.dirty.add(g)
                self._queue_group(g)
            return
        for g in sorted(live.vecs):
            if g in live.vecs:
                self._restrict(g, live.vecs[g] <= slack + tol)

    def _over_budget(self, c: int) -> Infeasible:
        return Infeasible(
            f"live set {c} needs at least {self.lives[c].const:.6g} bytes per device, over the "
            f"memory budget of {self.budget:.6g}"
        )

    def _remove_dominated(self, g: int) -> None:
        k = len(self.domains[g])
        if k < 2:
            return
        cost = self.costs[g]
        matrices = [self._matrix(g, n) for n in sorted(self.nbrs[g])]
        # Necessary conditions first, cheap in k: max_j (x - y) is at least max x - max y,
        # min x - min y and mean x - mean y, so `b` can only beat `a` where it does on all three.
        # (The ufuncs' reductions directly: `max`, `min` and `mean` call them, with Python around.)
        cheap = np.empty((3, k))
        cheap[:] = cost
        for m in matrices:
            cheap[0] += np.maximum.reduce(m, axis=1)
            cheap[1] += np.minimum.reduce(m, axis=1)
            cheap[2] += np.add.reduce(m, axis=1) / m.shape[1]
        ok = (cheap[:, None, :] <= cheap[:, :, None]).all(axis=0)  # [a, b]
        for c in self.lives_of[g]:
            vec = self.lives[c].vecs[g]
            ok &= vec[None, :] <= vec[:, None]
        np.fill_diagonal(ok, False)
        losers, winners = np.nonzero(ok)
        if not len(losers):
            return
        if matrices:
            # The exact test on the candidate pairs; incident matrices side by side, the max
            # over each one's columns in one call.
            joined = np.concatenate(matrices, axis=1)
            starts = np.cumsum([0] + [m.shape[1] for m in matrices[:-1]])
            rise = np.maximum.reduceat(joined[winners] - joined[losers], starts, axis=1).sum(axis=1)
            ok[losers, winners] = cost[winners] - cost[losers] + rise <= 0.0
        np.fill_diagonal(ok, True)
        # `ok` is a preorder (transitive: the bounds add up). Its strict part, with ties broken
        # towards the lower index, is a strict order: every strategy it dominates has an
        # undominated one above it, so all dominated strategies can go at once.
        beaten = ok & (~ok.T | (np.arange(k)[None, :] < np.arange(k)[:, None]))
        np.fill_diagonal(beaten, False)
        self._restrict(g, ~beaten.any(axis=1))

    def _eliminate(self, g: int) -> bool:
        """Folds g into its neighbours when it has one strategy, or at most two neighbours
        and no binding live set; returns whether it did."""
        domain, cost = self.domains[g], self.costs[g]
        nbrs = sorted(self.nbrs[g])
        if len(domain) == 1:
            for n in nbrs:
                self.costs[n] = self.costs[n] + self._matrix(g, n)[0]
            self.constant += float(cost[0])
            self.steps.append(("fixed", g, int(domain[0])))
            self.stats["constants"] += 1
            for c in sorted(self.lives_of.pop(g)):
                self.lives[c].const += float(self.lives[c].vecs.pop(g)[0])
                self._queue_live(c)
            self._remove_group(g)
            return True
        if self.lives_of[g] or len(nbrs) > 2:
            return False
        if not nbrs:
            i = int(np.argmin(cost))
            self.constant += float(cost[i])
            self.steps.append(("fixed", g, int(domain[i])))
        elif len(nbrs) == 1:
            (n,) = nbrs
            total = cost[:, None] + self._matrix(g, n)
            best = total.argmin(axis=0)
            self.costs[n] = self.costs[n] + total.min(axis=0)
            self.steps.append(("leaf", g, n, _table(domain[best], self.domains[n])))
        else:
            n1, n2 = nbrs
            total = cost[:, None, None] + self._matrix(g, n1)[:, :, None] + self._matrix(g, n2)[:, None, :]
            best = total.argmin(axis=0)
            self.steps.append(("series", g, n1, n2, _table(domain[best], self.domains[n1], self.domains[n2])))
            self._remove_group(g)
            self._add_edge(n1, n2, total.min(axis=0))
            self.stats["eliminated"] += 1
            del self.lives_of[g]
            return True
        self.stats["eliminated"] += 1
        del self.lives_of[g]
        self._remove_group(g)
        return True

    def _drain(self) -> None:
        while self.live_queue or self.group_queue:
            if self.live_queue:
                c = self.live_queue.popleft()
                self.queued_lives.discard(c)
                self._refresh_live(c)
                continue
            g = self.group_queue.popleft()
            self.queued_groups.discard(g)
            if g not in self.costs:
                continue
            before = len(self.domains[g])
            if self.options.dominance and g in self.dirty:
                self.dirty.discard(g)
                self._remove_dominated(g)
            if self.options.eliminate and (len(self.domains[g]) == before or len(self.domains[g]) == 1):
                self._eliminate(g)

    def _repair(self, choice: dict[int, int]) -> dict[int, int] | None:
        """`choice` (local indices) changed until every live set fits, greedily: in the live
        set most over budget, the switch that costs least per byte saved and breaks no other
        live set. None when that gets stuck. A plan that fits is what reduced-cost fixing
        needs as its upper bound."""
        lives = [live for live in self.lives if live.active and live.vecs]
        if not lives:
            return choice
        choice = dict(choice)
        limit = self.budget * (1 + 1e-9)
        used = [live.const + sum(float(v[choice[g]]) for g, v in live.vecs.items()) for live in lives]
        member: dict[int, list[int]] = {}
        for c, live in enumerate(lives):
            for g in live.vecs:
                member.setdefault(g, []).append(c)
        for _ in range(sum(len(d) for d in self.domains.values())):
            over = max(range(len(lives)), key=lambda c: used[c])
            if used[over] <= limit:
                return choice
            best = None
            for g in sorted(lives[over].vecs):
                i = choice[g]
                local = self.costs[g].copy()
                for n in self.nbrs[g]:
                    local += self._matrix(g, n)[:, choice[n]]
                change = {c: lives[c].vecs[g] - lives[c].vecs[g][i] for c in member[g]}
                for j in np.flatnonzero(change[over] < 0).tolist():
                    if any(used[c] + change[c][j] > limit and change[c][j] > 0 for c in member[g]):
                        continue
                    score = (local[j] - local[i]) / -change[over][j]
                    if best is None or score < best[0]:
                        best = (score, g, j)
            if best is None:
                return None
            _, g, j = best
            for c in member[g]:
                used[c] += float(lives[c].vecs[g][j] - lives[c].vecs[g][choice[g]])
            choice[g] = j
        return None

    def _penalties(self, prices: np.ndarray) -> dict[int, np.ndarray]:
        """Per group, the memory it uses in each live set, priced (Lagrange multipliers)."""
        extra: dict[int, np.ndarray] = {}
        for c in np.flatnonzero(prices).tolist():
            for g, vec in self.lives[c].vecs.items():
                extra[g] = extra[g] + prices[c] * vec if g in extra else prices[c] * vec
        return extra

    def _fix_by_bound(self) -> None:
        """Rounds of message passing, then reduced-cost fixing against the best plan found so far,
        then the exact simplifications again on what is left (see `dual.py`).

        Live sets that can bind are priced into the node costs (Lagrangian relaxation: for
        prices >= 0 the bound minus `sum price * (budget - const)` stays a bound for every plan
        that fits), the prices moving by subgradient steps toward the tightest bound.
        """
        prices = np.zeros(len(self.lives))
        best_total = np.inf
        for _ in range(self.options.rounds):
            binding = [c for c, live in enumerate(self.lives) if live.active and live.vecs]
            if not self.edges and not binding:
                return
            order = sorted(self.costs)
            active = np.zeros(len(self.lives), dtype=bool)
            active[binding] = True
            prices[~active] = 0.0  # a live set dropped since can no longer be priced
            extra = self._penalties(prices)
            for g, pen in extra.items():
                self.costs[g] += pen
            trws(order, self.costs, self.edges, self.options.sweeps)
            diffuse(order, self.costs, self.edges, 1)
            self.stats["sweeps"] += self.options.sweeps + 1
            low = lower_bound(self.costs, self.edges)
            low -= sum(prices[c] * (self.budget - self.lives[c].const) for c in binding)
            # Greedy decoding depends on its order: program order and its reverse, the better.
            priced = min(
                (decode(sequence, self.costs, self.edges) for sequence in (order, order[::-1])),
                key=lambda plan: energy(self.costs, self.edges, plan),
            )
            margins = reduced_costs(order, self.costs, self.edges)
            # The subgradient of the bound in the prices: how far over budget the priced plan is.
            step = np.zeros(len(self.lives))
            for c in binding:
                live = self.lives[c]
                step[c] = live.const - self.budget + sum(float(v[priced[g]]) for g, v in live.vecs.items())
            norm = float(step @ step)
            for g, pen in extra.items():
                self.costs[g] -= pen
            choice = self._repair(priced)
            if choice is not None:
                high = energy(self.costs, self.edges, choice)
                if high + self.constant < best_total:
                    best_total = high + self.constant
                    self.incumbent = {g: int(self.domains[g][i]) for g, i in choice.items()}
            self.lower_bound = max(self.lower_bound, low + self.constant)
            if best_total == np.inf:  # no plan that fits yet: no fixing, a guessed step
                if norm > 0:
                    prices = np.maximum(0.0, prices + 0.1 * max(abs(low), 1e-12) / norm * step)
                self._drain()
                continue
            high = best_total - self.constant
            magnitude = sum(float(np.abs(c).max()) for c in self.costs.values())
            magnitude += sum(float(np.abs(m).max()) for m in self.edges.values())
            tol = 1e-9 * (magnitude + abs(high))
            removed = self.stats["strategies_removed"]
            for g, rc in margins.items():
                self._restrict(g, rc <= high - low + tol)
            self.stats["fixed_by_bound"] += self.stats["strategies_removed"] - removed
            if high - low <= tol:
                self._drain()
                return
            self._drain()
            if norm > 0:  # Polyak's step size
                prices = np.maximum(0.0, prices + (high - low) / norm * step)

    def run(self) -> Reduced:
        self._drain()
        self.stats["nodes_simplified"] = len(self.costs)
        self.stats["edges_simplified"] = len(self.edges)
        if self.options.bound:
            self._fix_by_bound()
        lives = []
        for c, live in enumerate(self.lives):
            if live.active and live.vecs:
                lives.append(live)
            elif live.active and live.const > self.budget * (1 + 1e-9):
                raise self._over_budget(c)
        self.stats["nodes_core"] = len(self.costs)
        self.stats["edges_core"] = len(self.edges)
        self.stats["live_sets_core"] = len(lives)
        return Reduced(
            leader=self.leader,
            domains=self.domains,
            costs=self.costs,
            edges=self.edges,
            lives=lives,
            budget=self.budget,
            constant=self.constant,
            steps=self.steps,
            stats=self.stats,
            incumbent={g: i for g, i in self.incumbent.items() if g in self.costs},
            lower_bound=self.lower_bound,
        )


def _table(values: np.ndarray, *axes: np.ndarray) -> np.ndarray:
    """An array indexed by the original strategy indices of the neighbours in `axes`."""
    shape = tuple(int(a.max()) + 1 for a in axes)
    table = np.full(shape, -1, dtype=np.int64)
    table[np.ix_(*axes)] = values
    return table


def reduce_problem(problem: Problem, options: Simplify = Simplify()) -> Reduced:
    """The core of `problem` after the simplifications `options` asks for; raises `Infeasible`
    when the fixed strategies or the memory budget leave no plan."""
    return _Reducer(problem, options).run()
