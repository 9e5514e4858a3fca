"""MPMD programs in the IR: fragments, their roles, and the meshes' physical devices.

hlopar writes a pipeline in Shardy's `mpmd` dialect (docs/ir.md): a `topology` on the
function, one `mpmd.fragment` per (stage, role) whose `origin` says its role, values
crossing meshes through `mpmd.transfer`, and `hlopar.devices` on the module for each
mesh's physical devices. Every pass, codegen step and runtime that matches, builds or
reads those goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import mpmd

from hlopar.dialect.attributes import BACKWARD, DEVICES_ATTR, FORWARD, UPDATE

__all__ = [
    "FRAGMENT",
    "TOPOLOGY_ATTR",
    "TRANSFER",
    "build_fragment",
    "fragment_mesh",
    "fragment_origin",
    "fragment_role",
    "fragment_stage",
    "fragments",
    "is_fragment",
    "read_devices",
    "reshaped_fragment",
    "write_devices",
]

FRAGMENT = "mpmd.fragment"
TRANSFER = "mpmd.transfer"
TOPOLOGY_ATTR = "topology"  # on an MPMD function: `#mpmd.topology<...>`, its meshes


def is_fragment(op: ir.Operation) -> bool:
    return op.name == FRAGMENT


def fragments(func: ir.Operation) -> list[ir.Operation]:
    """The top-level fragments of a function, in program order."""
    return [op.operation for op in func.regions[0].blocks[0].operations if op.operation.name == FRAGMENT]


def fragment_role(fragment: ir.Operation) -> str:
    """The role of a fragment hlopar wrote, read back from its origin (`fragment_origin`)."""
    origin = str(fragment.attributes["origin"])
    # `"stage<k>"` forward, `"stage<k>"(1)` backward (a transpose count), `"stage<k>_update"`.
    return UPDATE if '_update"' in origin else BACKWARD if '"(' in origin else FORWARD


def fragment_origin(stage: int, role: str) -> ir.Attribute:
    """The `origin` of stage `stage`'s fragment of `role`: forward and backward share the
    stage's name (backward is its transpose), the update is a name of its own."""
    name, transpose = {
        FORWARD: (f"stage{stage}", 0),
        BACKWARD: (f"stage{stage}", 1),
        UPDATE: (f"stage{stage}_update", 0),
    }[role]
    return ir.ArrayAttr.get([mpmd.UserOriginAttr.get(name, transpose)])


def build_fragment(
    result_types: Sequence[ir.Type], operands: Sequence[ir.Value], stage: int, role: str, mesh_name: str
) -> mpmd.FragmentOp:
    """An empty `mpmd.fragment` of `role` for stage `stage` on `mesh_name`, at the current
    insertion point (updates carry no stage id: Shardy allows one fragment per mesh, stage
    and transpose count)."""
    return mpmd.FragmentOp(
        list(result_types),
        list(operands),
        fragment_origin(stage, role),
        mesh_name,
        stage_id=None if role == UPDATE else stage,
    )


def fragment_stage(fragment: ir.Operation) -> int | None:
    """The stage id of a fragment; None for an update fragment (it has none)."""
    return ir.IntegerAttr(fragment.attributes["stage_id"]).value if "stage_id" in fragment.attributes else None


def fragment_mesh(fragment: ir.Operation) -> str:
    """The name of the topology mesh a fragment runs on."""
    return ir.StringAttr(fragment.attributes["mesh_name"]).value


def reshaped_fragment(
    fragment: ir.Operation, result_types: Sequence[ir.Type], operands: Sequence[ir.Value]
) -> ir.Operation:
    """A fragment with `fragment`'s attributes (origin, mesh, stage and hlopar's own) but other
    operands and results, before it, with one empty region for the caller to fill."""
    return ir.Operation.create(
        FRAGMENT,
        results=list(result_types),
        operands=list(operands),
        attributes={
            named.name: named.attr for named in map(fragment.attributes.__getitem__, range(len(fragment.attributes)))
        },
        regions=1,
        loc=fragment.location,
        ip=ir.InsertionPoint(fragment),
    )


def read_devices(module: ir.Operation) -> dict[str, tuple[int, ...]] | None:
    """`hlopar.devices`: each mesh's physical device ids, in logical order; None without it.
    `ValueError` when it is not a dictionary of `array<i64>`."""
    if DEVICES_ATTR not in module.attributes:
        return None
    attr = module.attributes[DEVICES_ATTR]
    if not isinstance(attr, ir.DictAttr):
        raise ValueError(f"'{DEVICES_ATTR}' must map mesh names to array<i64: ...>, got {attr}")
    devices = {}
    for i in range(len(attr)):
        entry = attr[i]
        if not isinstance(entry.attr, ir.DenseI64ArrayAttr):
            raise ValueError(f"'{DEVICES_ATTR}' entry '{entry.name}' must be an array<i64: ...>, got {entry.attr}")
        devices[entry.name] = tuple(entry.attr)
    return devices


def write_devices(module: ir.Operation, devices: Mapping[str, Sequence[int]]) -> None:
    """Sets `hlopar.devices` to each mesh's physical device ids."""
    module.attributes[DEVICES_ATTR] = ir.DictAttr.get(
        {name: ir.DenseI64ArrayAttr.get([int(d) for d in ids]) for name, ids in devices.items()}, module.context
    )
