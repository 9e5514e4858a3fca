"""Eq. 1 of the Alpa paper (§4.2) in CP-SAT: pick one strategy per node, minimizing node costs
plus resharding costs on edges, under a per-device memory budget and the user's fixed shardings.

The pass turns a module into a `Problem` (plain data: per node its strategies' costs and memory,
per edge a resharding matrix, the live sets of a liveness analysis); `solve` returns a choice for
every node. Nothing here knows MLIR.

How it is solved:

1. `merging.reduce_problem` applies exact simplifications (followers collapsed into their leaders,
   parallel edges added, edge matrices reparametrized and dropped when additive, memory-infeasible
   and dominated strategies removed, nodes of degree <= 2 outside the live sets eliminated by
   dynamic programming, one-strategy nodes made constants), then reduced-cost fixing from a
   lower bound on the LP relaxation (`dual.py`). Each keeps the optimum. When the bound meets
   the best plan (the usual case on transformer graphs) nothing is left and the plan comes back
   OPTIMAL without CP-SAT: on `tools/bench_ilp.py`'s 3,000-node GPT-like step, 1.8 s on two cores
   where CP-SAT alone on the simplified model needs minutes.
2. The core left is encoded with one boolean per (node, strategy) and `ExactlyOne` per node, and
   each edge is linearized tightly ("marginal" or local-polytope encoding): booleans `e[p, q]`
   whose row sums equal the source's one-hot and whose column sums equal the destination's.
   Strategies with identical rows in an edge's matrix share a row (`p` is a class of rows, its
   marginal the sum of their booleans), likewise for columns, so an edge costs
   `#distinct rows x #distinct columns` booleans rather than `k_src x k_dst`. This is Alpa's
   `e_vu` linearization with its LP relaxation (the tightest pairwise one) intact. Measured on
   one and two simplified transformer layers (37 and 74 nodes, 2 workers): this encoding is
   proven optimal in 0.5 s and 5.8 s; one `AddAllowedAssignments((s_u, s_v, cost))` table
   per edge (fewer variables, weak relaxation) in 3.3 s and 36 s with presolve, and not within
   60 s without.
3. CP-SAT needs integers: every cost coefficient of the core is multiplied by
   `RESOLUTION / (largest core coefficient)` and rounded, i.e. costs are kept to
   1e-9 of the largest one. A plan the ILP ranks first is then optimal in float up to
   `(#core nodes + #core edges) * 0.5e-9 * largest cost`. The objective reported is recomputed
   from the choices in float (`evaluate`). Memory is counted in whole bytes: coefficients are
   rounded up and the budget down, so a plan the ILP accepts always fits.

`Solution.sizes` counts the model at each stage: `variables_eq1` / `constraints_eq1` (Alpa's
plain formulation of the input), `nodes_merged` / `edges_merged` (followers collapsed),
`nodes_simplified` / `edges_simplified` (after the exact steps), `nodes_core` / `edges_core` /
`live_sets_core` (after the bound), `variables` / `constraints` (the CP-SAT model), `workers`
(CP-SAT's, where it ran), and what each
step did (`strategies_removed`, `fixed_by_bound`, `eliminated`, `constants`, `sweeps`).

Determinism: the model is built in a fixed order, and CP-SAT runs with a fixed `random_seed`,
`randomize_search` off, and a *deterministic* time limit (`max_deterministic_time`, CP-SAT's
work counter, "close to a second" of a typical machine) instead of a wall-clock one, so a limit
hit on a busy machine gives the same answer as on an idle one. With one worker that is enough.
CP-SAT's parallel portfolio (several workers sharing solutions and bounds as they come) is not
reproducible, so `num_workers > 1` turns on `interleave_search`, which runs the subsolvers in
batches and synchronizes between batches: deterministic for a given model, whatever the
machine and load.

Workers: by default (`num_workers=None`) two, interleaved, for a CP-SAT model of up to
`PORTFOLIO_MAX_VARIABLES` variables, and one above. Interleaving gives each LP subsolver its own
copy of the LP and runs them in turns, which on large cores costs far more than it finds
(`tools/bench_ilp.py --no-bound`, 2 cores: 24k variables 0.30 s with one worker against 7.2 s
with two; 98k 3.3 s against 40 s; 297k proven optimal in 26 s against not proven within the
limit in 233 s; GPT-39B's 16 x 8 stage cores, 276k variables, 7.1 s against 35.5 s, the same
optimum). Below the cut both take a fraction of a second, and the two-worker search keeps the
plans it has always given (which optimum of several equal ones: the tests' numerics pin them).
A problem a time limit stops before CP-SAT has a plan of its own comes back with the plan it
was started from (`_hint`), FEASIBLE with its gap.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hlopar.analysis.auto_sharding.dual import decode
from hlopar.analysis.auto_sharding.merging import Infeasible, Reduced, Simplify, reduce_problem
from hlopar.analysis.auto_sharding.problem import Problem, evaluate, violations

__all__ = ["Solution", "solve", "brute_force", "RESOLUTION", "PORTFOLIO_MAX_VARIABLES"]

# Costs are integers in units of (largest core coefficient) / RESOLUTION.
RESOLUTION = 1e9
# Above this many CP-SAT variables one worker instead of two interleaved (module docstring).
PORTFOLIO_MAX_VARIABLES = 10_000


@dataclass(frozen=True)
class Solution:
    """The plan. `solve_seconds` and `timings` (seconds spent simplifying, building the model,
    in CP-SAT) are wall times, which differ between runs, so they take no part in equality."""

    choices: tuple[int, ...]
    objective: float
    status: str
    gap: float
    solve_seconds: float = field(compare=False)
    sizes: dict = field(default_factory=dict)
    message: str = ""
    timings: dict = field(default_factory=dict, compare=False)


def _eq1_sizes(problem: Problem) -> dict:
    """Sizes of Alpa's plain formulation: s_v and e_vu booleans, one-hot and marginal rows."""
    ks = [len(node.costs) for node in problem.nodes]
    budget = problem.memory_budget is not None
    return {
        "nodes": len(problem.nodes),
        "edges": len(problem.edges),
        "live_sets": len(problem.live_sets) if budget else 0,
        "variables_eq1": sum(ks) + sum(ks[e.src] * ks[e.dst] for e in problem.edges),
        "constraints_eq1": len(ks)
        + sum(ks[e.src] + ks[e.dst] for e in problem.edges)
        + (len(problem.live_sets) if budget else 0),
    }


