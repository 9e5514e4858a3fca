"""Inlining `func.call`s, for hlopar-import.

jaxlib's MLIR does not register the func dialect's inliner interface, so the upstream
`inline` pass leaves every call in place. jaxlib does ship `inlined_func_call`, which
clones a single-block callee at the insertion point; this module drives it over the
call graph. Functions on a call cycle (recursion) are not inlined: their calls stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import sdy


def recursive_functions(calls: Mapping[str, Sequence[str]]) -> set[str]:
    """Functions that can reach themselves through calls (Tarjan's SCCs, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: set[str] = set()
    counter = 0
    for root in calls:
        if root in index:
            continue
        work = [(root, iter(calls.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(calls.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in calls.get(node, ()):
                    result.update(component)
    return result


def inline_calls(module: ir.Operation) -> int:
    """Inlines every call to a non-recursive, single-block function. Returns how many."""
    functions = {
        _symbol_name(op): op
        for op in module.regions[0].blocks[0].operations
        if op.operation.name == "func.func" and len(op.regions[0].blocks) == 1
    }
    calls = _call_sites(module)
    graph: dict[str, list[str]] = {name: [] for name in functions}
    for caller, callee, _ in calls:
        graph.setdefault(caller, []).append(callee)
    keep = recursive_functions(graph)

    def inlinable(callee: str, call: ir.Operation) -> bool:
        return callee in functions and callee not in keep and not _feeds_call_only_op(call)

    inlined = 0
    pending = [call for _, callee, call in calls if inlinable(callee, call)]
    while pending:
        for call in pending:
            callee = functions[_callee(call)]
            with ir.InsertionPoint(call), call.location:
                arguments = _constrained(list(call.operands), _shardings(callee, "arg_attrs"))
                results = _jax_mlir_ext.inlined_func_call(callee.operation, arguments, call.location)
                results = _constrained(list(results), _shardings(callee, "res_attrs"))
            for old, new in zip(call.results, results):
                old.replace_all_uses_with(new)
            call.erase()
            inlined += 1
        # The inlined bodies may hold calls of their own: scan again until none is left.
        pending = [call for _, name, call in _call_sites(module) if inlinable(name, call)]
    return inlined


def _shardings(func, key: str) -> list[ir.Attribute | None]:
    """The `sdy.sharding` of each argument or result of a function (None where it has none)."""
    if key not in func.operation.attributes:
        return []
    found = []
    for attrs in ir.ArrayAttr(func.operation.attributes[key]):
        attrs = ir.DictAttr(attrs)
        found.append(attrs["sdy.sharding"] if "sdy.sharding" in attrs else None)
    return found


def _constrained(values: list[ir.Value], shardings: list[ir.Attribute | None]) -> list[ir.Value]:
    """A callee's argument and result shardings are constraints: they outlive inlining."""
    return [
        sdy.ShardingConstraintOp(value, sharding).result if sharding is not None else value
        for value, sharding in zip(values, shardings + [None] * (len(values) - len(shardings)))
    ]


# Ops whose verifier requires their operand to be the result of a call.
_CALL_RESULT_CONSUMERS = ("sdy.func_data_flow_edge",)


def _feeds_call_only_op(call: ir.Operation) -> bool:
    return any(use.owner.name in _CALL_RESULT_CONSUMERS for result in call.results for use in result.uses)


def _call_sites(module: ir.Operation) -> list[tuple[str, str, ir.Operation]]:
    """(caller, callee, call op) for every func.call, nested regions included."""
    sites: list[tuple[str, str, ir.Operation]] = []
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name != "func.func":
            continue
        caller = _symbol_name(op)

        def visit(inner: ir.Operation, caller=caller) -> ir.WalkResult:
            if inner.name == "func.call":
                sites.append((caller, _callee(inner), inner))
            return ir.WalkResult.ADVANCE

        op.operation.walk(visit)
    return sites


def _symbol_name(op) -> str:
    return ir.StringAttr(op.operation.attributes["sym_name"]).value


def _callee(call: ir.Operation) -> str:
    return ir.FlatSymbolRefAttr(call.attributes["callee"]).value
