"""Shardy's `mpmd` attribute and type text, as plain data: topologies and mesh tensors.

jaxlib's Python bindings have no accessors for `#mpmd.topology` or `!mpmd.mesh_tensor`,
so hlopar reads their printed form (which jaxlib prints canonically):

    #mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m2" : <["x"=3]>>>
    !mpmd.mesh_tensor<"m1", tensor<12x16xf32>, sharding=<@mesh, [{"x"}, {?}]>, memory_kind="...">

A mesh tensor's sharding names a placeholder mesh symbol; its axes are those of the
topology mesh the type names. Where the type has none, an argument of `@main` may carry
it as its `sdy.sharding` argument attribute (`argument_sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.mesh import DeviceMesh, _Cursor, parse_mesh_body
from hlopar.analysis.sharding import TensorSharding

__all__ = ["MeshTensorType", "argument_sharding", "parse_topology"]


def parse_topology(text: str) -> dict[str, DeviceMesh]:
    """The meshes of a `#mpmd.topology<...>` attribute, by name, in their order."""
    cursor = _Cursor(text, "mpmd topology")
    cursor.accept("#mpmd.topology")
    cursor.expect("<")
    meshes: dict[str, DeviceMesh] = {}
    while True:
        cursor.expect("<")
        name = cursor.string()
        cursor.expect(":")
        if name in meshes:
            raise cursor.fail(f"mesh {name!r} appears twice")
        meshes[name] = parse_mesh_body(cursor)
        cursor.expect(">")
        if cursor.accept(">"):
            break
        cursor.expect(",")
    cursor.expect_end()
    return meshes


@dataclass(frozen=True)
class MeshTensorType:
    """`!mpmd.mesh_tensor<"mesh", tensor<...>, sharding=<...>>`: a tensor living on one mesh."""

    mesh_name: str
    tensor_type: str  # the `tensor<...>` text
    sharding: TensorSharding | None
    memory_kind: str | None = None

    @classmethod
    def parse(cls, text: str) -> MeshTensorType:
        cursor = _Cursor(text, "mpmd mesh tensor type")
        cursor.accept("!mpmd.mesh_tensor")
        cursor.expect("<")
        name = cursor.string()
        cursor.expect(",")
        tensor = _balanced(cursor)
        sharding = memory_kind = None
        while cursor.accept(","):
            key = cursor.word()
            cursor.expect("=")
            if key == "sharding" and sharding is None:
                sharding = TensorSharding.parse(_balanced(cursor))
            elif key == "memory_kind" and memory_kind is None:
                memory_kind = cursor.string()
            else:
                raise cursor.fail(f"unexpected {key!r}")
        cursor.expect(">")
        cursor.expect_end()
        return cls(name, tensor, sharding, memory_kind)


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


def _balanced(cursor: _Cursor) -> str:
    """The text from the cursor to the end of its first `<...>` group (strings skipped)."""
    cursor.skip_ws()
    text, start, depth = cursor.text, cursor.pos, 0
    i = start
    while i < len(text):
        char = text[i]
        if char == '"':  # skip a string literal, escapes included
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
            if depth == 0:
                cursor.pos = i + 1
                return text[start : i + 1]
        i += 1
    raise cursor.fail("unbalanced '<'")
