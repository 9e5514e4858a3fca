"""Layer ILPs solved once per content, in this process or in spawned workers by the measured
rule of `ilp_pool`, with the same plans either way."""

from __future__ import annotations

import os
from dataclasses import replace

from test_layer_costs import gpt_layers
from tools_module import load_tool

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.cluster import logical_mesh
from hlopar.analysis.auto_sharding.problem import Edge, Node, Problem
from hlopar.analysis.stages import ilp_pool
from hlopar.analysis.stages.ilp_pool import SPAWN_START_SECONDS, IlpPool, worth_spawning
from hlopar.analysis.stages.layer_costs import plan_layers

TWO_NODES = Problem(
    nodes=(Node((1.0, 2.0), name="a"), Node((3.0, 0.5), name="b")),
    edges=(Edge(0, 1, ((0.0, 4.0), (4.0, 0.0))),),
)


def counting(monkeypatch) -> list:
    calls = []
    solve = ilp.solve

    def counted(problem, **kwargs):
        calls.append(problem)
        return solve(problem, **kwargs)

    monkeypatch.setattr(ilp_pool.ilp, "solve", counted)
    return calls


def test_the_rule_spawns_only_where_the_solves_left_outlast_the_start():
    assert not worth_spawning(10.0, 100, workers=1)  # nowhere to go
    assert not worth_spawning(10.0, 1, workers=4)  # one solve: no parallelism
    # Two workers halve the time left: worth it once half of it exceeds the start-up.
    assert not worth_spawning(SPAWN_START_SECONDS / 2, 4, workers=2)  # 2 s here vs 2 + 1 s
    assert worth_spawning(SPAWN_START_SECONDS, 4, workers=2)  # 8 s here vs 2 + 4 s
    assert not worth_spawning(0.05, 20, workers=2)  # a tiny model's ILPs: 1 s here
    assert worth_spawning(0.5, 400, workers=2)  # GPT-39B's on 64 devices


def test_equal_problems_are_solved_once_whatever_their_node_names(monkeypatch):
    calls = counting(monkeypatch)
    renamed = replace(TWO_NODES, nodes=tuple(replace(n, name=n.name + "'") for n in TWO_NODES.nodes))
    costlier = replace(TWO_NODES, nodes=(Node((1.0, 2.0)), Node((3.0, 5.0))))
    with IlpPool(time_limit=10.0, workers=1) as pool:
        got = [pool.submit(p)() for p in (TWO_NODES, renamed, costlier, TWO_NODES)]
    assert len(calls) == 2 and pool.solved == 2 and not pool.spawned
    assert got[0] == got[1] == got[3] == ilp.solve(TWO_NODES)
    assert got[0].choices == (1, 1) and got[0].objective == 2.5  # 2 + 0.5, against 1 + 3 at (0, 0)
    assert got[2].choices == (0, 0) and got[2].objective == 4.0  # 1 + 3, against 2 + 5 at (1, 1)


def test_identical_layers_cost_one_solve(monkeypatch):
    _, _, layers, rules, roles = gpt_layers()
    meshes = [(logical_mesh((1, 2), ("x", "y")), False), (logical_mesh((2, 2), ("x", "y")), True)]
    calls = counting(monkeypatch)
    once = plan_layers(layers[1:3], rules, roles, meshes, workers=1)
    solves = len(calls)
    calls.clear()
    repeated = plan_layers([layers[1], layers[2], layers[1], layers[2], layers[1]], rules, roles, meshes, workers=1)
    assert len(calls) == solves == once.solved == repeated.solved
    rows = [tuple(map(_plain, row)) for row in (*repeated.plans, *once.plans)]
    assert rows[0] == rows[2] == rows[4] == rows[5]
    assert rows[1] == rows[3] == rows[6]


def test_spawned_workers_give_the_same_table(monkeypatch):
    _, _, layers, rules, roles = gpt_layers()
    meshes = [(logical_mesh(shape, ("x", "y")), split) for shape in ((1, 2), (2, 2)) for split in (False, True)]
    here = plan_layers(layers, rules, roles, meshes, workers=2)  # a tiny GPT: not worth a process
    monkeypatch.setattr(ilp_pool, "SPAWN_START_SECONDS", 0.0)  # any parallelism pays
    spawned_pools = []
    monkeypatch.setattr(ilp_pool.IlpPool, "__exit__", _recording(ilp_pool.IlpPool.__exit__, spawned_pools))
    spawned = plan_layers(layers, rules, roles, meshes, workers=2)
    assert spawned_pools == [True]
    assert [[_plain(p) for p in row] for row in here.plans] == [[_plain(p) for p in row] for row in spawned.plans]
    assert here.solved == spawned.solved


def _recording(exit_, record: list):
    def recorded(self, *exc):
        record.append(self.spawned)
        return exit_(self, *exc)

    return recorded


def _plain(plan):
    return replace(plan, solve_seconds=0.0)


def test_big_problems_are_solved_side_by_side_with_the_same_solutions(monkeypatch):
    bench_ilp = load_tool("bench_ilp")
    problems = [(bench_ilp.gpt_like_problem(layers, (2, 4)), 60.0) for layers in (1, 2, 1)]
    alone = [ilp.solve(problem, time_limit=limit) for problem, limit in problems]
    assert ilp_pool.solve_all(problems) == alone  # none above BIG_PROBLEM_NODES: all here
    started = []
    pool = ilp_pool.ProcessPoolExecutor
    monkeypatch.setattr(ilp_pool, "ProcessPoolExecutor", lambda *a, **k: started.append(a[0]) or pool(*a, **k))
    together = ilp_pool.solve_all(problems, big_nodes=10)
    cores = os.cpu_count() or 1
    assert started == ([min(2, cores - 1)] if cores > 1 else [])  # the first here, the others away
    assert together == alone
    assert [s.status for s in together] == ["OPTIMAL"] * 3
