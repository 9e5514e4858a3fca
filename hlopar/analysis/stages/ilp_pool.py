"""The layer ILPs of stage construction, each distinct one solved once, here or in spawned workers.

A `Problem` is plain data (`auto_sharding.problem`), compared as such: two layers (or
two intra-op options) whose ILPs have equal nodes and edges share one solve, whatever
produced them. Node names are left out: they only name nodes in messages. Problems are
looked up by their shape (`shape_key`), then compared by their costs (`same_content`).

Where the solves run is decided as they go, by a measured rule: they start in this process;
once the solves already made predict that the ones left would take longer here than in
`workers` processes plus the start of those processes (`SPAWN_START_SECONDS`), the rest go to
a pool of spawned processes, which receive each problem as plain data (pickled) and import
only numpy and CP-SAT, never JAX. The planning process meanwhile builds the next problems.
Small models (a tiny GPT's handful of ILPs) thus never start a process; CP-SAT runs with one
thread and a fixed seed, so where a problem is solved does not change its solution.

`solve_all` serves the stages' own ILPs (`passes/mpmd_program.py`), a few problems known
together, each as big as a stage: where two or more are big enough to take seconds, they are
solved side by side (one here, the others in spawned processes), by the same `ilp.solve`.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.problem import Problem
from hlopar.processes import die_with_parent

__all__ = [
    "BIG_PROBLEM_NODES",
    "SPAWN_START_SECONDS",
    "IlpPool",
    "same_content",
    "shape_key",
    "solve_all",
    "worth_spawning",
]

# What starting the pool costs before its first solve: a spawned interpreter importing numpy,
# ortools' CP-SAT (which imports pandas) and hlopar's ILP modules, and a problem pickled over.
# Measured (docs/performance.md, "Layer ILPs without fork"): 1.0 to 1.15 CPU seconds per
# worker; twice that in wall seconds leaves room for a loaded machine, so that a pool starts
# only where it clearly pays.
SPAWN_START_SECONDS = 2.0
# A problem of more nodes takes seconds to tens of seconds (GPT-39B's stages on 16 x 8,
# ~15k nodes: 20-30 s each, presolve and CP-SAT), far more than a spawned process's start:
# `solve_all` solves several such side by side.
BIG_PROBLEM_NODES = 10_000


def same_content(a: Problem, b: Problem) -> bool:
    """Whether two problems of one `shape_key` are equal but for their node names (equal
    problems, equal solutions): cost tuple by cost tuple, shared tuples by identity, up to
    the first that differs (the problems of two meshes differ early). Hashing every cost of
    GPT-39B's 400 layer ILPs took longer than the few solves it saved."""
    if a is b:
        return True
    for x, y in zip(a.nodes, b.nodes):
        if not (x.costs is y.costs or x.costs == y.costs) or not (x.memory is y.memory or x.memory == y.memory):
            return False
    return all(x.costs is y.costs or x.costs == y.costs for x, y in zip(a.edges, b.edges))


def shape_key(problem: Problem) -> tuple:
    """What equal problems share besides their costs: strategy counts, followers, fixed
    strategies, edges, budget, live sets. Only problems of one shape can be equal."""
    return (
        tuple((len(node.costs), node.fixed, node.follows) for node in problem.nodes),
        tuple((edge.src, edge.dst) for edge in problem.edges),
        problem.memory_budget,
        problem.live_sets,
    )


def worth_spawning(mean_seconds: float, remaining: int, workers: int) -> bool:
    """Whether `remaining` solves of `mean_seconds` each finish sooner in `workers` spawned
    processes, after `SPAWN_START_SECONDS` of start-up, than one after another here."""
    if workers < 2 or remaining < 2:
        return False
    here = mean_seconds * remaining
    return SPAWN_START_SECONDS + here / min(workers, remaining) < here


@dataclass
class IlpPool:
    """Solves `Problem`s by `ilp.solve(problem, time_limit=..., num_workers=1)`. `submit`
    hands back a callable that gives the solution (blocking until a worker has it); `expected`
    solves still to come, which the rule weighs. Use as a context manager: the workers end
    with it. `solved` counts the distinct problems solved, `spawned` whether a pool started."""

    time_limit: float
    workers: int
    expected: int = 0
    solved: int = 0
    spawned: bool = False
    _known: dict = field(default_factory=dict)  # shape_key -> [(problem, its solution or future)]
    _seconds_here: float = 0.0
    _solved_here: int = 0
    _pool: ProcessPoolExecutor | None = None

    def submit(self, problem: Problem) -> Callable[[], ilp.Solution]:
        self.expected = max(self.expected - 1, 0)
        same_shape = self._known.setdefault(shape_key(problem), [])
        found = next((solution for known, solution in same_shape if same_content(problem, known)), None)
        if found is None:
            self.solved += 1
            found = self._start(problem)
            same_shape.append((problem, found))
        return lambda: self._result(found, problem)

    def _start(self, problem: Problem) -> ilp.Solution | Future:
        if self._pool is None and self._solved_here and not self.spawned:
            mean = self._seconds_here / self._solved_here
            if worth_spawning(mean, self.expected + 1, self.workers):
                self._pool = _spawned(min(self.workers, self.expected + 1))
                self.spawned = True
        if self._pool is not None:
            try:
                return self._pool.submit(_solve, problem, self.time_limit)
            except BrokenProcessPool:
                self._pool = None
        start = time.perf_counter()
        solution = _solve(problem, self.time_limit)
        self._seconds_here += time.perf_counter() - start
        self._solved_here += 1
        return solution

    def _result(self, found: ilp.Solution | Future, problem: Problem) -> ilp.Solution:
        if isinstance(found, ilp.Solution):
            return found
        try:
            return found.result()
        except BrokenProcessPool:  # a worker died (killed, out of memory): solve it here
            return _solve(problem, self.time_limit)

    def __enter__(self) -> IlpPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def solve_all(problems: Sequence[tuple[Problem, float]], *, big_nodes: int = BIG_PROBLEM_NODES) -> list[ilp.Solution]:
    """`ilp.solve(problem, time_limit=limit)` of each (problem, limit), CP-SAT's workers by
    the problem's size. Where two or more are big (more than `big_nodes` nodes), they are
    solved side by side, as many at once as there are cores: all but the first in spawned
    processes, that one here. Where a problem is solved does not change its solution."""
    big = [k for k, (problem, _) in enumerate(problems) if len(problem.nodes) > big_nodes]
    workers = min(len(big) - 1, (os.cpu_count() or 1) - 1)
    if workers < 1:
        return [ilp.solve(problem, time_limit=limit) for problem, limit in problems]
    with _spawned(workers) as pool:
        away = {k: pool.submit(_solve, *problems[k], None) for k in big[1:]}
        out = [
            None if k in away else ilp.solve(problem, time_limit=limit) for k, (problem, limit) in enumerate(problems)
        ]
        for k, future in away.items():
            try:
                out[k] = future.result()
            except BrokenProcessPool:  # a worker died (killed, out of memory): solve it here
                out[k] = ilp.solve(problems[k][0], time_limit=problems[k][1])
    return out


def _spawned(workers: int) -> ProcessPoolExecutor:
    """Spawned (not forked) processes that end with this one."""
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent, initargs=(os.getpid(),)
    )


def _solve(problem: Problem, time_limit: float, num_workers: int | None = 1) -> ilp.Solution:
    return ilp.solve(problem, time_limit=time_limit, num_workers=num_workers)
