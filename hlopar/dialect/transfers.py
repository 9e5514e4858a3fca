"""hlopar's cross-mesh transfer ops in the IR: the unit ops they encode, writing them, reading them back.

One `hlopar.cross_mesh_transfer` op replaces an inter-mesh `mpmd.transfer`: same operand,
same result, plan-level attributes, and a region holding one op per unit task in slot
order (`hlopar.broadcast`, `hlopar.send_recv` or `hlopar.scatter_allgather`). All are in
generic form in the unregistered `hlopar` dialect; `docs/ir.md` documents them.

`UnitOp` (and its `Box`) is the plain record one such op encodes: the resharding planner
(`analysis/resharding/`) makes them, codegen and the runtime carry them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from jaxlib.mlir import ir

from hlopar.dialect.attributes import BROADCAST_OP, CROSS_MESH_TRANSFER, SCATTER_ALLGATHER_OP, SEND_RECV_OP
from hlopar.ir.diagnostics import DiagnosticError, error_at

__all__ = [
    "OP_KINDS",
    "OP_NAMES",
    "Box",
    "TransferOps",
    "UnitOp",
    "box_bytes",
    "box_elements",
    "build_transfer_op",
    "read_transfer_op",
]

# A box of a tensor: per dimension the half-open range [start, stop).
Box = tuple[tuple[int, int], ...]


def box_elements(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def box_bytes(box: Box, dtype_bytes: int) -> int:
    return box_elements(box) * dtype_bytes


# The unit op kinds and the op that encodes each.
OP_NAMES = {
    "broadcast": BROADCAST_OP,
    "send_recv": SEND_RECV_OP,
    "scatter_allgather": SCATTER_ALLGATHER_OP,
}
OpKind = Literal["broadcast", "send_recv", "scatter_allgather"]
OP_KINDS: tuple[str, ...] = tuple(OP_NAMES)
_KINDS = {name: kind for kind, name in OP_NAMES.items()}


@dataclass(frozen=True)
class UnitOp:
    """How one unit task is carried out: which box of the tensor, from where, to where.

    - `broadcast`: the box, cut into `chunks` parts, flows down the chain sender → receivers[0]
      → receivers[1] → ..., each device forwarding a part as soon as it has it (§3.1).
    - `send_recv`: the sender sends the whole box to each receiver in turn.
    - `scatter_allgather` (Alpa's local all-gather, Alpa §6): the box is cut into one part per
      receiver along `split_dim`, part i goes to receivers[i], then the receivers all-gather
      over a ring in their listed order.
    """

    task: int
    kind: OpKind
    sender: int
    receivers: tuple[int, ...]
    box: Box
    nbytes: int
    chunks: int = 1
    split_dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown unit op kind {self.kind!r} (one of {', '.join(OP_KINDS)})")
        if not self.receivers:
            raise ValueError(f"unit op of task {self.task} has no receivers")
        if self.chunks < 1:
            raise ValueError(f"chunks must be positive, got {self.chunks}")
        if self.sender in self.receivers or len(set(self.receivers)) != len(self.receivers):
            raise ValueError(
                f"unit op of task {self.task}: sender {self.sender} and receivers "
                f"{list(self.receivers)} must be distinct devices"
            )
        if self.kind == "scatter_allgather":
            if self.split_dim is None or not 0 <= self.split_dim < len(self.box):
                raise ValueError(
                    f"unit op of task {self.task}: split_dim {self.split_dim} is not a dimension of the box"
                )
            lo, hi = self.box[self.split_dim]
            if (hi - lo) % len(self.receivers):
                raise ValueError(
                    f"unit op of task {self.task}: {len(self.receivers)} receivers do not divide "
                    f"dimension {self.split_dim} of the box ({hi - lo} elements)"
                )


@dataclass(frozen=True)
class TransferOps:
    """What one `hlopar.cross_mesh_transfer` holds: its unit ops in slot order (op i has slot
    i) and the plan's attributes. Written by `build_transfer_op`, read by `read_transfer_op`."""

    ops: tuple[UnitOp, ...]
    strategy: str
    algorithm: str
    predicted_time: float
    lower_bound: float


def _i64(value: int) -> ir.Attribute:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), int(value))