def brute_force(problem: Problem) -> Solution:
    """The optimum by enumerating every plan of the leaders (ties: lexicographically first).

    For tests on tiny problems; refuses more than a million plans.
    """
    start = time.perf_counter()
    sizes = _eq1_sizes(problem)
    n = len(problem.nodes)
    leaders = [v for v in range(n) if problem.nodes[v].follows is None]
    plans = math.prod(len(problem.nodes[v].costs) for v in leaders)
    if plans > 1_000_000:
        raise ValueError(f"{plans} plans are too many to enumerate")
    best, best_cost = None, math.inf
    for combo in itertools.product(*(range(len(problem.nodes[v].costs)) for v in leaders)):
        choices = [-1] * n
        for v, c in zip(leaders, combo):
            choices[v] = c
        for v in range(n):
            u = v
            while choices[u] < 0:
                u = problem.nodes[u].follows
            choices[v] = choices[u]
        if violations(problem, choices):
            continue
        cost = evaluate(problem, choices)
        if cost < best_cost:
            best, best_cost = tuple(choices), cost
    elapsed = time.perf_counter() - start
    if best is None:
        return Solution((), math.inf, "INFEASIBLE", 0.0, elapsed, sizes, "no plan is feasible")
    return Solution(best, best_cost, "OPTIMAL", 0.0, elapsed, sizes)


class _ProtoBuilder:
    """Writes the CP-SAT model proto directly: the Python expression layer costs several times
    more per variable, which matters at hundreds of thousands of edge booleans."""

    def __init__(self) -> None:
        from ortools.sat.python import cp_model  # where used: 0.8 s of imports (pandas) a cached plan never needs

        self.model = cp_model.CpModel()
        self.proto = self.model.proto
        self.num_vars = 0
        self.objective: dict[int, int] = {}

    def booleans(self, count: int) -> range:
        variables = self.proto.variables
        for _ in range(count):
            variables.add().domain.extend((0, 1))
        first = self.num_vars
        self.num_vars += count
        return range(first, first + count)

    def exactly_one(self, literals: Sequence[int]) -> None:
        self.proto.constraints.add().exactly_one.literals.extend(literals)

    def linear(self, variables: Sequence[int], coeffs: Sequence[int], low: int, high: int) -> None:
        linear = self.proto.constraints.add().linear
        linear.vars.extend(variables)
        linear.coeffs.extend(coeffs)
        linear.domain.extend((low, high))

    def minimize(self, variables: Sequence[int], coeffs: Sequence[int]) -> None:
        objective = self.proto.objective
        objective.vars.extend(variables)
        objective.coeffs.extend(coeffs)


@dataclass
class _Core:
    """The CP-SAT model of a reduced problem, and where each group's booleans are."""

    builder: _ProtoBuilder
    groups: list[int]
    first_var: dict[int, int]
    scale: float
    offset: float  # what the whole objective adds to the scaled model's objective / scale
    live_rows: list[tuple[list[int], list[int], int]]  # memory constraints: vars, coeffs, bound


