"""Compile an sdy-annotated module with stock jaxlib for a set of devices, and run it.

The module's `@main` arguments and results carry `sdy.sharding`s on one `sdy.mesh`; inputs
are placed by those shardings, XLA's Shardy partitioner turns the module into one SPMD
program, and the outputs are reassembled into global arrays.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import backend
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxlib import _jax
from jaxlib.mlir import ir

from hlopar.analysis.module_meshes import module_meshes
from hlopar.analysis.sharding import TensorSharding
from hlopar.ir.module import main_func, print_module


@dataclass
class SpmdExecutable:
    executable: object
    input_shardings: list[NamedSharding]
    output_shardings: list[NamedSharding]
    output_shapes: list[tuple[int, ...]]
    input_types: list[tuple[tuple[int, ...], np.dtype]]

    def __call__(self, *args) -> list[np.ndarray]:
        placed = [jax.device_put(np.asarray(a), s) for a, s in zip(args, self.input_shardings)]
        per_output = self.executable.execute_sharded(placed).disassemble_into_single_device_arrays()
        results = []
        for shards, sharding, shape in zip(per_output, self.output_shardings, self.output_shapes):
            results.append(np.asarray(jax.make_array_from_single_device_arrays(shape, sharding, shards)))
        return results


def compile_options(device_ids: Sequence[int]):
    """XLA's options for a module partitioned by Shardy over the devices of these ids (the
    device assignment, in their order)."""
    options = backend.get_compile_options(
        num_replicas=1, num_partitions=len(device_ids), device_assignment=np.array([list(device_ids)])
    )
    options.executable_build_options.use_shardy_partitioner = True
    options.executable_build_options.use_spmd_partitioning = len(device_ids) > 1
    return options


def compile_spmd(module: ir.Operation, devices: Sequence[jax.Device], host_callbacks: Sequence = ()) -> SpmdExecutable:
    """Compiles `module` (its `@main`) for `devices`, in the order of the module's mesh;
    `host_callbacks`: the Python functions its host callbacks call, by their `index`
    (`hlopar.ir.host_callbacks`), as `jax.jit` hands them to the compiler. The one place
    hlopar calls XLA's compiler."""
    options = compile_options([d.id for d in devices])
    client, device_list = backend.get_backend(), _jax.DeviceList(tuple(devices))
    text = print_module(module)
    _set_up_lapack(text)
    if host_callbacks:  # only the overload that takes a module object takes them
        with module.context:
            parsed = ir.Module.parse(print_module(module))
        executable = client.compile_and_load(
            parsed, executable_devices=device_list, compile_options=options, host_callbacks=list(host_callbacks)
        )
    else:
        executable = client.compile_and_load(text, device_list, options)
    return spmd_executable(module, devices, executable)


def _set_up_lapack(program: str | bytes) -> None:
    """XLA:CPU's LAPACK kernels (`lapack_*` custom calls) get their LAPACK routines when jax
    first lowers a linear-algebra op; a module read from a file may call them in a process
    where jax never did, and would run them unset (a segfault): set them up first. `program`:
    the module's text, or its serialized executable."""
    if ("@lapack_" if isinstance(program, str) else b"lapack_") in program:
        from jaxlib import lapack

        lapack.prepare_lapack_call("getrf", np.float32)  # sets every routine up, whichever named


def load_spmd(module: ir.Operation, devices: Sequence[jax.Device], serialized: bytes) -> SpmdExecutable:
    """`module`'s executable for `devices` from `serialized` (`serialize_spmd` of the same
    module compiled for as many devices of the same kind, whichever their ids), not compiled."""
    _set_up_lapack(serialized)  # the executable names its custom calls' targets: no need to print the module
    executable = backend.get_backend().deserialize_executable(
        serialized, _jax.DeviceList(tuple(devices)), compile_options([d.id for d in devices])
    )
    return spmd_executable(module, devices, executable)


def serialize_spmd(spmd: SpmdExecutable) -> bytes:
    return backend.get_backend().serialize_executable(spmd.executable)


def spmd_executable(module: ir.Operation, devices: Sequence[jax.Device], executable) -> SpmdExecutable:
    """`module`'s loaded `executable` for `devices`, with its boundary's shardings and types."""
    func = main_func(module)
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    return SpmdExecutable(
        executable,
        *main_shardings(module, devices),
        [tuple(ir.RankedTensorType(t).shape) for t in function_type.results],
        [
            (tuple(ir.RankedTensorType(t).shape), numpy_dtype(ir.RankedTensorType(t).element_type))
            for t in function_type.inputs
        ],
    )


def main_shardings(
    module: ir.Operation, devices: Sequence[jax.Device]
) -> tuple[list[NamedSharding], list[NamedSharding]]:
    """`@main`'s arguments' and results' `sdy.sharding`s as `NamedSharding`s on `devices` (in
    the order of the module's mesh): what `jax.jit(in_shardings=, out_shardings=)` takes."""
    mesh = _jax_mesh(module, devices)
    func = main_func(module)
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    return (
        [_named(attrs, mesh) for attrs in _value_attrs(func, "arg_attrs", len(function_type.inputs))],
        [_named(attrs, mesh) for attrs in _value_attrs(func, "res_attrs", len(function_type.results))],
    )


def numpy_dtype(element: ir.Type | str) -> np.dtype:
    """The numpy type of an MLIR element type (f32, bf16, i32, i1, ui8, complex<f32>, ...)."""
    text = str(element)
    if text == "i1":
        return np.dtype(bool)
    if text.startswith("complex<"):
        return np.dtype(np.complex64 if text == "complex<f32>" else np.complex128)
    if text == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    kind = {"f": "float", "i": "int", "ui": "uint"}[re.match(r"[a-z]+", text).group()]
    return np.dtype(f"{kind}{re.search(r'[0-9]+', text).group()}")


def mesh_size(module: ir.Operation) -> int:
    """How many devices the module's (first, non-trivial) mesh has; 1 without one."""
    return next((m.size for m in module_meshes(module).values() if m is not None and m.axes), 1)


def _jax_mesh(module: ir.Operation, devices: Sequence[jax.Device]) -> Mesh:
    meshes = [m for m in module_meshes(module).values() if m is not None and m.axes]
    if not meshes:
        return Mesh(np.array(devices).reshape(len(devices)), ("_replicated",))
    mesh = meshes[0]
    if mesh.size != len(devices):
        raise ValueError(f"the module's mesh has {mesh.size} devices, {len(devices)} were given")
    ordered = np.array(devices)[mesh.devices().reshape(-1)].reshape(mesh.shape)
    return Mesh(ordered, mesh.axis_names)


def _value_attrs(func: ir.Operation, key: str, count: int) -> list[dict]:
    if key not in func.attributes:
        return [{} for _ in range(count)]
    return [{n.name: n.attr for n in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]


def _named(attrs: dict, mesh: Mesh) -> NamedSharding:
    if "sdy.sharding" not in attrs:
        return NamedSharding(mesh, PartitionSpec())
    spec = TensorSharding.parse(str(attrs["sdy.sharding"])).to_spec()
    return NamedSharding(
        mesh, PartitionSpec(*[(axes if len(axes) > 1 else axes[0]) if axes else None for axes in spec.dims])
    )
