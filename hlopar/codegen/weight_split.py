"""Backward weight delaying (cross-mesh resharding paper, §4): a backward fragment cut in two.

B computes the results other stages wait for (the gradients of the stage's inputs, sent at
once) and everything they need; W computes the rest (the weight gradients, summed over
microbatches), which nobody waits for, so a schedule can run W later and let B's sends
overlap it. An op both halves need goes to B, except an op that reads nothing (a
constant), which W computes again. Values B computes that W also reads (or returns) are
handed over: results of B, extra arguments of W, held on the mesh from B to W (`carried`).

`split_ops` is the slicing, over plain data (which values each op reads and defines);
`split_module` applies it to a fragment's standalone module (`fragments.fragment_module`) and
cuts the two modules out of it with `ir.extract.extract_function`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from jaxlib.mlir import ir

from hlopar.analysis.sharding import ShardingPerValue, TensorSharding
from hlopar.codegen.fragments import SDY_SHARDING, sharding_attrs
from hlopar.ir.extract import extract_function
from hlopar.ir.graph import FuncGraph

__all__ = ["OpSplit", "SplitModules", "split_module", "split_ops"]


@dataclass(frozen=True)
class OpSplit:
    """Which ops of a backward go to B and W, and what crosses between them (value ids)."""

    input_ops: tuple[int, ...]  # B, program order
    weight_ops: tuple[int, ...]  # W, program order (constants W reads are in both)
    input_args: tuple[int, ...]  # values no op defines (arguments) that B reads or returns, ascending
    weight_args: tuple[int, ...]  # the same for W
    carried: tuple[int, ...]  # values B's ops define that W reads or returns, in order of definition


def split_ops(
    reads: Sequence[Iterable[int]],
    defines: Sequence[Iterable[int]],
    input_results: Iterable[int],
    weight_results: Iterable[int],
) -> OpSplit:
    """Cuts ops (program order, a topological order; `reads[i]`/`defines[i]` the values op i
    reads and defines) into B, every op the `input_results` depend on, and W, the others
    and the constants of B they read. Ops defining nothing stay in B, where they run first
    and once."""
    reads = [tuple(r) for r in reads]
    defines = [tuple(d) for d in defines]
    if len(reads) != len(defines):
        raise ValueError(f"{len(reads)} read lists for {len(defines)} ops")
    weight_results = tuple(weight_results)
    needed = set(input_results)
    in_input = [False] * len(reads)
    for i in reversed(range(len(reads))):
        if not defines[i] or needed.intersection(defines[i]):
            in_input[i] = True
            needed.update(reads[i])
    input_ops = tuple(i for i, b in enumerate(in_input) if b)
    rest = [i for i, b in enumerate(in_input) if not b]
    weight_reads = {v for i in rest for v in reads[i]} | set(weight_results)
    constants = [i for i in input_ops if not reads[i] and weight_reads.intersection(defines[i])]
    weight_ops = tuple(sorted(rest + constants))
    defined = {v for d in defines for v in d}
    carried = tuple(v for i in input_ops if i not in constants for v in defines[i] if v in weight_reads)
    return OpSplit(
        input_ops, weight_ops, tuple(sorted(needed - defined)), tuple(sorted(weight_reads - defined)), carried
    )


@dataclass(frozen=True)
class SplitModules:
    """A backward module cut into B and W. A half with no result is None and the other is
    the whole module. B returns its results, then the carried values that are not among
    them; W takes its arguments, then the carried values."""

    input: ir.Operation | None
    weight: ir.Operation | None
    input_args: tuple[int, ...]  # argument numbers of the whole module B takes, in order
    weight_args: tuple[int, ...]  # those W takes (before the carried values)
    input_results: tuple[int, ...]  # result positions of the whole module B returns (before the carried)
    weight_results: tuple[int, ...]  # those W returns
    carried_from: tuple[int, ...] = ()  # per carried value (W's last arguments), its position among B's results
    carried_bytes: tuple[int, ...] = ()  # per carried value


def split_module(module: ir.Operation, weight_results: Collection[int]) -> SplitModules:
    """Cuts `module`'s `@main` (a backward fragment's module) so that the results at positions
    `weight_results` come from W and the others from B. Carried values keep the layout the
    op making them has (`sdy.sharding`), else they are replicated."""
    graph = FuncGraph.from_module(module)
    weight = tuple(p for p in range(len(graph.results)) if p in set(weight_results))
    inputs = tuple(p for p in range(len(graph.results)) if p not in set(weight))
    every_arg = tuple(range(len(graph.args)))
    if not weight:
        return SplitModules(module, None, every_arg, (), inputs, (), ())
    if not inputs:
        return SplitModules(None, module, (), every_arg, (), weight, ())
    split = split_ops(
        [graph.reads(i) for i in range(len(graph.ops))],
        [op.results for op in graph.ops],
        [graph.results[p] for p in inputs],
        [graph.results[p] for p in weight],
    )
    returned = [graph.results[p] for p in inputs]
    extra = [v for v in split.carried if v not in returned]
    b = extract_function(graph, split.input_ops, inputs=split.input_args, outputs=returned + extra)
    w = extract_function(
        graph, split.weight_ops, inputs=split.weight_args + split.carried, outputs=[graph.results[p] for p in weight]
    )
    symbol = _mesh_symbol(module)
    with module.context:
        for k, v in enumerate(split.carried):
            attrs = sharding_attrs(_layout(graph, v), symbol, len(graph.values[v].shape))
            if v in extra:
                _set_attrs(b.func, "res_attrs", len(returned) + extra.index(v), attrs)
            _set_attrs(w.func, "arg_attrs", len(split.weight_args) + k, attrs)
    position = {v: j for j, v in reversed(list(enumerate(returned + extra)))}
    return SplitModules(
        b.module,
        w.module,
        split.input_args,
        split.weight_args,
        inputs,
        weight,
        tuple(position[v] for v in split.carried),
        tuple(graph.values[v].nbytes or 0 for v in split.carried),
    )


def _layout(graph: FuncGraph, v: int) -> TensorSharding | None:
    """The layout of a top-level op's result as the op states it."""
    op = graph.defining_op(v).mlir_op
    if op.name == "sdy.sharding_constraint":
        return TensorSharding.parse(str(op.attributes["sharding"]))
    if SDY_SHARDING in op.attributes:
        return ShardingPerValue.parse(str(op.attributes[SDY_SHARDING]))[graph.values[v].result_index]
    return None


def _mesh_symbol(module: ir.Operation) -> str:
    """The module's first `sdy.mesh` (a fragment module's own mesh comes first)."""
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh":
            return ir.StringAttr(op.operation.attributes["sym_name"]).value
    raise ValueError("the module has no sdy.mesh")


def _set_attrs(func: ir.Operation, key: str, position: int, attrs: ir.DictAttr) -> None:
    items = list(ir.ArrayAttr(func.attributes[key]))
    items[position] = attrs
    func.attributes[key] = ir.ArrayAttr.get(items)
