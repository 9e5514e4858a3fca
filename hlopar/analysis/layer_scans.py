"""Scans over layers: the `while` loops that run a stack of layers whose parameters are
stacked along a leading layer axis (`jax.lax.scan` over stacked weights, Flax `nn.scan`).

Such a loop runs L times (a static trip count) and reads, among its operands, a function
argument whose leading dim is L and whose slices its body reads (`dynamic_slice`) or writes
(`dynamic_update_slice`): the stacked parameters it slices per iteration. Its
backward twin (the scan JAX's autodiff writes) runs L times too and reads the forward loop's
stacked residuals or the stacked parameters. A `fori_loop` over time steps, whose operands
are not stacked per iteration, is not one.

Pipelining cuts such a stack between layers, so `hlopar-unstack-layer-scans` unrolls these
loops and splits their stacked values into one piece per layer; this module only finds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlopar.analysis.loops import trip_count
from hlopar.ir.graph import FuncGraph

__all__ = ["LayerScan", "layer_scans"]


@dataclass(frozen=True)
class LayerScan:
    """One top-level `while` over layers."""

    op: int  # top-level op index of the while
    trips: int  # L, its static trip count
    stacked: tuple[int, ...]  # operand value ids stacked along the layer axis (leading dim L)


def layer_scans(graph: FuncGraph) -> list[LayerScan]:
    """The top-level loops over layers of `graph`, in program order."""
    found: list[LayerScan] = []
    scan_results: dict[int, int] = {}  # value id -> trip count of the layer scan that makes it
    for node in graph.ops:
        if node.name != "stablehlo.while":
            continue
        trips = trip_count(graph, node)
        if trips < 2:
            continue
        _, (body,) = node.regions
        stacked = tuple(
            v
            for v, inner in zip(node.operands, body.args)
            if _leading(graph, v) == trips
            and (graph.values[v].is_arg or scan_results.get(v) == trips)
            and _indexed(graph, inner)
        )
        if not stacked:
            continue
        found.append(LayerScan(node.index, trips, stacked))
        for v in node.results:
            if _leading(graph, v) == trips:
                scan_results[v] = trips
    return found


def _indexed(graph: FuncGraph, inner: int) -> bool:
    """Whether the loop body reads or writes a slice of a carried value (per iteration)."""
    return any(
        user.name in ("stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice") and user.operands[0] == inner
        for user in graph.direct_users_of(inner)
    )


def _leading(graph: FuncGraph, v: int) -> int | None:
    shape = graph.values[v].shape
    return shape[0] if shape else None
