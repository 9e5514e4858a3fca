"""An exported StableHLO module as a step: what `parallelize` takes besides a JAX function.

A training step exported from JAX (`jax.jit(step).lower(...).as_text()`, or its bytecode)
is a program of arrays: `@main`'s arguments in, its results out, no pytrees and no Python.
`ModuleStep` holds one, read from a `.mlir` / `.mlirbc` file, text or bytes, and gives what
`parallelize` reads of a lowered JAX function: the module's text (the plan's input, with
each op's location in the file, so that messages point at `file:line:col`), the results'
shapes and dtypes, and a check of the arguments a call passes against `@main`'s signature.
Called on its own, it runs the module as XLA compiles it, on one device (or on as many as
the mesh it was exported with has): the reference a parallelized run is checked against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxlib.mlir import ir

from hlopar.ir.module import load_module, main_func, parse_module, print_module

__all__ = ["ModuleLowering", "ModuleStep", "as_step"]


@dataclass(frozen=True)
class ModuleLowering:
    """The parts of a `jax.stages.Lowered` that `parallelize` reads, for a module."""

    text: str
    out_info: tuple[jax.ShapeDtypeStruct, ...]

    @property
    def out_tree(self):
        return jax.tree_util.tree_structure(self.out_info)

    def as_text(self, debug_info: bool = True) -> str:
        return self.text


class ModuleStep:
    """`@main` of a StableHLO module, callable on arrays (module docstring). `source`: a path
    (`.mlir` text or `.mlirbc` bytecode), the module's text, or its bytes."""

    def __init__(self, source: str | os.PathLike | bytes, *, name: str | None = None):
        if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and "{" not in source):
            path = Path(source)
            module = load_module(path)
            self.__name__ = name or path.stem
        else:
            module = parse_module(source, source_name=name or "<module>")
            self.__name__ = name or "module"
        self.text = print_module(module, debug_info=True)
        function_type = ir.FunctionType(ir.TypeAttr(main_func(module).attributes["function_type"]).value)
        self.in_info = tuple(_shape_dtype(t) for t in function_type.inputs)
        self.out_info = tuple(_shape_dtype(t) for t in function_type.results)
        self._module = module
        self._executable = None

    def __repr__(self) -> str:
        return f"ModuleStep({self.__name__}: {len(self.in_info)} arguments, {len(self.out_info)} results)"

    def lower(self, *args) -> ModuleLowering:
        """The module, for arguments of `@main`'s shapes and dtypes (checked: a `TypeError`
        naming the first that differs)."""
        self.check_arguments(args)
        return ModuleLowering(self.text, self.out_info)

    def check_arguments(self, args: tuple) -> None:
        if len(args) != len(self.in_info):
            raise TypeError(f"{self.__name__}'s @main takes {len(self.in_info)} arguments, got {len(args)}")
        for k, (arg, want) in enumerate(zip(args, self.in_info)):
            shape, dtype = tuple(np.shape(arg)), np.dtype(getattr(arg, "dtype", np.result_type(arg)))
            if shape != want.shape or dtype != want.dtype:
                raise TypeError(
                    f"{self.__name__}'s @main argument {k} is a {want.dtype}{list(want.shape)}, got a {dtype}{list(shape)}"
                )

    def __call__(self, *args) -> tuple[np.ndarray, ...]:
        """The module run as XLA compiles it, on as many of this process's devices as its mesh
        has (one, for a module exported without shardings), compiled once; its results as
        host arrays."""
        from hlopar.codegen.spmd import compile_spmd, mesh_size

        self.check_arguments(args)
        if self._executable is None:
            count = mesh_size(self._module)
            devices = jax.devices()[:count]
            if len(devices) < count:
                raise ValueError(f"{self.__name__} was exported for {count} devices; this process has {len(devices)}")
            self._executable = compile_spmd(self._module, devices)
        return tuple(self._executable(*args))


def _shape_dtype(tensor: ir.Type) -> jax.ShapeDtypeStruct:
    from hlopar.codegen.spmd import numpy_dtype

    ranked = ir.RankedTensorType(tensor)
    return jax.ShapeDtypeStruct(tuple(ranked.shape), numpy_dtype(ranked.element_type))


def as_step(fn: Any) -> Any:
    """`fn` as `parallelize` takes it: a path, text or bytes of a module made a `ModuleStep`."""
    return ModuleStep(fn) if isinstance(fn, (str, bytes, os.PathLike)) else fn
