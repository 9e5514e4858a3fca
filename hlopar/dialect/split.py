"""The microbatch split in the IR: what `hlopar-split-microbatches` writes and how it is read.

A split `@main` is the step for ONE of B microbatches (`hlopar.microbatches = B`), its batch
arguments listed in `hlopar.batch_args`, every top-level op marked with `hlopar.microbatch`,
the kind of its results (`batch`, `sum`, `step`, absent), and, where an iota counts the
batch, the microbatch index as one more argument (`hlopar.microbatch_index_arg`): docs/ir.md
and the pass's docstring give the contract. `split_step` cuts such a `@main` at the
accumulation boundary, the form the local executor runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from jaxlib.mlir import ir

from hlopar.dialect.attributes import (
    BATCH,
    BATCH_ARGS_ATTR,
    INDEX_ARG_ATTR,
    KIND_ATTR,
    MICROBATCHES_ATTR,
    STEP,
    SUM,
)
from hlopar.ir.extract import Extraction, extract_function
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import main_func

__all__ = [
    "SplitStep",
    "index_argument",
    "microbatch_index_values",
    "op_kinds",
    "read_index_arg",
    "read_microbatches",
    "read_split",
    "split_step",
]


@dataclass(frozen=True)
class SplitStep:
    """The step cut at the accumulation boundary (see the module docstring)."""

    microbatches: int
    batch_args: tuple[int, ...]
    microbatch: Extraction  # @main's args `microbatch_args` -> the sums
    update: Extraction  # @main's args `update_args`, then the sums -> @main's results
    microbatch_args: tuple[int, ...]
    update_args: tuple[int, ...]
    num_args: int
    argument_shapes: tuple[tuple[int, ...], ...] = field(default=())  # @main's (one microbatch)
    index_arg: int | None = None  # the microbatch index argument (`microbatch_index`), if any

    @property
    def num_sums(self) -> int:
        return len(self.microbatch.outputs)


def read_microbatches(func: ir.Operation) -> int | None:
    """B when the function is the step of one of B microbatches (the split ran), else None:
    the one channel of the number of microbatches once the split ran."""
    if MICROBATCHES_ATTR not in func.attributes:
        return None
    return ir.IntegerAttr(func.attributes[MICROBATCHES_ATTR]).value


def read_split(main: ir.Operation) -> tuple[int, tuple[int, ...]]:
    """(B, batch argument numbers) of a `@main` written by the pass."""
    if MICROBATCHES_ATTR not in main.attributes:
        raise ValueError("@main is not split into microbatches (run hlopar-split-microbatches)")
    return (
        ir.IntegerAttr(main.attributes[MICROBATCHES_ATTR]).value,
        tuple(ir.DenseI64ArrayAttr(main.attributes[BATCH_ARGS_ATTR])),
    )


def op_kinds(graph: FuncGraph) -> list[str | None]:
    """`hlopar.microbatch` of every top-level op (None: independent of the batch)."""
    return [
        ir.StringAttr(op.mlir_op.attributes[KIND_ATTR]).value if KIND_ATTR in op.mlir_op.attributes else None
        for op in graph.ops
    ]


def split_step(module: ir.Operation) -> SplitStep:
    """`@main` (as the pass wrote it) as two standalone modules: the smallest per-microbatch
    part M of the contract, and the rest, run once on the sums."""
    main = main_func(module)
    b, batch_args = read_split(main)
    graph = FuncGraph.from_func(main)
    if not any(KIND_ATTR in op.mlir_op.attributes for op in graph.ops):
        raise ValueError(
            "@main carries no 'hlopar.microbatch' kinds: it is not the one-microbatch program "
            "hlopar-split-microbatches writes (a module in the functions form is run as it is)"
        )
    kinds = op_kinds(graph)
    preds = [graph.predecessors(i) for i in range(len(graph.ops))]
    per_microbatch: set[int] = set()

    def reduces_the_batch(i: int) -> bool:
        return kinds[i] == SUM and any(kind_of_value(graph, kinds, v, batch_args) == BATCH for v in graph.reads(i))

    stack = [i for i, k in enumerate(kinds) if k == BATCH or reduces_the_batch(i)]
    while stack:
        i = stack.pop()
        if i not in per_microbatch:
            per_microbatch.add(i)
            stack.extend(preds[i])
    if any(kinds[i] == STEP for i in per_microbatch):
        raise ValueError("a step op feeds a per-microbatch op: the module breaks the microbatch contract")
    once = [i for i in range(len(graph.ops)) if i not in per_microbatch]
    needed = set(once)
    sums: dict[int, None] = {}
    for v in graph.results:
        p = graph.values[v].producer
        if p is not None and p in per_microbatch:
            if kinds[p] is not None:
                sums.setdefault(v)
            else:
                needed.add(p)  # independent of the batch: recomputed after the sums
    stack = list(needed)
    while stack:
        for v in graph.reads(stack.pop()):
            p = graph.values[v].producer
            if p is None or p in needed:
                continue
            if p in per_microbatch and kinds[p] is not None:
                sums.setdefault(v)
                continue
            needed.add(p)  # independent of the batch: recomputed after the sums
            stack.append(p)
    order = sorted(sums)
    arg_number = {a: i for i, a in enumerate(graph.args)}
    micro_ops = sorted(per_microbatch)
    micro_reads = {v for i in micro_ops for v in graph.reads(i)}
    micro_args = tuple(i for i, a in enumerate(graph.args) if a in micro_reads)
    update_reads = {v for i in needed for v in graph.reads(i)} | set(graph.results)
    update_args = tuple(i for i, a in enumerate(graph.args) if a in update_reads and i not in batch_args)
    if any(arg_number.get(v) in batch_args for v in update_reads if v in arg_number):
        raise ValueError("a batch argument is read after the sums")
    microbatch = extract_function(
        graph, micro_ops, inputs=[graph.args[i] for i in micro_args], outputs=order, name="main"
    )
    update = extract_function(
        graph,
        sorted(needed),
        inputs=[graph.args[i] for i in update_args] + order,
        outputs=list(graph.results),
        name="main",
    )
    for extraction in (microbatch, update):
        strip_kinds(extraction.func)
    shapes = tuple(tuple(graph.values[a].shape) for a in graph.args)
    return SplitStep(
        b, batch_args, microbatch, update, micro_args, update_args, len(graph.args), shapes, read_index_arg(main)
    )


def microbatch_index_values(microbatches: int) -> np.ndarray:
    """The whole index argument: row k of it is microbatch k's."""
    return np.arange(microbatches, dtype=np.int32)


