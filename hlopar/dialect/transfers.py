"""hlopar's cross-mesh transfer ops in the IR: writing a plan as ops, and reading it back.

One `hlopar.cross_mesh_transfer` op replaces an inter-mesh `mpmd.transfer`: same operand,
same result, plan-level attributes, and a region holding one op per unit task in slot
order (`hlopar.broadcast`, `hlopar.send_recv` or `hlopar.scatter_allgather`). All are in
generic form in the unregistered `hlopar` dialect; `docs/ir.md` documents them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.resharding.plan import TransferPlan
from hlopar.analysis.resharding.simulator import UnitOp
from hlopar.analysis.resharding.unit_tasks import box_bytes
from hlopar.analysis.sharding import TensorSharding
from hlopar.dialect.attributes import BROADCAST_OP, CROSS_MESH_TRANSFER, SCATTER_ALLGATHER_OP, SEND_RECV_OP
from hlopar.ir.diagnostics import DiagnosticError, error_at

__all__ = ["OP_NAMES", "DecodedTransfer", "argument_sharding", "build_transfer_op", "read_transfer_op"]

OP_NAMES = {
    "broadcast": BROADCAST_OP,
    "send_recv": SEND_RECV_OP,
    "scatter_allgather": SCATTER_ALLGATHER_OP,
}
_KINDS = {name: kind for kind, name in OP_NAMES.items()}


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


def build_transfer_op(plan: TransferPlan, transfer: ir.Operation) -> ir.Operation:
    """Inserts the plan's container op before `transfer`, takes over its uses, erases it."""
    with transfer.location, ir.InsertionPoint(transfer):
        container = ir.Operation.create(
            CROSS_MESH_TRANSFER,
            results=[transfer.results[0].type],
            operands=[transfer.operands[0]],
            attributes={
                "strategy": ir.StringAttr.get(plan.strategy),
                "algorithm": ir.StringAttr.get(plan.algorithm),
                "predicted_time": ir.FloatAttr.get_f64(plan.predicted_time),
                "lower_bound": ir.FloatAttr.get_f64(plan.lower_bound),
            },
            regions=1,
        )
        block = container.regions[0].blocks.append()
        with ir.InsertionPoint(block):
            for planned in plan.ops:
                ir.Operation.create(OP_NAMES[planned.op.kind], attributes=_unit_op_attributes(planned.op, planned.slot))
    transfer.results[0].replace_all_uses_with(container.results[0])
    transfer.erase()
    return container


@dataclass(frozen=True)
class DecodedTransfer:
    """A `hlopar.cross_mesh_transfer` read back: its unit ops in slot order and its attributes."""

    ops: tuple[UnitOp, ...]
    strategy: str
    algorithm: str
    predicted_time: float
    lower_bound: float


def read_transfer_op(container: ir.Operation, dtype_bytes: int) -> DecodedTransfer:
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
    return DecodedTransfer(tuple(ops), strategy, algorithm, predicted, bound)


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


def argument_sharding(value: ir.Value) -> TensorSharding | None:
    """The `sdy.sharding` argument attribute of a function argument, when the value is one:
    where a transfer's source lives when its type says nothing (an argument of `@main`)."""
    if not isinstance(value, ir.BlockArgument):
        return None
    parent = value.owner.owner
    parent = parent.operation if parent is not None else None
    if parent is None or parent.name != "func.func" or "arg_attrs" not in parent.attributes:
        return None
    attrs = ir.DictAttr(ir.ArrayAttr(parent.attributes["arg_attrs"])[value.arg_number])
    return TensorSharding.parse(str(attrs["sdy.sharding"])) if "sdy.sharding" in attrs else None
