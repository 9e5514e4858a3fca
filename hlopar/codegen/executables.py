"""Compiled executables for one function on one set of devices, with donated buffers.

`compile_executable` compiles a standalone module (its `@main`: one half of
`split_microbatches.split_step`, or a fragment from `fragments.fragment_module`) with
`compile_spmd`, and keeps inputs and outputs on the devices: `run` takes and returns
`jax.Array`s placed by the module's `sdy.sharding`s, so a runtime chains executables without
going through the host.

Gradient accumulation happens inside the executable that makes the gradients:
`accumulating_module` turns a module into one that also takes an accumulator per summed
result and returns accumulator + result in its place, the accumulator donated to that
result (a per-example result's rows are written into it in place: `_accumulated`).
Donation is written the way JAX writes it in the StableHLO it lowers:
`tf.aliasing_output = k : i32` on an argument whose buffer result k may reuse (XLA's
`input_output_alias`), `jax.buffer_donor = true` on an argument that may be reused by any
result. The PJRT runtime then consumes the donated input: after `run`, the `jax.Array` passed
for it is deleted and the result lives in its buffer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import NamedSharding
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo

from hlopar.codegen.spmd import SpmdExecutable, compile_spmd, load_spmd
from hlopar.dialect.attributes import PER_EXAMPLE_ATTR
from hlopar.ir.extract import clone_into
from hlopar.ir.module import main_func

__all__ = [
    "ALIASING_OUTPUT",
    "BUFFER_DONOR",
    "DeviceExecutable",
    "accumulating_module",
    "compile_executable",
    "load_executable",
    "set_donation",
]

ALIASING_OUTPUT = "tf.aliasing_output"
BUFFER_DONOR = "jax.buffer_donor"
_SDY_SHARDING = "sdy.sharding"


@dataclass
class DeviceExecutable:
    """A compiled `@main` whose inputs and outputs stay on its devices."""

    spmd: SpmdExecutable
    donated: frozenset[int]  # argument numbers whose buffers the executable consumes
    _handlers: list | None = field(default=None, repr=False, compare=False)  # outputs' jax result handlers

    @property
    def input_shardings(self) -> list[NamedSharding]:
        return self.spmd.input_shardings

    @property
    def output_shardings(self) -> list[NamedSharding]:
        return self.spmd.output_shardings

    @property
    def num_inputs(self) -> int:
        return len(self.spmd.input_shardings)

    def place(self, number: int, value) -> jax.Array:
        """Argument `number` on the devices, laid out as the executable reads it."""
        sharding = self.spmd.input_shardings[number]
        if isinstance(value, jax.Array) and (
            value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim)
        ):
            return value  # the same pieces on the same devices (`P('d')` and `P('d', None)`)
        shape, dtype = self.spmd.input_types[number]
        if not isinstance(value, jax.Array) or _in_host_memory(value):
            # From host memory each device's piece is copied out as it is; a jax.Array placed
            # on other devices would be moved by a small program jax compiles per layout (the
            # tiny GPT's first step: 7 of them, 0.3 s). A CPU device's array is host memory.
            value = np.asarray(value, dtype=dtype)
        if tuple(value.shape) != shape:
            raise ValueError(f"argument {number} has shape {tuple(value.shape)}, the executable expects {shape}")
        return jax.device_put(value, sharding)

    def run(self, arguments: Sequence) -> list[jax.Array]:
        """Runs once; arguments may be host arrays or `jax.Array`s (moved if placed elsewhere).
        Donated arguments passed as `jax.Array`s are consumed."""
        if len(arguments) != self.num_inputs:
            raise ValueError(f"the executable takes {self.num_inputs} arguments, got {len(arguments)}")
        placed = [self.place(i, a) for i, a in enumerate(arguments)]
        results = self.spmd.executable.execute_sharded(placed)
        if self._handlers is not None:
            return results.consume_with_handlers(self._handlers)
        # The first run builds its arrays shard by shard and keeps how, as jax's result
        # handlers (what `jax.jit` uses): later runs skip per-shard Python work (3-5x
        # less time per output, 150 outputs on 8 CPU devices: 13-27 ms -> 4-6 ms).
        from jax._src import core
        from jax._src.interpreters.pxla import global_aval_to_result_handler

        outputs = [
            jax.make_array_from_single_device_arrays(shape, sharding, shards)
            for shards, sharding, shape in zip(
                results.disassemble_into_single_device_arrays(), self.spmd.output_shardings, self.spmd.output_shapes
            )
        ]
        self._handlers = [
            global_aval_to_result_handler(core.ShapedArray(o.shape, o.dtype), o.sharding, True) for o in outputs
        ]
        return outputs

    def __call__(self, *arguments) -> list[np.ndarray]:
        return [np.asarray(r) for r in self.run(list(arguments))]


def compile_executable(
    module: ir.Operation, devices: Sequence[jax.Device], host_callbacks: Sequence = ()
) -> DeviceExecutable:
    """Compiles `module`'s `@main` for `devices` (the order of its mesh); donation as its
    argument attributes say (`set_donation`, `accumulating_module`); `host_callbacks` as
    `spmd.compile_spmd` takes them. `executable_cache.ExecutableCache` compiles each
    executable of a plan once through it."""
    return DeviceExecutable(compile_spmd(module, devices, host_callbacks), _donated(module))


def load_executable(module: ir.Operation, devices: Sequence[jax.Device], serialized: bytes) -> DeviceExecutable:
    """`compile_executable`'s result for `module` and `devices`, from the bytes of the same
    module compiled for as many devices (`spmd.load_spmd`), without compiling."""
    return DeviceExecutable(load_spmd(module, devices, serialized), _donated(module))


def _donated(module: ir.Operation) -> frozenset[int]:
    return frozenset(
        i for i, attrs in enumerate(_arg_attrs(main_func(module))) if ALIASING_OUTPUT in attrs or BUFFER_DONOR in attrs
    )


def set_donation(module: ir.Operation, donations: Mapping[int, int | None]) -> None:
    """Marks `@main`'s argument i donated: to result `donations[i]` (`tf.aliasing_output`, the
    types and `sdy.sharding`s must match: one device's tile is one buffer) or, for None, to
    whichever result can reuse it (`jax.buffer_donor`)."""
    main = main_func(module)
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    attrs, results = _arg_attrs(main), _res_attrs(main)
    with module.context:
        for arg, result in donations.items():
            if result is None:
                attrs[arg][BUFFER_DONOR] = ir.BoolAttr.get(True)
                continue
            layouts = [str(a[_SDY_SHARDING]) if _SDY_SHARDING in a else None for a in (attrs[arg], results[result])]
            if function_type.inputs[arg] != function_type.results[result] or layouts[0] != layouts[1]:
                raise ValueError(
                    f"argument {arg} ({function_type.inputs[arg]}, {layouts[0]}) cannot alias result "
                    f"{result} ({function_type.results[result]}, {layouts[1]})"
                )
            attrs[arg][ALIASING_OUTPUT] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), result)
        main.attributes["arg_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get(a) for a in attrs])


def accumulating_module(module: ir.Operation, accumulate: Sequence[int], keep: Collection[int] = ()) -> ir.Operation:
    """A new module whose `@main` takes one accumulator per result in `accumulate` (first, in
    that order), then `module`'s arguments, and returns `module`'s results with result k
    replaced by accumulator + result k; the accumulator is donated to it. Results in `keep`
    (a subset of `accumulate`) are also returned as they are, appended in `accumulate`
    order (for a value that other per-microbatch code reads too)."""
    keep = [k for k in accumulate if k in set(keep)]
    clone = module.clone()
    step = main_func(clone)
    function_type = ir.FunctionType(ir.TypeAttr(step.attributes["function_type"]).value)
    inputs, results = list(function_type.inputs), list(function_type.results)
    arg_attrs, res_attrs = _arg_attrs(step), _res_attrs(step)
    with clone.context, ir.Location.unknown():
        main = func_dialect.FuncOp(
            "main",
            ir.FunctionType.get([results[k] for k in accumulate] + inputs, results + [results[k] for k in keep]),
            ip=ir.InsertionPoint(step),
        )
        for name in step.attributes:
            if name not in ("function_type", "sym_name", "arg_attrs", "res_attrs"):
                main.operation.attributes[name] = step.attributes[name]
        accumulators = []
        for k in accumulate:
            attrs = {key: value for key, value in res_attrs[k].items() if key == _SDY_SHARDING}
            attrs[ALIASING_OUTPUT] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), k)
            accumulators.append(ir.DictAttr.get(attrs))
        main.operation.attributes["arg_attrs"] = ir.ArrayAttr.get(
            accumulators + [ir.DictAttr.get(a) for a in arg_attrs]
        )
        main.operation.attributes["res_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get(a) for a in res_attrs] + [ir.DictAttr.get(res_attrs[k]) for k in keep]
        )
        entry = main.add_entry_block()
        body = step.regions[0].blocks[0]
        mapping = dict(zip(body.arguments, list(entry.arguments)[len(accumulate) :]))
        with ir.InsertionPoint(entry):
            operations = list(body.operations)
            for op in operations[:-1]:
                clone_into(op.operation, mapping)
            out = [mapping.get(v, v) for v in operations[-1].operands]
            raw = [out[k] for k in keep]
            for j, k in enumerate(accumulate):
                out[k] = _accumulated(entry.arguments[j], out[k])
            func_dialect.ReturnOp(out + raw)
        step.erase()
    return clone


def _accumulated(accumulator: ir.Value, value: ir.Value) -> ir.Value:
    """accumulator + value; for a microbatch's rows of a per-example result placed in zeros
    (`passes.microbatching.per_example_results`), the rows written into the accumulator in place: the same
    sum, as no other microbatch writes those rows, without adding a whole batch of zeros."""
    placed = value.owner if isinstance(value, ir.OpResult) else None
    if placed is not None and PER_EXAMPLE_ATTR in placed.attributes:
        rows = stablehlo.DynamicUpdateSliceOp(accumulator, placed.operands[1], list(placed.operands[2:]))
        if _SDY_SHARDING in placed.attributes:
            rows.operation.attributes[_SDY_SHARDING] = placed.attributes[_SDY_SHARDING]
        return rows.result
    return stablehlo.AddOp(accumulator, value).result


def _dicts(func: ir.Operation, key: str, count: int) -> list[dict]:
    if key not in func.attributes:
        return [{} for _ in range(count)]
    return [{n.name: n.attr for n in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]


def _arg_attrs(func: ir.Operation) -> list[dict]:
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    return _dicts(func, "arg_attrs", len(function_type.inputs))


def _res_attrs(func: ir.Operation) -> list[dict]:
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    return _dicts(func, "res_attrs", len(function_type.results))


def _in_host_memory(value: jax.Array) -> bool:
    """Whether the array's buffers are host memory this process reads (CPU devices)."""
    return value.is_fully_addressable and all(d.platform == "cpu" for d in value.sharding.device_set)