def read_index_arg(main: ir.Operation) -> int | None:
    """The argument number of the microbatch index of a split `@main`, or None."""
    if INDEX_ARG_ATTR not in main.attributes:
        return None
    return ir.IntegerAttr(main.attributes[INDEX_ARG_ATTR]).value


def index_argument(main: ir.Operation) -> ir.Value:
    """The microbatch index argument of `@main`, appended on first use."""
    block = main.regions[0].blocks[0]
    number = read_index_arg(main)
    if number is not None:
        return block.arguments[number]
    i32 = ir.IntegerType.get_signless(32)
    argument = block.add_argument(ir.RankedTensorType.get([1], i32), ir.Location.unknown())
    number = len(block.arguments) - 1
    function_type = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    main.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in block.arguments], list(function_type.results))
    )
    if "arg_attrs" in main.attributes:
        attrs = list(ir.ArrayAttr(main.attributes["arg_attrs"]))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs + [ir.DictAttr.get({})])
    main.attributes[INDEX_ARG_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), number)
    return argument


def kind_of_value(graph: FuncGraph, kinds: list[str | None], v: int, batch_args: Sequence[int]) -> str | None:
    """The kind of value `v`: its producer's, `batch` for a batch argument, else None."""
    p = graph.values[v].producer
    if p is None:
        return BATCH if graph.values[v].arg_index in batch_args else None
    return kinds[p]


def strip_kinds(func: ir.Operation) -> None:
    """Removes `hlopar.microbatch` from the top-level ops of `func`."""
    for op in func.regions[0].blocks[0].operations:
        if KIND_ATTR in op.operation.attributes:
            del op.operation.attributes[KIND_ATTR]
