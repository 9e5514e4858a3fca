"""Each `mpmd.fragment` of an MPMD program as a standalone StableHLO module for its mesh.

A fragment is one SPMD program: its body becomes `@main`, taking the fragment's block
arguments and returning what its `mpmd.return` returns. The layouts in the fragment's
operand and result mesh tensor types become `sdy.sharding` argument and result attributes
on one `sdy.mesh` with the axes of the fragment's topology mesh, named as those shardings
(and the body's) name it, so `compile_spmd` compiles the module as it is for the mesh's
devices; replicated values get an explicit replicated sharding. Other `sdy.mesh` symbols
the body names are copied after it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.mesh import DeviceMesh, format_symbol
from hlopar.analysis.mpmd import MeshTensorType, parse_topology
from hlopar.analysis.sharding import ShardingSpec, TensorSharding
from hlopar.dialect.attributes import DEVICES_ATTR
from hlopar.dialect.mpmd import TOPOLOGY_ATTR, fragment_mesh, fragments, read_devices
from hlopar.ir.extract import clone_into

__all__ = [
    "FragmentModule",
    "fragment_module",
    "fragment_modules",
    "program_devices",
    "program_topology",
    "sharding_attrs",
]

SDY_SHARDING = "sdy.sharding"


@dataclass(frozen=True)
class FragmentModule:
    """One fragment of a program and its standalone module."""

    fragment: ir.Operation  # the `mpmd.fragment` op
    mesh_name: str
    module: ir.Operation  # `builtin.module` with `sdy.mesh` and `@main`


def program_topology(func: ir.Operation) -> dict[str, DeviceMesh]:
    """The meshes of a function's `topology` attribute, by name."""
    if TOPOLOGY_ATTR not in func.attributes:
        raise ValueError(f"@{ir.StringAttr(func.attributes['sym_name']).value} has no 'topology' attribute")
    return parse_topology(str(func.attributes[TOPOLOGY_ATTR]))


def program_devices(module: ir.Operation, topology: Mapping[str, DeviceMesh]) -> dict[str, tuple[int, ...]]:
    """Physical device ids of each mesh, logical order: `hlopar.devices`, else consecutive
    ids in topology order (docs/ir.md)."""
    physical = read_devices(module)
    if physical is None:
        physical, start = {}, 0
        for name, mesh in topology.items():
            physical[name] = tuple(range(start, start + mesh.size))
            start += mesh.size
        return physical
    for name, mesh in topology.items():
        if name not in physical:
            raise ValueError(f"'{DEVICES_ATTR}' gives no devices to mesh '{name}'")
        if len(physical[name]) != mesh.size:
            raise ValueError(f"'{DEVICES_ATTR}' gives {len(physical[name])} devices to mesh '{name}' of {mesh.size}")
    return physical


def fragment_modules(func: ir.Operation) -> list[FragmentModule]:
    """Every top-level fragment of an MPMD function, in program order."""
    topology = program_topology(func)
    return [
        FragmentModule(
            op.operation,
            fragment_mesh(op),
            fragment_module(op, topology),
        )
        for op in fragments(func)
    ]


def fragment_module(fragment: ir.Operation, topology: Mapping[str, DeviceMesh]) -> ir.Operation:
    """The fragment as a module whose `@main` computes its body on the fragment's mesh."""
    mesh_name = fragment_mesh(fragment)
    if mesh_name not in topology:
        raise ValueError(f"fragment on mesh '{mesh_name}', which is not in the topology")
    operand_types = [MeshTensorType.parse(str(v.type)) for v in fragment.operands]
    result_types = [MeshTensorType.parse(str(v.type)) for v in fragment.results]
    shardings = [t.sharding for t in (*operand_types, *result_types)]
    symbol = _mesh_symbol(fragment, mesh_name, shardings)
    block = fragment.regions[0].blocks[0]
    terminator = list(block.operations)[-1]
    with fragment.context, ir.Location.unknown():
        module = ir.Operation.parse("module {}")
        body = module.regions[0].blocks[0]
        with ir.InsertionPoint(body):
            sdy.MeshOp(symbol, ir.Attribute.parse(f"#sdy.mesh{topology[mesh_name].to_sdy()}"))
            _copy_named_meshes(fragment, symbol)
            function_type = ir.FunctionType.get(
                [a.type for a in block.arguments], [v.type for v in terminator.operands]
            )
            main = func_dialect.FuncOp("main", function_type)
        main.operation.attributes["arg_attrs"] = _value_attrs(operand_types, symbol)
        main.operation.attributes["res_attrs"] = _value_attrs(result_types, symbol)
        entry = main.add_entry_block()
        mapping = dict(zip(block.arguments, entry.arguments))
        with ir.InsertionPoint(entry):
            for op in list(block.operations)[:-1]:
                clone_into(op.operation, mapping)
            func_dialect.ReturnOp([mapping.get(v, v) for v in terminator.operands])
    return module


def _mesh_symbol(fragment: ir.Operation, mesh_name: str, shardings) -> str:
    """The sdy mesh symbol the fragment's layouts name (they must agree), else the mesh name."""
    names = {s.mesh_name for s in shardings if s is not None}
    if len(names) > 1:
        raise ValueError(f"fragment on '{mesh_name}': its types name several sdy meshes {sorted(names)}")
    return names.pop() if names else mesh_name


def _copy_named_meshes(fragment: ir.Operation, symbol: str) -> None:
    """The program's other `sdy.mesh` symbols that the body names."""
    program = fragment.parent
    while program is not None and program.name != "builtin.module":
        program = program.parent
    if program is None:
        return
    meshes = [op.operation for op in program.regions[0].blocks[0].operations if op.operation.name == "sdy.mesh"]
    others = {ir.StringAttr(m.attributes["sym_name"]).value: m for m in meshes}
    others.pop(symbol, None)
    if not others:
        return
    named = set(re.findall(r"@([\w.$-]+|\"[^\"]*\")", fragment.get_asm()))
    for name, mesh in others.items():
        if name in named or format_symbol(name)[1:] in named:
            mesh.clone()


def _value_attrs(types: list[MeshTensorType], symbol: str) -> ir.ArrayAttr:
    """Every value gets a closed sharding: one left out would be open, and Shardy could
    shard it other than the runtime places it."""
    return ir.ArrayAttr.get(
        [
            sharding_attrs(t.sharding, symbol, len(ir.RankedTensorType(ir.Type.parse(t.tensor_type)).shape))
            for t in types
        ]
    )


def sharding_attrs(sharding: TensorSharding | None, symbol: str, rank: int) -> ir.DictAttr:
    """An argument's or result's attributes: its closed `sdy.sharding` (None: replicated on
    mesh `symbol`)."""
    if sharding is None:
        sharding = TensorSharding.from_spec(symbol, ShardingSpec.replicated(rank))
    return ir.DictAttr.get({SDY_SHARDING: ir.Attribute.parse(_closed(sharding).format())})


def _closed(sharding: TensorSharding) -> TensorSharding:
    """Mesh tensor layouts are exact: open dimensions are read as closed."""
    return replace(sharding, dims=tuple(replace(d, is_closed=True, priority=None) for d in sharding.dims))
