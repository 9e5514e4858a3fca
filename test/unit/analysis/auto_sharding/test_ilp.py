"""The auto-sharding ILP (Eq. 1): optimal against enumeration, exact simplifications,
memory budget, fixed strategies, followers, determinism and time limits."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from tools_module import load_tool

from hlopar.analysis.auto_sharding.ilp import PORTFOLIO_MAX_VARIABLES, brute_force, solve
from hlopar.analysis.auto_sharding.merging import Simplify
from hlopar.analysis.auto_sharding.problem import Edge, Node, Problem, evaluate, violations

bench_ilp = load_tool("bench_ilp")

NOTHING = Simplify(normalize_edges=False, memory=False, dominance=False, eliminate=False, bound=False)
OPTIONS = {
    "all": Simplify(),
    "no-bound": Simplify(bound=False),
    "no-dominance": Simplify(dominance=False),
    "no-elimination": Simplify(eliminate=False, bound=False),
    "no-normalization": Simplify(normalize_edges=False),
    "no-memory": Simplify(memory=False, bound=False),
    "nothing": NOTHING,
}


def random_problem(rng: random.Random, n: int, kmax: int = 3, density: float = 0.5, memory: bool = False) -> Problem:
    """A random graph; costs drawn with many zeros and ties, as real resharding matrices have,
    some nodes following an earlier one and some fixed; live sets and a budget on request."""
    counts = [rng.randint(1, kmax) for _ in range(n)]
    nodes = []
    for v, k in enumerate(counts):
        leaders = [u for u in range(v) if counts[u] == k]
        follows = rng.choice(leaders) if leaders and rng.random() < 0.2 else None
        fixed = rng.randrange(k) if rng.random() < 0.1 else None
        costs = tuple(round(rng.random() * rng.choice([0, 1, 10]), 3) for _ in range(k))
        mem = tuple(float(rng.randint(0, 10)) for _ in range(k)) if memory else ()
        nodes.append(Node(costs, mem, fixed, follows, f"n{v}"))
    edges = []
    for a in range(n):
        for b in range(n):
            if a != b and rng.random() < density / 2:
                matrix = tuple(
                    tuple(round(rng.random() * rng.choice([0, 1, 5]), 3) for _ in range(counts[b]))
                    for _ in range(counts[a])
                )
                edges.append(Edge(a, b, matrix))
    if not memory:
        return Problem(tuple(nodes), tuple(edges))
    lives = tuple(tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) for _ in range(3))
    # Between the least any live set can need and the most: binding, sometimes infeasible.
    least = max(sum(min(nodes[v].memory) for v in live) for live in lives)
    most = max(sum(max(nodes[v].memory) for v in live) for live in lives)
    return Problem(tuple(nodes), tuple(edges), float(round(least + rng.uniform(-0.1, 0.6) * (most - least))), lives)


def problems(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        yield random_problem(rng, rng.randint(1, 7), density=rng.choice([0.3, 0.6, 1.0]), memory=rng.random() < 0.5)


def assert_same_optimum(problem: Problem, expected, got) -> None:
    assert got.status == expected.status, (got.status, expected.status, got.message)
    if expected.status == "OPTIMAL":
        assert got.objective == pytest.approx(expected.objective, rel=1e-6, abs=1e-9)
        assert violations(problem, got.choices) == []
        assert got.objective == pytest.approx(evaluate(problem, got.choices))
        assert got.gap == 0.0
    else:
        assert got.choices == () and ("budget" in got.message or "fixed" in got.message)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_optimal_against_brute_force(name):
    for problem in problems(seed=len(name), count=100):
        assert_same_optimum(problem, brute_force(problem), solve(problem, simplify=OPTIONS[name]))


def test_memory_budgets_against_brute_force():
    """Budgets that bind: the priced bound, the repair of plans and fixing under memory."""
    rng = random.Random(13)
    for _ in range(300):
        problem = random_problem(rng, rng.randint(3, 8), kmax=3, density=rng.choice([0.3, 0.6]), memory=True)
        assert_same_optimum(problem, brute_force(problem), solve(problem))


def test_denser_graphs_against_brute_force():
    rng = random.Random(7)
    for _ in range(25):
        problem = random_problem(rng, rng.randint(6, 8), kmax=3, density=1.0, memory=rng.random() < 0.5)
        expected = brute_force(problem)
        assert_same_optimum(problem, expected, solve(problem))
        assert_same_optimum(problem, expected, solve(problem, simplify=NOTHING, num_workers=1))


def test_followers_copy_their_leader_and_share_its_edges():
    # b follows a; the edge a->b becomes a diagonal: a's strategy 1 is cheap only with b's 1.
    a = Node((0.0, 1.0), name="a")
    b = Node((5.0, 0.0), follows=0, name="b")
    c = Node((0.0, 0.0, 0.0), follows=None, name="c")
    edges = (Edge(0, 1, ((0.0, 9.0), (9.0, 0.0))), Edge(1, 2, ((0.0, 2.0, 3.0), (4.0, 0.0, 1.0))))
    problem = Problem((a, b, c), edges)
    solution = solve(problem)
    assert solution.choices == (1, 1, 1)
    assert solution.objective == pytest.approx(1.0)
    assert solution == brute_force(problem) or solution.choices == brute_force(problem).choices


def test_fixed_strategies_are_kept():
    nodes = (Node((0.0, 5.0), fixed=1), Node((0.0, 0.0)))
    problem = Problem(nodes, (Edge(0, 1, ((0.0, 1.0), (1.0, 0.0))),))
    assert solve(problem).choices == (1, 1)


def test_memory_budget_moves_to_a_sharded_strategy():
    # Replicated (strategy 0) is cheaper but needs 8 bytes; sharded needs 2.
    weight = Node((0.0, 1.0), memory=(8.0, 2.0), name="w")
    act = Node((0.0, 0.5), memory=(4.0, 3.0), name="x")
    problem = Problem((weight, act), (), memory_budget=10.0, live_sets=((0, 1),))
    assert solve(problem).choices == (1, 0)
    assert solve(dataclasses.replace(problem, memory_budget=None)).choices == (0, 0)


@pytest.mark.parametrize("options", [Simplify(), NOTHING], ids=["simplified", "cp-sat"])
def test_infeasible_memory_budget(options):
    nodes = (Node((0.0, 1.0), memory=(8.0, 6.0)), Node((0.0, 1.0), memory=(4.0, 3.0)))
    problem = Problem(nodes, (), memory_budget=8.0, live_sets=((0, 1),))
    solution = solve(problem, simplify=options)
    assert solution.status == "INFEASIBLE"
    assert solution.choices == ()
    assert "budget" in solution.message
    assert brute_force(problem).status == "INFEASIBLE"


def test_infeasible_only_jointly_is_found_by_cp_sat():
    # Each live set fits on its own; together they need node 1 both small and large.
    nodes = (
        Node((0.0,), memory=(5.0,)),
        Node((0.0, 0.0), memory=(0.0, 6.0)),
        Node((0.0, 0.0), memory=(6.0, 0.0), follows=None),
    )
    lives = ((0, 1), (2,), (1, 2))
    problem = Problem(nodes, (), memory_budget=5.5, live_sets=lives)
    expected = brute_force(problem)
    for options in (Simplify(), NOTHING):
        assert solve(problem, simplify=options).status == expected.status


def test_conflicting_fixed_followers_are_infeasible():
    nodes = (Node((0.0, 0.0), fixed=0), Node((0.0, 0.0), fixed=1, follows=0))
    solution = solve(Problem(nodes, ()))
    assert solution.status == "INFEASIBLE" and "fixed" in solution.message


def test_invalid_problems_are_rejected():
    with pytest.raises(ValueError, match="cycle"):
        solve(Problem((Node((0.0,), follows=1), Node((0.0,), follows=0)), ()))
    with pytest.raises(ValueError, match="counts must match"):
        solve(Problem((Node((0.0, 1.0)), Node((0.0,), follows=0)), ()))
    with pytest.raises(ValueError, match="not 2x1"):
        solve(Problem((Node((0.0, 1.0)), Node((0.0,))), (Edge(0, 1, ((0.0, 1.0),)),)))


def test_simplifications_keep_the_optimum_on_a_transformer_layer():
    problem = bench_ilp.gpt_like_problem(1, (2, 4))
    full = solve(problem)
    plain = solve(problem, simplify=NOTHING)
    assert full.status == plain.status == "OPTIMAL"
    assert full.objective == pytest.approx(plain.objective, rel=1e-6)
    assert full.sizes["nodes_core"] < full.sizes["nodes_merged"] < full.sizes["nodes"]
    assert plain.sizes["variables"] < plain.sizes["variables_eq1"]


def test_deterministic():
    problem = bench_ilp.gpt_like_problem(1, (2, 4))
    for options in (Simplify(), Simplify(bound=False)):
        first = solve(problem, simplify=options, num_workers=2)
        second = solve(problem, simplify=options, num_workers=2)
        assert first == second
        assert first.status == "OPTIMAL"


def test_time_limit_keeps_the_best_plan_and_reports_the_gap():
    problem = bench_ilp.gpt_like_problem(2, (2, 4))
    solution = solve(problem, simplify=Simplify(bound=False), time_limit=0.05)
    assert solution.status == "FEASIBLE"
    assert 0.0 < solution.gap < 1.0
    assert violations(problem, solution.choices) == []
    assert solution.objective == pytest.approx(evaluate(problem, solution.choices))


def test_time_limit_before_cp_sat_has_a_plan_keeps_the_plan_it_started_from():
    # One worker at 0.05 deterministic seconds is still in its LP when stopped (checked:
    # UNKNOWN from CP-SAT); the plan it was hinted with comes back.
    problem = bench_ilp.gpt_like_problem(2, (2, 4))
    solution = solve(problem, simplify=Simplify(bound=False), time_limit=0.05, num_workers=1)
    assert (solution.status, solution.sizes["workers"]) == ("FEASIBLE", 1)
    assert 0.0 < solution.gap < 1.0
    assert violations(problem, solution.choices) == []
    assert solution.objective == pytest.approx(evaluate(problem, solution.choices))


def test_workers_by_model_size():
    small = solve(bench_ilp.gpt_like_problem(1, (1, 4)), simplify=Simplify(bound=False))
    large = solve(bench_ilp.gpt_like_problem(2, (2, 4)), simplify=Simplify(bound=False))
    assert small.sizes["variables"] <= PORTFOLIO_MAX_VARIABLES < large.sizes["variables"]
    assert (small.sizes["workers"], large.sizes["workers"]) == (2, 1)
    assert small.status == large.status == "OPTIMAL"


def test_benchmark_problem_solves_to_optimality():
    problem = bench_ilp.gpt_like_problem(4, (2, 4))
    solution = solve(problem)
    assert solution.status == "OPTIMAL" and solution.gap == 0.0
    assert len(solution.choices) == len(problem.nodes)
    assert violations(problem, solution.choices) == []
    assert not math.isinf(solution.objective)
