"""Eq. 1 of the Alpa paper (§4.2) as plain data, and how a plan of it is scored and checked.

`ilp.solve` and `merging.reduce_problem` both read a `Problem`; it lives here so that neither
module has to import the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Node", "Edge", "Problem", "evaluate", "violations"]


@dataclass(frozen=True)
class Node:
    """An op (or a value) with its strategies; costs in seconds, memory in bytes per device."""

    costs: tuple[float, ...]
    memory: tuple[float, ...] = ()
    fixed: int | None = None
    follows: int | None = None
    name: str = ""


@dataclass(frozen=True)
class Edge:
    """Resharding cost from `src`'s output under each of its strategies (rows) to the layout
    `dst` wants under each of its strategies (columns)."""

    src: int
    dst: int
    costs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Problem:
    """Eq. 1 over plain data. `live_sets[p]` lists the nodes whose outputs are live at program
    point `p`; with a `memory_budget` (bytes per device), each must fit in it."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    memory_budget: float | None = None
    live_sets: tuple[tuple[int, ...], ...] = ()


def evaluate(problem: Problem, choices: Sequence[int]) -> float:
    """Eq. 1 for the given strategy of every node (memory and fixed strategies not checked)."""
    total = 0.0
    for node, c in zip(problem.nodes, choices, strict=True):
        total += node.costs[c]
    for edge in problem.edges:
        total += edge.costs[choices[edge.src]][choices[edge.dst]]
    return total


def violations(problem: Problem, choices: Sequence[int]) -> list[str]:
    """What `choices` breaks: fixed strategies, `follows`, the memory budget (empty if none)."""
    found = []
    for v, node in enumerate(problem.nodes):
        if node.fixed is not None and choices[v] != node.fixed:
            found.append(f"node {v} is fixed to {node.fixed}, got {choices[v]}")
        if node.follows is not None and choices[v] != choices[node.follows]:
            found.append(f"node {v} follows node {node.follows} but differs")
    if problem.memory_budget is not None:
        for s, live in enumerate(problem.live_sets):
            used = _live_memory(problem, live, choices)
            if used > problem.memory_budget * (1 + 1e-9):
                found.append(f"live set {s} uses {used:.6g} bytes > budget {problem.memory_budget:.6g}")
    return found


def _live_memory(problem: Problem, live: Sequence[int], choices: Sequence[int]) -> float:
    return sum(problem.nodes[v].memory[choices[v]] for v in sorted(set(live)) if problem.nodes[v].memory)
