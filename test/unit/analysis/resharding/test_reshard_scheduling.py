"""Load balancing and scheduling: each algorithm on its own, against brute force, and the ensemble."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from hlopar.analysis.resharding.scheduling import (
    Option,
    SearchBudget,
    dfs,
    ensemble,
    load_balance,
    makespan,
    naive,
    randomized_greedy,
    run_algorithm,
    schedule_bound,
)


def option(duration, sender_host, receiver_hosts):
    resources = frozenset({("send", sender_host)} | {("recv", h) for h in receiver_hosts})
    return Option(duration, resources, sender_host, ("send", sender_host))


def task(duration, senders, receivers):
    return [option(duration, s, receivers) for s in senders]


def random_problem(rng: random.Random, tasks: int):
    problem = []
    for _ in range(tasks):
        senders = sorted(rng.sample(range(3), rng.randint(1, 2)))
        receivers = rng.sample(range(3, 6), rng.randint(1, 2))
        problem.append(task(float(rng.randint(1, 4)), senders, receivers))
    return problem


def brute_force(problem) -> float:
    best = float("inf")
    for order in itertools.permutations(range(len(problem))):
        for choice in itertools.product(*(range(len(problem[t])) for t in order)):
            best = min(best, makespan(problem, tuple(zip(order, choice))))
    return best


def is_schedule(problem, schedule) -> bool:
    return sorted(t for t, _ in schedule) == list(range(len(problem))) and all(
        0 <= k < len(problem[t]) for t, k in schedule
    )


# Case 3 of the paper at host level: 4 equal tasks, source hosts 0 and 1, destination 2 and 3,
# in Alpa's order (destination first). Two rounds suffice.
CASE3 = [task(1.0, [0], [2]), task(1.0, [1], [2]), task(1.0, [0], [3]), task(1.0, [1], [3])]


def test_naive_keeps_the_first_sender_and_the_given_order():
    assert naive(CASE3) == ((0, 0), (1, 0), (2, 0), (3, 0))
    assert makespan(CASE3, naive(CASE3)) == 3.0  # host 2 is busy first, hosts 1 and 3 wait


def test_load_balance_spreads_senders_longest_first():
    problem = [task(1.0, [0, 1], [2]), task(3.0, [0, 1], [3]), task(2.0, [0, 1], [4]), task(2.0, [0, 1], [5])]
    schedule = load_balance(problem)
    assert [t for t, _ in schedule] == [1, 2, 3, 0]
    hosts = {t: problem[t][k].sender_host for t, k in schedule}
    assert hosts == {1: 0, 2: 1, 3: 1, 0: 0}  # loads 4 and 4 (Eq. 4)
    assert makespan(problem, schedule) == 4.0


def test_search_algorithms_find_the_two_rounds_of_case3():
    assert makespan(CASE3, dfs(CASE3)) == 2.0
    assert makespan(CASE3, randomized_greedy(CASE3)) == 2.0
    assert schedule_bound(CASE3) == 2.0


@pytest.mark.parametrize("seed", range(40))
def test_dfs_finds_the_optimum_of_tiny_instances(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(1, 5))
    schedule = dfs(problem, SearchBudget(dfs_seconds=10.0, dfs_nodes=10**7))
    assert is_schedule(problem, schedule)
    assert makespan(problem, schedule) == pytest.approx(brute_force(problem))


@pytest.mark.parametrize("seed", range(20))
def test_ensemble_is_never_worse_than_any_member(seed):
    rng = random.Random(1000 + seed)
    problem = random_problem(rng, rng.randint(1, 12))
    name, schedule = ensemble(problem)
    assert is_schedule(problem, schedule)
    span = makespan(problem, schedule)
    for member in ("naive", "load-balance", "randomized-greedy", "dfs"):
        assert span <= makespan(problem, run_algorithm(member, problem)) + 1e-12
    if name != "dfs":  # the DFS ran from an incumbent, the others as they are
        assert makespan(problem, run_algorithm(name, problem)) == pytest.approx(span)
    assert span >= schedule_bound(problem) - 1e-12


def test_randomized_greedy_is_deterministic_per_seed():
    problem = random_problem(random.Random(7), 10)
    assert randomized_greedy(problem, SearchBudget(seed=3)) == randomized_greedy(problem, SearchBudget(seed=3))


def test_dfs_stops_at_its_budget_with_a_valid_schedule():
    rng = random.Random(11)
    problem = [
        task(float(rng.randint(1, 9)), sorted(rng.sample(range(4), 2)), rng.sample(range(4, 10), 3)) for _ in range(60)
    ]
    start = time.perf_counter()
    schedule = dfs(problem, SearchBudget(dfs_seconds=0.05))
    assert time.perf_counter() - start < 1.0
    assert is_schedule(problem, schedule)


def test_dfs_improves_on_its_incumbent_or_returns_it():
    incumbent = naive(CASE3)
    better = dfs(CASE3, incumbent=incumbent)
    assert makespan(CASE3, better) == 2.0
    optimal = dfs(CASE3)
    assert dfs(CASE3, incumbent=optimal) == optimal


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="unknown algorithm 'best'"):
        run_algorithm("best", CASE3)
