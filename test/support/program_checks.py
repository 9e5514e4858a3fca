"""What every MPMD program hlopar writes must satisfy, checked on its text and IR."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxlib.mlir import ir

from hlopar.analysis.mpmd import MeshTensorType
from hlopar.ir.module import parse_module, print_module

HLOPAR_OPT = Path(sys.executable).parent / "hlopar-opt"


@dataclass(frozen=True)
class Fragment:
    mesh: str
    origin: str  # printed, e.g. `["stage0"(1)]`
    stage: int | None
    num_ops: int


def main_func(module: ir.Operation) -> ir.Operation:
    return next(
        op.operation
        for op in module.regions[0].blocks[0].operations
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main"
    )


def top_level_ops(module: ir.Operation) -> list[ir.Operation]:
    return [op.operation for op in main_func(module).regions[0].blocks[0].operations]


def fragments(module: ir.Operation) -> list[Fragment]:
    found = []
    for op in top_level_ops(module):
        if op.name == "mpmd.fragment":
            stage = int(ir.IntegerAttr(op.attributes["stage_id"]).value) if "stage_id" in op.attributes else None
            origin = str(op.attributes["origin"])
            found.append(
                Fragment(
                    ir.StringAttr(op.attributes["mesh_name"]).value,
                    origin,
                    stage,
                    len(list(op.regions[0].blocks[0].operations)) - 1,
                )
            )
    return found


def mesh_of(value: ir.Value) -> str:
    return MeshTensorType.parse(str(value.type)).mesh_name


TRANSFERS = ("mpmd.transfer",)
# What hlopar-cross-mesh-resharding leaves in place of an inter-mesh transfer.
PLANNED_TRANSFERS = ("mpmd.transfer", "hlopar.cross_mesh_transfer")


def check_program(module: ir.Operation, tmp_path: Path, transfers: tuple[str, ...] = TRANSFERS) -> str:
    """Verifies, round-trips and passes through hlopar-opt unchanged; every value a fragment
    reads lives on its mesh, every transfer (an op named in `transfers`) crosses meshes,
    forward and backward of a stage share a mesh. Returns the text."""
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    path = tmp_path / "program.mlir"
    path.write_text(text)
    proc = subprocess.run([str(HLOPAR_OPT), str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == text.rstrip("\n")

    for op in top_level_ops(module):
        if op.name == "mpmd.fragment":
            mesh = ir.StringAttr(op.attributes["mesh_name"]).value
            assert all(mesh_of(v) == mesh for v in (*op.operands, *op.results))
        elif op.name in transfers:
            assert mesh_of(op.operands[0]) != mesh_of(op.results[0]), "a transfer within one mesh"
        else:
            assert op.name == "func.return", f"unexpected top-level op {op.name}"
    stage_mesh: dict[str, str] = {}
    for fragment in fragments(module):
        name = re.search(r'"(stage\d+)', fragment.origin).group(1)
        assert stage_mesh.setdefault(name, fragment.mesh) == fragment.mesh, f"{name} is on two meshes"
    return text


def crossings(module: ir.Operation) -> list[tuple[str, str, str]]:
    """(producing op, source mesh, reading mesh) for every fragment operand that is neither
    an argument nor a fragment result on the reading fragment's mesh: each should be a
    transfer from another mesh."""
    found = []
    for op in top_level_ops(module):
        if op.name != "mpmd.fragment":
            continue
        mesh = ir.StringAttr(op.attributes["mesh_name"]).value
        for value in op.operands:
            if isinstance(value, ir.BlockArgument):
                producer, source = "argument", mesh_of(value)
            elif value.owner.name == "mpmd.fragment":
                producer, source = "mpmd.fragment", ir.StringAttr(value.owner.attributes["mesh_name"]).value
            else:
                producer, source = value.owner.name, mesh_of(value.owner.operands[0])
            if producer in ("argument", "mpmd.fragment") and source == mesh:
                continue
            found.append((producer, source, mesh))
    return found