def _build(reduced: Reduced) -> _Core:
    """The CP-SAT model of the core: every coefficient made nonnegative (edge row and column
    minima moved into the nodes, node minima into `offset`), then scaled to integers."""
    groups = sorted(reduced.costs)
    costs = {g: reduced.costs[g].copy() for g in groups}
    edges = {}
    for (a, b), matrix in sorted(reduced.edges.items()):
        rows = matrix.min(axis=1)
        costs[a] += rows
        matrix = matrix - rows[:, None]
        cols = matrix.min(axis=0)
        costs[b] += cols
        edges[(a, b)] = matrix - cols[None, :]
    offset = 0.0
    for g in groups:
        low = float(costs[g].min())
        offset += low
        costs[g] -= low
    largest = max([float(c.max()) for c in costs.values()] + [float(m.max()) for m in edges.values()])
    scale = RESOLUTION / largest if largest > 0 else 1.0

    builder = _ProtoBuilder()
    first_var = {}
    obj_vars: list[int] = []
    obj_coeffs: list[int] = []
    for g in groups:
        xs = builder.booleans(len(reduced.domains[g]))
        first_var[g] = xs.start
        builder.exactly_one(xs)
        for x, c in zip(xs, np.rint(costs[g] * scale).astype(np.int64).tolist()):
            if c:
                obj_vars.append(x)
                obj_coeffs.append(c)
    for (a, b), matrix in edges.items():
        ints = np.rint(matrix * scale).astype(np.int64)
        if not ints.any():
            continue
        rows, row_class = np.unique(ints, axis=0, return_inverse=True)
        table, col_class = np.unique(rows, axis=1, return_inverse=True)
        n_rows, n_cols = table.shape
        es = builder.booleans(n_rows * n_cols)
        for (p, q), c in zip(itertools.product(range(n_rows), range(n_cols)), table.ravel().tolist()):
            if c:
                obj_vars.append(es[p * n_cols + q])
                obj_coeffs.append(c)
        for p in range(n_rows):
            members = [first_var[a] + i for i in np.flatnonzero(row_class == p).tolist()]
            cells = list(es[p * n_cols : (p + 1) * n_cols])
            builder.linear(cells + members, [1] * n_cols + [-1] * len(members), 0, 0)
        for q in range(n_cols):
            members = [first_var[b] + j for j in np.flatnonzero(col_class == q).tolist()]
            cells = list(es[q::n_cols])
            builder.linear(cells + members, [1] * n_rows + [-1] * len(members), 0, 0)
    live_rows = []
    for live in reduced.lives:
        variables, coeffs = [], []
        for g in sorted(live.vecs):
            ints = np.ceil(live.vecs[g] - 1e-6).astype(np.int64).tolist()
            for i, c in enumerate(ints):
                if c > 0:
                    variables.append(first_var[g] + i)
                    coeffs.append(c)
        high = math.floor(reduced.budget - live.const + 1e-6)
        builder.linear(variables, coeffs, min(0, high), high)  # high < 0: infeasible, not invalid
        live_rows.append((variables, coeffs, high))
    if obj_vars:
        builder.minimize(obj_vars, obj_coeffs)
    return _Core(builder, groups, first_var, scale, reduced.constant + offset, live_rows)


def _hint(core: _Core, reduced: Reduced) -> dict[int, int] | None:
    """Starts CP-SAT from the best plan the simplifications found, or else from a greedy one
    (`dual.decode`), and returns it (group -> index in its domain), so that a time limit
    always leaves a plan: CP-SAT's own search may not have completed one by then. A plan over
    the memory budget is neither given nor returned: CP-SAT 9.15 aborts (a failed CHECK, not
    an error) on a hint for a model that is infeasible at the root with presolve off and
    interleaved search, and a hint that fits proves the model feasible."""
    choice = {}
    for g, strategy in reduced.incumbent.items():
        where = np.flatnonzero(reduced.domains[g] == strategy)
        if len(where):
            choice[g] = int(where[0])
    if len(choice) < len(core.groups):
        choice = decode(core.groups, reduced.costs, reduced.edges)
    literals = {core.first_var[g] + i for g, i in choice.items()}
    for variables, coeffs, high in core.live_rows:
        if sum(c for v, c in zip(variables, coeffs) if v in literals) > high:
            return None
    hint = core.builder.proto.solution_hint
    hint.vars.extend(sorted(literals))
    hint.values.extend([1] * len(literals))
    return choice


