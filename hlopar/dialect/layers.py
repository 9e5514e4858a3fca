"""Layers in the IR: the layering of a step's ops and the pieces of unstacked layer stacks.

`hlopar-cluster-operators` writes each top-level op's layer and role (`hlopar.layer`,
`hlopar.role`), which `hlopar-stage-construction` reads (`Layering`); an unstacked
`@main` says how its signature maps to the step's (`hlopar.layer_pieces`, `LayerPieces`),
which the API and the runtimes read to cut arguments and join results (docs/ir.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from jaxlib.mlir import ir

from hlopar.dialect.attributes import LAYER_ATTR, LAYER_PIECES_ATTR, ROLE_ATTR
from hlopar.ir.graph import FuncGraph

__all__ = ["LayerPieces", "Layering", "read_layering", "strip_layering", "write_layering"]


@dataclass(frozen=True)
class Layering:
    """What clustering decided for one function: per top-level op its layer and role."""

    layers: tuple[int, ...]
    roles: tuple[str, ...]
    num_layers: int
    loss_result: int | None


def write_layering(graph: FuncGraph, layering: Layering) -> None:
    """`hlopar.layer` and `hlopar.role` on every top-level op of the graph."""
    i64 = ir.IntegerType.get_signless(64)
    for op, layer, role in zip(graph.ops, layering.layers, layering.roles):
        op.mlir_op.attributes[LAYER_ATTR] = ir.IntegerAttr.get(i64, layer)
        op.mlir_op.attributes[ROLE_ATTR] = ir.StringAttr.get(role)


def read_layering(graph: FuncGraph) -> Layering | None:
    """The layering `hlopar-cluster-operators` wrote, or None when the ops carry none (or some lack it)."""
    layers, roles = [], []
    for op in graph.ops:
        attributes = op.mlir_op.attributes
        if LAYER_ATTR not in attributes or ROLE_ATTR not in attributes:
            return None
        layers.append(ir.IntegerAttr(attributes[LAYER_ATTR]).value)
        roles.append(ir.StringAttr(attributes[ROLE_ATTR]).value)
    if not layers:
        return None
    return Layering(tuple(layers), tuple(roles), max(layers) + 1, None)


def strip_layering(func: ir.Operation) -> None:
    """Removes the attributes (once stages are built they have served)."""

    def visit(op: ir.Operation) -> ir.WalkResult:
        for name in (LAYER_ATTR, ROLE_ATTR):
            if name in op.attributes:
                del op.attributes[name]
        return ir.WalkResult.ADVANCE

    func.walk(visit)


@dataclass(frozen=True)
class LayerPieces:
    """How an unstacked `@main`'s signature relates to the step's own: per argument and
    result of `@main`, the number of the original one it is (piece -1) or a piece of
    (piece p, rows r: rows p:p+r of the original's leading layer axis). This pass makes
    pieces of one row; `hlopar-reroll-stage-loops` joins the pieces of the layers a stage
    runs as one loop into one range (rows 1 where `arg_rows`/`result_rows` are not given,
    as in plans made before ranges)."""

    arg_origin: tuple[int, ...]
    arg_piece: tuple[int, ...]
    result_origin: tuple[int, ...]
    result_piece: tuple[int, ...]
    arg_rows: tuple[int, ...] = ()
    result_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for rows, piece in (("arg_rows", self.arg_piece), ("result_rows", self.result_piece)):
            if not getattr(self, rows):
                object.__setattr__(self, rows, tuple(1 for _ in piece))

    @classmethod
    def of(cls, main: ir.Operation) -> LayerPieces | None:
        if LAYER_PIECES_ATTR not in main.attributes:
            return None
        attrs = {a.name: tuple(ir.DenseI64ArrayAttr(a.attr)) for a in ir.DictAttr(main.attributes[LAYER_PIECES_ATTR])}
        return cls(**attrs)

    def attribute(self) -> ir.Attribute:
        """`hlopar.layer_pieces` (docs/ir.md)."""
        return ir.DictAttr.get({k: ir.DenseI64ArrayAttr.get(list(v)) for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, data: dict | None) -> LayerPieces | None:
        return cls(**{k: tuple(v) for k, v in data.items()}) if data else None

    def to_json(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}

    def split(self, arguments: Sequence) -> list:
        """`@main`'s arguments from the step's own."""
        return [
            arguments[o] if p < 0 else arguments[o][p : p + r]
            for o, p, r in zip(self.arg_origin, self.arg_piece, self.arg_rows)
        ]

    def join(self, results: Sequence, concatenate: Callable = np.concatenate) -> list:
        """The step's results from `@main`'s: the pieces of each split one concatenated in order."""
        joined: dict[int, list] = {}
        for value, origin in zip(results, self.result_origin):
            joined.setdefault(origin, []).append(value)
        return [parts[0] if len(parts) == 1 else concatenate(parts) for _, parts in sorted(joined.items())]

    def resident(self, resident: dict[int, int]) -> dict[int, int]:
        """`{argument: result}` of values kept on the workers, from the step's numbering to
        `@main`'s (a piece is kept where the result is cut into the same rows)."""
        result_at = {key: k for k, key in enumerate(zip(self.result_origin, self.result_piece, self.result_rows))}
        found = {}
        for k, (o, p, r) in enumerate(zip(self.arg_origin, self.arg_piece, self.arg_rows)):
            if o in resident and (resident[o], p, r) in result_at:
                found[k] = result_at[(resident[o], p, r)]
        return found

    def arguments_of(self, originals: Iterable[int]) -> tuple[int, ...]:
        """The numbers of `@main`'s arguments that are (pieces of) the given original ones."""
        wanted = set(originals)
        return tuple(k for k, o in enumerate(self.arg_origin) if o in wanted)

    @property
    def layers(self) -> int:
        """The length of the stacks' layer axis."""
        return max(p + r for p, r in zip(self.arg_piece, self.arg_rows))
