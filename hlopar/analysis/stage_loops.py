"""Plain data and pure decisions of re-rolling stage loops (`hlopar-reroll-stage-loops`):
which runs of iterations are identical, which layer ranges a mesh holds as one value, and
what became of each run and range (the pass's report)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HeldRange", "LoopRange", "disjoint_ranges", "identical_runs"]


@dataclass(frozen=True)
class LoopRange:
    """What became of one run of iterations of one unrolled loop inside one fragment."""

    fragment: str  # the fragment's origin, e.g. stage0, stage0(1)
    loop: int  # the loop's number among the unrolled ones (0: the first scan, often the forward)
    first: int  # its first iteration
    trips: int  # how many iterations
    layers: tuple[int, ...]  # the layer each iteration reads (-1: none)
    rolled: bool
    reason: str = ""  # why it stays unrolled


@dataclass(frozen=True)
class HeldRange:
    """Rows `first:first+rows` of stacked parameters/state a mesh holds as one value."""

    mesh: str
    first: int
    rows: int
    arguments: int  # @main arguments made of `rows` pieces each
    results: int  # @main results likewise


def identical_runs(keys: dict[int, object], min_trips: int) -> list[tuple[int, int]]:
    """Maximal runs `(first, trips)` of consecutive iterations with equal keys, of at least
    `min_trips` iterations. `keys`: iteration -> its structure."""
    runs: list[tuple[int, int]] = []
    for iteration in sorted(keys):
        if runs and iteration == runs[-1][0] + runs[-1][1] and keys[iteration] == keys[runs[-1][0]]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((iteration, 1))
    return [r for r in runs if r[1] >= min_trips]


def disjoint_ranges(candidates: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint layer ranges `[a, b)` from `candidates`, the longest first (then the lowest),
    in order."""
    chosen: list[tuple[int, int]] = []
    for a, b in sorted(candidates, key=lambda r: (r[0] - r[1], r[0])):
        if all(b <= c or d <= a for c, d in chosen):
            chosen.append((a, b))
    return sorted(chosen)
