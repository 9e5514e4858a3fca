"""Cut a set of top-level ops out of a function into a standalone module, and clone ops with
their operands remapped.

Planning one pipeline stage, compiling one fragment or measuring one layer all need the same
thing: some ops of a function as a function of their own. Values the ops read from outside
become its arguments, values they define that are read outside (or returned by the source
function) become its results. The source is left untouched: the ops are cloned.

Values are named by their `FuncGraph` ids; only function arguments and results of top-level
ops can cross the cut (a value defined inside a region is only read inside that op).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, MutableMapping, Sequence
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect

from hlopar.ir.graph import FuncGraph

__all__ = ["Extraction", "boundary", "clone_into", "extract_function", "value_of"]


def boundary(graph: FuncGraph, ops: Collection[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(inputs, outputs) of a set of top-level ops, as value ids.

    Inputs are read by the ops (in nested regions too) and defined elsewhere, in order of
    first use; outputs are defined by the ops and read by other ops or returned, in order
    of definition.
    """
    selected = set(ops)
    returned = set(graph.results)
    inputs: dict[int, None] = {}
    outputs: list[int] = []
    for index in sorted(selected):
        op = graph.ops[index]
        for node in op.walk():
            for vid in node.operands:
                producer = graph.values[vid].producer
                if producer is None or producer not in selected:
                    inputs.setdefault(vid)
        for vid in op.results:
            users = graph.values[vid].users
            if vid in returned or any(user not in selected for user in users):
                outputs.append(vid)
    return tuple(inputs), tuple(outputs)


def value_of(graph: FuncGraph, vid: int) -> ir.Value:
    """The live `ir.Value` of a function argument or of a top-level op's result."""
    value = graph.values[vid]
    if value.arg_index is not None:
        return graph.mlir_func.regions[0].blocks[0].arguments[value.arg_index]
    if value.nested or value.def_op is None:
        raise ValueError(f"value {vid} is defined inside a region: it cannot cross a cut")
    return graph.ops[value.producer].mlir_op.results[value.result_index]


def clone_into(
    op: ir.Operation, mapping: MutableMapping[ir.Value, ir.Value], *, strict: Collection[ir.Value] = ()
) -> ir.Operation:
    """Clones `op` at the current insertion point, reading `mapping[v]` wherever it (or an op
    nested in it) read a value `v` of the mapping; records its results in `mapping`.

    `strict`: values that must not be read unmapped (the source function's values), so that
    a clone never silently points back into the source.
    """
    clone = op.clone()
    unmapped: list[str] = []

    def remap(inner: ir.Operation) -> ir.WalkResult:
        operands = inner.operands
        for position, operand in enumerate(operands):
            new = mapping.get(operand)
            if new is not None:
                operands[position] = new
            elif operand in strict:
                unmapped.append(inner.name)
                return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    clone.walk(remap)
    if unmapped:
        clone.erase()
        raise ValueError(f"'{unmapped[0]}' reads a value that is not an input of the extracted ops")
    for old, new in zip(op.results, clone.results):
        mapping[old] = new
    return clone


@dataclass(frozen=True)
class Extraction:
    """A standalone module made of some top-level ops of a function."""

    module: ir.Operation  # `builtin.module` holding the new function and the source's other symbols
    func: ir.Operation  # the new `func.func`, inside `module`
    ops: tuple[int, ...]  # the source's top-level op indices, program order (op k of the new body)
    inputs: tuple[int, ...]  # value ids that became the arguments, in order
    outputs: tuple[int, ...]  # value ids returned, in order


def extract_function(
    graph: FuncGraph,
    ops: Iterable[int],
    *,
    inputs: Sequence[int] | None = None,
    outputs: Sequence[int] | None = None,
    name: str = "main",
) -> Extraction:
    """Clones top-level ops of `graph`'s function, in program order, into a new module.

    `inputs` and `outputs` (value ids) default to `boundary`; given, they fix the order of
    the new function's arguments and results (they may add unused inputs or more outputs,
    but must cover what the ops read). The other top-level ops of the source module (sdy
    meshes, callees) are copied so that the function verifies; the source's argument and
    result attributes follow the values they belong to.
    """
    selected = tuple(sorted(set(ops)))
    default_inputs, default_outputs = boundary(graph, selected)
    inputs = default_inputs if inputs is None else tuple(inputs)
    outputs = default_outputs if outputs is None else tuple(outputs)
    source_func = graph.mlir_func
    context = source_func.context
    with context, ir.Location.unknown():
        module = ir.Operation.parse("module {}")
        body = module.regions[0].blocks[0]
        source_module = source_func.parent
        if source_module is not None:
            with ir.InsertionPoint(body):
                for op in source_module.regions[0].blocks[0].operations:
                    if op.operation != source_func:
                        if op.operation.name == "func.func" and _name(op.operation) == name:
                            raise ValueError(f"the source module already has a function @{name}")
                        op.operation.clone()
        input_values = [value_of(graph, v) for v in inputs]
        output_values = [value_of(graph, v) for v in outputs]
        function_type = ir.FunctionType.get([v.type for v in input_values], [v.type for v in output_values])
        with ir.InsertionPoint(body):
            new_func = func_dialect.FuncOp(name, function_type)
        _copy_value_attrs(graph, new_func.operation, inputs, outputs)
        block = new_func.add_entry_block()
        mapping: dict[ir.Value, ir.Value] = dict(zip(input_values, block.arguments))
        strict = _source_values(graph)
        with ir.InsertionPoint(block):
            for index in selected:
                clone_into(graph.ops[index].mlir_op, mapping, strict=strict)
            missing = [v for v, value in zip(outputs, output_values) if value not in mapping]
            if missing:
                raise ValueError(f"outputs {missing} are neither inputs nor defined by the extracted ops")
            func_dialect.ReturnOp([mapping[value] for value in output_values])
    return Extraction(module, new_func.operation, selected, inputs, outputs)


def _source_values(graph: FuncGraph) -> set[ir.Value]:
    values = set(graph.mlir_func.regions[0].blocks[0].arguments)
    for op in graph.ops:
        values.update(op.mlir_op.results)
    return values


def _name(func: ir.Operation) -> str:
    return ir.StringAttr(func.attributes["sym_name"]).value


def _value_attrs(func: ir.Operation, key: str) -> list[ir.Attribute] | None:
    return list(ir.ArrayAttr(func.attributes[key])) if key in func.attributes else None


def _copy_value_attrs(graph: FuncGraph, new_func: ir.Operation, inputs: Sequence[int], outputs: Sequence[int]) -> None:
    source = graph.mlir_func
    arg_attrs, res_attrs = _value_attrs(source, "arg_attrs"), _value_attrs(source, "res_attrs")
    empty = ir.DictAttr.get({})
    if arg_attrs is not None:
        new_func.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [arg_attrs[graph.values[v].arg_index] if graph.values[v].arg_index is not None else empty for v in inputs]
        )
    if res_attrs is not None:
        first_result: dict[int, int] = {}
        for position, vid in enumerate(graph.results):
            first_result.setdefault(vid, position)
        new_func.attributes["res_attrs"] = ir.ArrayAttr.get(
            [res_attrs[first_result[v]] if v in first_result else empty for v in outputs]
        )
