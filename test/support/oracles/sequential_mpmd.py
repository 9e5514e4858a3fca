"""Run an MPMD program one fragment at a time on local devices, to prove it right.

No pipelining and no overlap: `@main`'s fragments run in program order, each compiled once
(`compile_spmd`, per distinct fragment text and device set) for the physical devices of its
mesh (`hlopar.devices`; without it, consecutive ids in topology order). Values are held on
the host between steps: a fragment's inputs are placed on its mesh by their layouts, and an
`mpmd.transfer` is a copy (the consumer places the copy on the destination mesh). A
`hlopar.cross_mesh_transfer` (written by `hlopar-cross-mesh-resharding`, decoded by
`codegen.transfers`) runs its unit ops device to device (`local_transfer.run_planned_transfer`):
the value is split over the source mesh's devices by its layout, the ops move the boxes they
name, and the destination devices' shards are put back together on the host, checking that
they cover the tensor and that replicas agree. Physical device ids are positions in `jax.devices()` unless a mapping is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jaxlib.mlir import ir

from hlopar.analysis.mpmd import MeshTensorType
from hlopar.codegen.fragments import fragment_module, program_devices, program_topology
from hlopar.codegen.spmd import SpmdExecutable, compile_spmd
from hlopar.codegen.transfers import PlannedTransfer, planned_transfer
from hlopar.dialect.attributes import CROSS_MESH_TRANSFER
from hlopar.dialect.mpmd import TOPOLOGY_ATTR, TRANSFER, fragment_mesh, is_fragment
from hlopar.ir.module import find_main, print_module
from hlopar.runtime.local_transfer import run_planned_transfer

__all__ = ["SequentialMpmd", "run_mpmd"]


@dataclass(frozen=True)
class _Run:
    executable: SpmdExecutable
    operands: tuple[int, ...]
    results: tuple[int, ...]


@dataclass(frozen=True)
class _Copy:
    source: int
    result: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Transfer:
    """A planned cross-mesh transfer (`codegen.transfers`)."""

    source: int
    result: int
    plan: PlannedTransfer


class SequentialMpmd:
    """An MPMD program compiled for local devices; call it with `@main`'s arguments."""

    def __init__(self, module: ir.Operation, devices: Mapping[int, jax.Device] | None = None):
        func = _entry(module)
        topology = program_topology(func)
        physical = program_devices(module, topology)
        devices = dict(enumerate(jax.devices())) if devices is None else devices
        block = func.regions[0].blocks[0]
        number: dict[ir.Value, int] = {arg: i for i, arg in enumerate(block.arguments)}
        self.argument_shapes = [_global_shape(arg.type) for arg in block.arguments]
        self.steps: list[_Run | _Copy | _Transfer] = []
        self.devices = devices
        self.results: tuple[int, ...] = ()
        self.compiled = 0
        cache: dict[tuple[str, tuple[int, ...]], SpmdExecutable] = {}

        def define(values) -> tuple[int, ...]:
            for value in values:
                number[value] = len(number)
            return tuple(number[v] for v in values)

        for op in block.operations:
            op = op.operation
            if is_fragment(op):
                mesh = fragment_mesh(op)
                standalone = fragment_module(op, topology)
                key = (print_module(standalone), physical[mesh])
                if key not in cache:
                    cache[key] = compile_spmd(standalone, [devices[d] for d in physical[mesh]])
                    self.compiled += 1
                operands = tuple(number[v] for v in op.operands)
                self.steps.append(_Run(cache[key], operands, define(op.results)))
            elif op.name == TRANSFER:
                source = number[op.operands[0]]
                (result,) = define(op.results)
                self.steps.append(_Copy(source, result, _global_shape(op.results[0].type)))
            elif op.name == CROSS_MESH_TRANSFER:
                source = number[op.operands[0]]
                (result,) = define(op.results)
                self.steps.append(_Transfer(source, result, planned_transfer(op, topology, physical)))
            elif op.name == "func.return":
                self.results = tuple(number[v] for v in op.operands)
            else:
                raise ValueError(f"the sequential MPMD runner cannot execute '{op.name}' at the top level of @main")

    def __call__(self, arguments: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(arguments) != len(self.argument_shapes):
            raise ValueError(f"@main takes {len(self.argument_shapes)} arguments, got {len(arguments)}")
        values: dict[int, np.ndarray] = {}
        for i, (argument, shape) in enumerate(zip(arguments, self.argument_shapes)):
            argument = np.asarray(argument)
            if argument.shape != shape:
                raise ValueError(f"argument {i} has shape {argument.shape}, @main expects {shape}")
            values[i] = argument
        for step in self.steps:
            if isinstance(step, _Copy):
                values[step.result] = np.array(values[step.source], copy=True).reshape(step.shape)
            elif isinstance(step, _Transfer):
                values[step.result] = run_planned_transfer(step.plan, values[step.source], self.devices)
            else:
                outputs = step.executable(*(values[i] for i in step.operands))
                values.update(zip(step.results, outputs))
        return [values[i] for i in self.results]


def run_mpmd(
    module: ir.Operation, arguments: Sequence[np.ndarray], devices: Mapping[int, jax.Device] | None = None
) -> list[np.ndarray]:
    """Compiles and runs an MPMD program once; returns `@main`'s results."""
    return SequentialMpmd(module, devices)(arguments)


def _entry(module: ir.Operation) -> ir.Operation:
    """`@main`, else the only function with a topology."""
    main = find_main(module)
    if main is not None:
        return main
    funcs = [op.operation for op in module.regions[0].blocks[0].operations if op.operation.name == "func.func"]
    with_topology = [f for f in funcs if TOPOLOGY_ATTR in f.attributes]
    if len(with_topology) == 1:
        return with_topology[0]
    raise ValueError("the module has no @main and no single function with a topology")


def _global_shape(type_: ir.Type) -> tuple[int, ...]:
    text = str(type_)
    tensor = MeshTensorType.parse(text).tensor_type if text.startswith("!mpmd.mesh_tensor") else text
    return tuple(ir.RankedTensorType(ir.Type.parse(tensor, context=type_.context)).shape)