def _relative_gap(objective: float, bound: float) -> float:
    missing = max(0.0, objective - bound)
    if missing == 0.0:
        return 0.0
    return missing / abs(objective) if objective else math.inf


def solve(
    problem: Problem,
    *,
    time_limit: float = 60.0,
    num_workers: int | None = None,
    seed: int = 0,
    simplify: Simplify = Simplify(),
    log: bool = False,
) -> Solution:
    """The plan of least Eq. 1 cost that fits the memory budget and keeps fixed strategies.

    `time_limit` is in CP-SAT's deterministic seconds (see the module docstring; on the
    two-core development machine one took 1 to 2.5 wall seconds); when it is hit, the best
    plan found so far comes back with status FEASIBLE and its relative gap to the best bound.
    The simplifications before CP-SAT do a bounded amount of work (`simplify.rounds` rounds of
    `simplify.sweeps` sweeps) and are not limited by it. INFEASIBLE and UNKNOWN (no plan found
    in time, not even one to start from that fits) come back with no choices and a message.
    `num_workers`: CP-SAT's (None: by the model's size, see the module docstring). `log`
    prints CP-SAT's search log.
    """
    start = time.perf_counter()
    sizes = _eq1_sizes(problem)
    try:
        reduced = reduce_problem(problem, simplify)
    except Infeasible as exc:
        return Solution((), math.inf, "INFEASIBLE", 0.0, time.perf_counter() - start, sizes, str(exc))
    sizes.update(reduced.stats)
    timings = {"simplify": time.perf_counter() - start, "build": 0.0, "cpsat": 0.0}
    if not reduced.costs:
        choices = reduced.expand({})
        sizes.update(variables=0, constraints=0)
        elapsed = time.perf_counter() - start
        return Solution(choices, evaluate(problem, choices), "OPTIMAL", 0.0, elapsed, sizes, timings=timings)

    core = _build(reduced)
    hinted = _hint(core, reduced)
    sizes.update(variables=core.builder.num_vars, constraints=len(core.builder.proto.constraints))
    timings["build"] = time.perf_counter() - start - timings["simplify"]
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    params = solver.parameters
    if num_workers is None:
        num_workers = 2 if core.builder.num_vars <= PORTFOLIO_MAX_VARIABLES else 1
    sizes["workers"] = params.num_workers = num_workers
    params.interleave_search = num_workers > 1
    params.random_seed = seed
    params.randomize_search = False
    params.max_deterministic_time = time_limit
    # Measured on transformer-like cores: CP-SAT's presolve and probing rewrite the marginal
    # constraints into clauses and lose the tight LP (bounds stall at a third of the optimum),
    # and adding LP rows lazily makes the root bound crawl; with these three off the same
    # models are proven optimal one to two orders of magnitude sooner.
    params.cp_model_presolve = False
    params.cp_model_probing_level = 0
    params.add_lp_constraints_lazily = False
    params.log_search_progress = log
    status = solver.status_name(solver.solve(core.builder.model))
    elapsed = time.perf_counter() - start
    timings["cpsat"] = solver.wall_time
    if status == "UNKNOWN" and hinted is not None:  # out of time before a plan of its own
        local = hinted
        status = "FEASIBLE"
    elif status in ("OPTIMAL", "FEASIBLE"):
        values = np.asarray(solver.response_proto.solution, dtype=np.int64)
        local = {
            g: int(np.argmax(values[core.first_var[g] : core.first_var[g] + len(reduced.domains[g])]))
            for g in core.groups
        }
    else:
        if status == "INFEASIBLE":
            message = (
                f"no plan fits the memory budget of {problem.memory_budget:.6g} bytes per device "
                "with the fixed strategies"
            )
        elif status == "UNKNOWN":
            message = "no plan found within the time limit"
        else:
            raise RuntimeError(f"CP-SAT rejected the model: {status} {core.builder.model.validate()}")
        return Solution((), math.inf, status, 0.0, elapsed, sizes, message, timings)

    choices = reduced.expand({g: int(reduced.domains[g][i]) for g, i in local.items()})
    objective = evaluate(problem, choices)
    if status == "FEASIBLE" and hinted is not None and local is not hinted:  # never worse than its start
        start_choices = reduced.expand({g: int(reduced.domains[g][i]) for g, i in hinted.items()})
        start_objective = evaluate(problem, start_choices)
        if start_objective < objective:
            choices, objective = start_choices, start_objective
    gap = 0.0
    if status == "FEASIBLE":
        bound = max(reduced.lower_bound, core.offset + solver.best_objective_bound / core.scale)
        gap = _relative_gap(objective, bound)
    return Solution(choices, objective, status, gap, elapsed, sizes, timings=timings)
