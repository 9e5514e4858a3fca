"""The data flow of a function's top-level ops, as the training-step analyses read it
(`step_io`, `training_roles`, `op_layers`): which ops feed which, what computes from constants
alone, the JAX name stack of an op, and the op families they walk through.
"""

from __future__ import annotations

from hlopar.ir.graph import FuncGraph

__all__ = [
    "CONSTANT_OPS",
    "ELEMENTWISE_LIKE_OPS",
    "ELEMENTWISE_OPS",
    "MATMUL_OPS",
    "PASS_THROUGH_OPS",
    "UPDATE_WALK_OPS",
    "ancestors",
    "constant_derived",
    "name_stack",
    "predecessors",
]


# Elementwise ops (and the ops that make or spread values for them): the optimizer's
# arithmetic on parameter-shaped tensors and the scalars it broadcasts.
ELEMENTWISE_OPS = frozenset(
    "stablehlo." + name
    for name in [
        "abs",
        "cbrt",
        "ceil",
        "convert",
        "count_leading_zeros",
        "cosine",
        "exponential",
        "exponential_minus_one",
        "floor",
        "imag",
        "is_finite",
        "log",
        "log_plus_one",
        "logistic",
        "not",
        "negate",
        "popcnt",
        "real",
        "round_nearest_afz",
        "round_nearest_even",
        "rsqrt",
        "sign",
        "sine",
        "sqrt",
        "tan",
        "tanh",
        "reduce_precision",
        "add",
        "atan2",
        "complex",
        "divide",
        "maximum",
        "minimum",
        "multiply",
        "or",
        "power",
        "remainder",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "subtract",
        "xor",
        "and",
        "compare",
        "clamp",
        "select",
    ]
)
# Elementwise ops and sharding constraints: an op whose result is its operands' shape, row by
# row. The layer-scan rewrites follow a stacked value through these and the stage-loop rewrite
# clones them a row dimension wider (a constraint's sharding gains that dimension).
ELEMENTWISE_LIKE_OPS = ELEMENTWISE_OPS | {"sdy.sharding_constraint"}
CONSTANT_OPS = frozenset({"stablehlo.constant", "stablehlo.iota"})
# What an optimizer's update is made of: the walk back from a new state value goes through these.
UPDATE_WALK_OPS = ELEMENTWISE_OPS | CONSTANT_OPS | {"stablehlo.broadcast_in_dim"}
# Ops whose results are their operands unchanged (a typed key's sharding constraint).
PASS_THROUGH_OPS = frozenset({"sdy.sharding_constraint", "sdy.reshard", "stablehlo.optimization_barrier"})
MATMUL_OPS = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})


def name_stack(graph: FuncGraph, i: int) -> str | None:
    """The JAX name stack of top-level op `i`, e.g. "jit(step)/transpose(jvp(layer_3))/dot_general"."""
    location = graph.ops[i].location
    return None if location is None else location.name


def predecessors(graph: FuncGraph) -> list[list[int]]:
    """Per top-level op, the top-level ops whose results it reads (nested reads included)."""
    preds: list[list[int]] = [[] for _ in graph.ops]
    for value in graph.values:
        p = value.producer
        if p is None:
            continue
        for user in value.users:
            if user != p:
                preds[user].append(p)
    return preds


def ancestors(preds: list[list[int]], *starts: int | None) -> set[int]:
    """The `starts` (None: an argument) and every top-level op they depend on."""
    seen = {start for start in starts if start is not None}
    stack = list(seen)
    while stack:
        for p in preds[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def constant_derived(graph: FuncGraph, preds: list[list[int]]) -> list[bool]:
    """Per top-level op, whether it computes from constants alone (no argument reaches it)."""
    values = graph.values
    derived = [False] * len(graph.ops)
    for i in range(len(graph.ops)):
        derived[i] = all(derived[p] for p in preds[i]) and not any(values[v].is_arg for v in graph.reads(i))
    return derived
