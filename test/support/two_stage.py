"""A hand-made two-stage split of a training step, for the tests only.

Roles: forward = ancestors of the loss (the last result); update = ops outside the forward
that are elementwise (or broadcasts) and whose users are all update ops (Adam's moments and
parameter step); backward = the rest. Stages: forward ops before the middle forward
`dot_general` go to stage 0, the others to stage 1. An op reading forward values goes to the
last stage whose forward reads one of them; another one to the lowest stage among the
producers of its operands (backward runs from the last stage to the first); an op reading
only arguments and constants to the lowest stage among its users.
"""

from __future__ import annotations

from hlopar.ir.graph import FuncGraph

ELEMENTWISE = {
    "stablehlo." + name
    for name in (
        "add",
        "subtract",
        "multiply",
        "divide",
        "sqrt",
        "rsqrt",
        "power",
        "convert",
        "broadcast_in_dim",
        "maximum",
        "minimum",
        "select",
        "compare",
        "negate",
        "exponential",
        "log",
        "abs",
        "sign",
        "constant",
    )
}


def roles_of(graph: FuncGraph) -> list[str]:
    count = len(graph.ops)
    forward = set()
    stack = [graph.values[graph.results[-1]].producer]
    while stack:
        op = stack.pop()
        if op is None or op in forward:
            continue
        forward.add(op)
        stack.extend(graph.values[v].producer for node in graph.ops[op].walk() for v in node.operands)
    update: set[int] = set()
    for index in reversed(range(count)):
        op = graph.ops[index]
        if index in forward or op.name not in ELEMENTWISE:
            continue
        users = {u for v in op.results for u in graph.values[v].users}
        if users <= update:
            update.add(index)
    return ["forward" if i in forward else "update" if i in update else "backward" for i in range(count)]


def stages_of(graph: FuncGraph, roles: list[str]) -> list[int]:
    count = len(graph.ops)
    dots = [i for i, op in enumerate(graph.ops) if roles[i] == "forward" and op.name == "stablehlo.dot_general"]
    cut = dots[len(dots) // 2]
    stage: list[int | None] = [0 if i < cut else 1 if roles[i] == "forward" else None for i in range(count)]
    # A forward value belongs to the last stage whose forward reads it (its layer's backward
    # needs it there).
    used_on = {}
    for index in range(count):
        if roles[index] == "forward":
            for v in graph.ops[index].results:
                readers = [u for u in graph.values[v].users if roles[u] == "forward"]
                used_on[v] = max([stage[u] for u in readers], default=stage[index])
    for index, op in enumerate(graph.ops):
        if roles[index] == "forward":
            continue
        operands = [
            v
            for node in op.walk()
            for v in node.operands
            if graph.values[v].producer not in (None, index)
            and graph.ops[graph.values[v].producer].name != "stablehlo.constant"
        ]
        forward = [used_on[v] for v in operands if v in used_on]
        later = [stage[graph.values[v].producer] for v in operands if v not in used_on]
        known = [s for s in later if s is not None]
        stage[index] = max(forward) if forward else min(known) if known else None
    for index in reversed(range(count)):
        if stage[index] is None:
            users = {u for v in graph.ops[index].results for u in graph.values[v].users}
            known = [stage[u] for u in users if stage[u] is not None]
            stage[index] = min(known) if known else 0
    return stage
