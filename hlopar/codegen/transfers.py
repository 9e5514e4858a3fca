"""A `hlopar.cross_mesh_transfer` read back as plain data, for a runtime to carry out.

`hlopar-cross-mesh-resharding` writes each inter-mesh transfer as a container op holding
one unit op per unit task (`docs/ir.md`). `planned_transfer` decodes one: its unit ops in
slot order, the tensor's global shape, and the source and destination layouts (the
layouts of its operand and result types, replicated where a type has none, on the
physical devices of their meshes), with the plan's predicted time. Runtimes execute it
(`hlopar.runtime.local_transfer.run_planned_transfer`); the pipeline simulator prices the
transfer with `predicted_time`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.mpmd import MeshTensorType, argument_sharding
from hlopar.analysis.resharding.unit_tasks import MeshLayout
from hlopar.analysis.sharding import ShardingSpec
from hlopar.dialect.attributes import CROSS_MESH_TRANSFER
from hlopar.dialect.transfers import UnitOp, read_transfer_op
from hlopar.ir.graph import bit_width

__all__ = ["PlannedTransfer", "planned_transfer"]


@dataclass(frozen=True)
class PlannedTransfer:
    """One planned cross-mesh transfer: its unit ops in slot order and both layouts."""

    shape: tuple[int, ...]
    ops: tuple[UnitOp, ...]
    src: MeshLayout
    dst: MeshLayout
    strategy: str
    predicted_time: float  # seconds, under the cluster model of the pass that planned it


def planned_transfer(
    op: ir.Operation, topology: Mapping[str, DeviceMesh], physical: Mapping[str, tuple[int, ...]]
) -> PlannedTransfer:
    """Decodes a `hlopar.cross_mesh_transfer` of a function with `topology`; `physical` gives
    each mesh's physical device ids (`fragments.program_devices`). Raises `ValueError` for a
    mesh outside the topology and `DiagnosticError` for malformed unit ops."""
    layouts = []
    tensor = None
    for value in (op.operands[0], op.results[0]):
        type_ = MeshTensorType.parse(str(value.type))
        if type_.mesh_name not in topology:
            raise ValueError(f"'{CROSS_MESH_TRANSFER}' names mesh '{type_.mesh_name}', which is not in the topology")
        tensor = ir.RankedTensorType(ir.Type.parse(type_.tensor_type, context=value.type.context))
        sharding = type_.sharding or argument_sharding(value) or ShardingSpec.replicated(len(tensor.shape))
        layouts.append(MeshLayout(topology[type_.mesh_name], sharding, physical[type_.mesh_name]))
    width = bit_width(tensor.element_type)
    if width is None:
        raise ValueError(f"'{CROSS_MESH_TRANSFER}': cannot size elements of {tensor}")
    decoded = read_transfer_op(op, (width + 7) // 8)
    return PlannedTransfer(
        tuple(tensor.shape), decoded.ops, layouts[0], layouts[1], decoded.strategy, decoded.predicted_time
    )