def _unit_op_attributes(op: UnitOp, slot: int) -> dict[str, ir.Attribute]:
    attributes = {
        "start": ir.DenseI64ArrayAttr.get([lo for lo, _ in op.box]),
        "limit": ir.DenseI64ArrayAttr.get([hi for _, hi in op.box]),
        "sender": _i64(op.sender),
        "receivers": ir.DenseI64ArrayAttr.get(list(op.receivers)),
        "slot": _i64(slot),
    }
    if op.kind == "broadcast":
        attributes["chunks"] = _i64(op.chunks)
    if op.kind == "scatter_allgather":
        attributes["split_dim"] = _i64(op.split_dim)
    return attributes


def build_transfer_op(planned: TransferOps, transfer: ir.Operation) -> ir.Operation:
    """Inserts the container op of `planned` before `transfer`, takes over its uses, erases it."""
    with transfer.location, ir.InsertionPoint(transfer):
        container = ir.Operation.create(
            CROSS_MESH_TRANSFER,
            results=[transfer.results[0].type],
            operands=[transfer.operands[0]],
            attributes={
                "strategy": ir.StringAttr.get(planned.strategy),
                "algorithm": ir.StringAttr.get(planned.algorithm),
                "predicted_time": ir.FloatAttr.get_f64(planned.predicted_time),
                "lower_bound": ir.FloatAttr.get_f64(planned.lower_bound),
            },
            regions=1,
        )
        block = container.regions[0].blocks.append()
        with ir.InsertionPoint(block):
            for slot, op in enumerate(planned.ops):
                ir.Operation.create(OP_NAMES[op.kind], attributes=_unit_op_attributes(op, slot))
    transfer.results[0].replace_all_uses_with(container.results[0])
    transfer.erase()
    return container


def read_transfer_op(container: ir.Operation, dtype_bytes: int) -> TransferOps:
    """Decodes a container op; raises `DiagnosticError` at the offending op if malformed."""
    if container.name != CROSS_MESH_TRANSFER:
        raise DiagnosticError([error_at(container, f"expected '{CROSS_MESH_TRANSFER}', found '{container.name}'")])
    attrs = container.attributes
    try:
        strategy = ir.StringAttr(attrs["strategy"]).value
        algorithm = ir.StringAttr(attrs["algorithm"]).value
        predicted = ir.FloatAttr(attrs["predicted_time"]).value
        bound = ir.FloatAttr(attrs["lower_bound"]).value
    except (KeyError, ValueError) as error:
        raise DiagnosticError(
            [
                error_at(
                    container,
                    f"'{CROSS_MESH_TRANSFER}' needs strategy, algorithm, predicted_time and lower_bound attributes ({error})",
                )
            ]
        ) from None
    ops = []
    blocks = list(container.regions[0].blocks) if len(container.regions) == 1 else []
    for slot, op in enumerate(op.operation for block in blocks for op in block.operations):
        ops.append(_read_unit_op(op, slot, dtype_bytes))
    return TransferOps(tuple(ops), strategy, algorithm, predicted, bound)


def _read_unit_op(op: ir.Operation, slot: int, dtype_bytes: int) -> UnitOp:
    kind = _KINDS.get(op.name)
    if kind is None:
        raise DiagnosticError(
            [
                error_at(
                    op,
                    f"unexpected '{op.name}' in '{CROSS_MESH_TRANSFER}' (expected one of {', '.join(sorted(_KINDS))})",
                )
            ]
        )
    attrs = op.attributes
    try:
        start = list(ir.DenseI64ArrayAttr(attrs["start"]))
        limit = list(ir.DenseI64ArrayAttr(attrs["limit"]))
        sender = ir.IntegerAttr(attrs["sender"]).value
        receivers = tuple(ir.DenseI64ArrayAttr(attrs["receivers"]))
        written_slot = ir.IntegerAttr(attrs["slot"]).value
        chunks = ir.IntegerAttr(attrs["chunks"]).value if kind == "broadcast" else 1
        split = ir.IntegerAttr(attrs["split_dim"]).value if kind == "scatter_allgather" else None
    except (KeyError, ValueError) as error:
        raise DiagnosticError([error_at(op, f"'{op.name}' has a missing or malformed attribute ({error})")]) from None
    if written_slot != slot:
        raise DiagnosticError([error_at(op, f"'{op.name}' has slot {written_slot} but is op {slot} of its transfer")])
    if len(start) != len(limit) or any(lo >= hi for lo, hi in zip(start, limit)):
        raise DiagnosticError([error_at(op, f"'{op.name}' has an empty or malformed box {start} .. {limit}")])
    box = tuple(zip(start, limit))
    try:
        return UnitOp(slot, kind, sender, receivers, box, box_bytes(box, dtype_bytes), chunks, split)
    except ValueError as error:
        raise DiagnosticError([error_at(op, str(error))]) from None
