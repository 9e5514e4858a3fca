"""The `sdy.mesh` symbols of a module, read into `DeviceMesh`es."""

from __future__ import annotations

from jaxlib.mlir import ir

from hlopar.analysis.mesh import DeviceMesh


def module_meshes(module: ir.Operation) -> dict[str, DeviceMesh | None]:
    """Every `sdy.mesh` symbol by name, in module order; None for a mesh the model cannot read."""
    found: dict[str, DeviceMesh | None] = {}
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh":
            name = ir.StringAttr(op.operation.attributes["sym_name"]).value
            try:
                found[name] = DeviceMesh.from_sdy(str(op.operation.attributes["mesh"]))
            except ValueError:
                found[name] = None
    return found
