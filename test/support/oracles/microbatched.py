"""Run a split training step over B microbatches in one process, without a pipeline: the
test oracle of the microbatch split (the package runs a split step with
`hlopar.runtime.local_executor.PipelinedStep` or a runtime).

The module as `hlopar-split-microbatches` wrote it is cut by `split_step` into the
per-microbatch part and the update; the first is compiled to accumulate its sums in donated
buffers (`accumulating_module`), runs on each batch slice in turn, and the update runs once
on the sums. It takes the step's ORIGINAL arguments (the whole batch) and returns its
results.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jaxlib.mlir import ir

from hlopar.codegen.executables import accumulating_module, compile_executable
from hlopar.dialect.split import read_microbatches, split_step
from hlopar.ir.module import main_func
from hlopar.passes.base import PassContext
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.runtime.step_arguments import step_arguments

__all__ = ["MicrobatchedStep", "run_microbatched"]


class MicrobatchedStep:
    """A split training step compiled for `devices` (default: the first local device)."""

    def __init__(self, module: ir.Operation, devices: Sequence[jax.Device] | None = None):
        split = split_step(module)
        self.split = split
        self.devices = list(devices or jax.devices()[:1])
        outputs = range(split.num_sums)
        self.microbatch = compile_executable(accumulating_module(split.microbatch.module, list(outputs)), self.devices)
        self.update = compile_executable(split.update.module, self.devices)

    @property
    def microbatches(self) -> int:
        return self.split.microbatches

    def __call__(self, arguments: Sequence) -> list[np.ndarray]:
        split = self.split
        arguments = step_arguments(arguments, split.num_args, split.index_arg, split.microbatches)
        slices = _batch_slices(arguments, split.batch_args, split.argument_shapes, split.microbatches)
        sums = [
            jax.device_put(np.zeros(shape, dtype), sharding)
            for (shape, dtype), sharding in zip(
                self.microbatch.spmd.input_types[: split.num_sums], self.microbatch.input_shardings
            )
        ]
        fixed = {
            i: self.microbatch.place(split.num_sums + n, arguments[i])
            for n, i in enumerate(split.microbatch_args)
            if i not in split.batch_args
        }
        for k in range(split.microbatches):
            inputs = [slices[k][i] if i in split.batch_args else fixed[i] for i in split.microbatch_args]
            sums = self.microbatch.run(sums + inputs)
        results = self.update.run([arguments[i] for i in split.update_args] + sums)
        return [np.asarray(r) for r in results]


def run_microbatched(
    module: ir.Operation,
    arguments: Sequence,
    microbatches: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> list[np.ndarray]:
    """Runs a training step once over microbatches. `module` is either split already (by
    `hlopar-split-microbatches`) or a plain step, split here into `microbatches`."""
    return MicrobatchedStep(_split(module, microbatches), devices)(arguments)


def _split(module: ir.Operation, microbatches: int | None) -> ir.Operation:
    main = main_func(module)
    split = read_microbatches(main)
    if split is not None:
        if microbatches is not None and split != microbatches:
            raise ValueError(f"the module is split into {split} microbatches, not {microbatches}")
        return module
    if microbatches is None:
        raise ValueError("the module is not split into microbatches: give the number of microbatches")
    clone = module.clone()
    SplitMicrobatchesPass(microbatches=microbatches).run(clone, PassContext())
    return clone


def _batch_slices(arguments, batch_args, shapes, microbatches) -> list[dict[int, np.ndarray]]:
    """Per microbatch, its slice of every batch argument (rows k*b .. (k+1)*b of dim 0)."""
    slices: list[dict[int, np.ndarray]] = [{} for _ in range(microbatches)]
    for i in batch_args:
        full = np.asarray(arguments[i])
        size = shapes[i][0]
        if full.shape[0] != size * microbatches or tuple(full.shape[1:]) != tuple(shapes[i][1:]):
            raise ValueError(
                f"batch argument {i} has shape {full.shape}; {microbatches} microbatches of "
                f"{tuple(shapes[i])} make {(size * microbatches, *shapes[i][1:])}"
            )
        for k in range(microbatches):
            slices[k][i] = full[k * size : (k + 1) * size]
    return slices
