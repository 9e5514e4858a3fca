"""What the split's analysis and rewrites share: the kinds inside the analysis, the refusal,
the op sets, and small helpers over the IR."""

from __future__ import annotations

from collections.abc import Sequence

from jaxlib.mlir import ir

from hlopar.analysis.dataflow import ELEMENTWISE_OPS
from hlopar.dialect.attributes import BATCH, STEP, SUM
from hlopar.ir.diagnostics import source_location
from hlopar.ir.graph import FuncGraph
from hlopar.passes.microbatching.batch_statistics import splat_value

MESH = "hlopar_microbatch"
AXIS = "mb"
# Per-microbatch values that carry no examples, written "batch" (they run per microbatch):
LOCAL = "local"  # a statistic of the microbatch (from its means over the batch): averaged when it leaves
LOCAL_SUM = "local-sum"  # linear in the microbatch's sums, statistics as coefficients: summed when it leaves
# Inside a loop: a carried value that is zero so far (zeros that sums are written or added into).
ZERO = "zero"
SDY_SHARDING = "sdy.sharding"

# Ops that only need their result types changed when a dim is divided (besides elementwise ops).
TYPE_ONLY_OPS = (
    ELEMENTWISE_OPS
    | frozenset(
        "stablehlo." + n
        for n in [
            "broadcast_in_dim",
            "reshape",
            "transpose",
            "dot_general",
            "dot",
            "convolution",
            "reduce",
            "reduce_window",  # a window over the batch is refused (`BatchChecks._check_window`)
            "select_and_scatter",
            "select",
            "compare",
            "convert",
            "bitcast_convert",
            "concatenate",
            "gather",
            "scatter",
            "dynamic_update_slice",
            "while",
            "case",
            "if",
            "reverse",
            "sort",
            "map",
            "optimization_barrier",
            "rng_bit_generator",
            "batch_norm_inference",
            "cholesky",
            "triangular_solve",
            "fft",
            "reduce_precision",
            "return",
            "copy",
            "exponential_minus_one",
            "log_plus_one",
        ]
    )
    | {"stablehlo.return", "func.return"}
)
# Ops whose sum over a batch factor is a plain sum of the inputs' examples.
SUM_OPS = frozenset(
    {"stablehlo.reduce", "stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution", "stablehlo.scatter"}
)
# Real control flow: a loop or branch whose regions run the step's own ops, with kinds of their
# own (`KindAnalysis._control_flow_kinds`). Other ops with a region (reduce, reduce_window,
# select_and_scatter, scatter, sort, map) apply it to elements: their rule says how they split.
CONTROL_FLOW_OPS = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if"})
# Ops linear in a sum operand (with the other operands independent of the batch).
STRUCTURAL_OPS = frozenset(
    "stablehlo." + n for n in ["reshape", "transpose", "broadcast_in_dim", "slice", "reverse", "copy", "negate"]
)


class SplitError(Exception):
    """Why a step cannot be microbatched, at an op."""

    def __init__(self, op: ir.Operation | None, message: str):
        super().__init__(message)
        self.op = op


def ancestors(graph: FuncGraph, op: int | None, stop: set[int]) -> set[int]:
    """`op` and the top-level ops it is computed from, not looking past the ops in `stop`."""
    return ancestors_of(graph, [op] if op is not None else [], stop)


def ancestors_of(graph: FuncGraph, ops: Sequence[int], stop: set[int]) -> set[int]:
    """`ops` and the top-level ops they are computed from, not looking past the ops in `stop`."""
    found: set[int] = set()
    stack = list(ops)
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        if i not in stop:
            stack.extend(graph.predecessors(i))
    return found


def top_op(op: ir.Operation, func: ir.Operation) -> ir.Operation:
    """The op of `func`'s body that `op` is or sits in."""
    while op.parent != func:
        op = op.parent
    return op


def walk_ops(func: ir.Operation) -> list[ir.Operation]:
    """Every op inside `func`, pre-order (the same order in a clone)."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    found.append(inner.operation)
                    visit(inner.operation)

    visit(func)
    return found


def batch_sharding(rank: int, batch_dim: int | None, *, closed: bool) -> ir.Attribute:
    dims = []
    for d in range(rank):
        if d == batch_dim:
            dims.append(f'{{"{AXIS}"}}')
        else:
            dims.append("{}" if closed else "{?}")
    return ir.Attribute.parse(f"#sdy.sharding<@{MESH}, [{', '.join(dims)}]>")


def allocate(division: int, sizes: list[int]) -> list[int] | None:
    """How a dim's division spreads over its factors, major first (None: it cannot)."""
    shares, left = [], division
    for size in sizes:
        if left == 1:
            shares.append(1)
        elif size % left == 0:
            shares.append(left)
            left = 1
        elif left % size == 0:
            shares.append(size)
            left //= size
        else:
            return None
    return shares if left == 1 else None


def reduces_by_add(op: ir.Operation, region: int = 0) -> bool:
    """Whether the op's body (its region `region`) returns the sum of its two block arguments."""
    block = op.regions[region].blocks[0]
    ops = [o.operation for o in block.operations]
    if len(ops) != 2 or ops[0].name != "stablehlo.add" or len(block.arguments) != 2:
        return False
    return set(ops[0].operands) == set(block.arguments) and ops[1].operands[0] == ops[0].results[0]


def is_zero(value: ir.Value) -> bool:
    """A splat zero constant, possibly broadcast, reshaped or converted."""
    return splat_value(value) == 0.0


def int_attr(op: ir.Operation, name: str) -> int:
    return ir.IntegerAttr(op.attributes[name]).value if name in op.attributes else 1


def divided_type(type_: ir.Type, div: tuple[int, ...]) -> ir.RankedTensorType:
    tensor = ir.RankedTensorType(type_)
    return ir.RankedTensorType.get([s // d for s, d in zip(tensor.shape, div)], tensor.element_type, tensor.encoding)


def linear_in_sums(name: str, op: ir.Operation, kinds: list[str | None]) -> bool:
    """Whether an op is linear in its sum operands (`kinds`: SUM, None or ZERO per operand;
    none STEP)."""
    sums = [k == SUM for k in kinds]
    zeros = [k == ZERO or is_zero(v) for k, v in zip(kinds, op.operands)]
    if name in STRUCTURAL_OPS or name == "stablehlo.convert":
        return sums[0] and all(sums)
    if name in ("stablehlo.add", "stablehlo.subtract", "stablehlo.concatenate"):
        return all(s or z for s, z in zip(sums, zeros))
    if name in ("stablehlo.multiply", "stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"):
        return sum(sums) == 1
    if name == "stablehlo.divide":
        return sums == [True, False]
    if name == "stablehlo.pad":
        return sums[0] and zeros[1]
    if name == "stablehlo.select":
        return not sums[0] and all(s or z for s, z in zip(sums[1:], zeros[1:]))
    if name == "stablehlo.reduce":
        n = len(op.results)
        return n == 1 and sums[0] and reduces_by_add(op) and zeros[1]
    if name == "stablehlo.dynamic_update_slice":  # a sum written into a sum (or zeros) at given indices
        return all(s or z for s, z in zip(sums[:2], zeros[:2])) and not any(sums[2:])
    if name in ("stablehlo.dynamic_slice", "stablehlo.gather"):
        return sums[0] and not any(sums[1:])
    if name == "stablehlo.scatter":  # sums added at indices into a sum (or zeros)
        return len(op.results) == 1 and reduces_by_add(op) and (sums[0] or zeros[0]) and sums[2] and not sums[1]
    if name == "stablehlo.select_and_scatter":  # a sum scattered where a value independent of it selects
        return sums == [False, True, False] and zeros[2] and reduces_by_add(op, region=1)
    if name == "stablehlo.reduce_window":  # sums over windows
        return len(op.results) == 1 and sums == [True, False] and zeros[1] and reduces_by_add(op)
    return False


def op_place(op: ir.Operation) -> str:
    location = source_location(op.location)
    return f"'{op.name}' ({location})" if location is not None else f"'{op.name}'"


def unshare_splats(func: ir.Operation, size: int) -> bool:
    """Gives each use of a splat constant with a dim of the batch's `size` (a constant, or a
    broadcast of one) its own copy; whether there was any to copy. `cse` merges equal splats
    whatever they mean: with a batch of 8 and a sequence of 8, one `broadcast 0 : 8x8` may
    serve the tokens (batch x sequence) and a causal mask (sequence x sequence), and the
    batch cannot be split along the one and not the other."""
    copied = False
    for op in reversed(walk_ops(func)):
        if len(op.results) != 1 or not isinstance(op.results[0].type, ir.RankedTensorType):
            continue
        if size not in ir.RankedTensorType(op.results[0].type).shape or splat_value(op.results[0]) is None:
            continue
        for use in list(op.results[0].uses)[1:]:
            copy = op.clone(ip=ir.InsertionPoint.after(op))
            use.owner.operands[use.operand_number] = copy.results[0]
            copied = True
    return copied


def invariant(op: ir.Operation, number: int) -> bool:
    """Whether a loop returns its carry `number` unchanged (its result is its operand)."""
    if op.name != "stablehlo.while":
        return False
    body = op.regions[1].blocks[0]
    return list(body.operations)[-1].operands[number] == body.arguments[number]


def value_origin(value: ir.Value) -> str:
    """Where a value is made, for messages."""
    if isinstance(value, ir.OpResult):
        return f"at {op_place(value.owner)}"
    return "a value the loop carries" if value.owner.owner.name == "stablehlo.while" else "an argument"


def join_kinds(a: str | None, b: str | None) -> str | None:
    """The kind of a value that is `a` or `b` (a loop's carry over iterations, a branch's
    result): zeros join anything; a sum and a value independent of the batch join to STEP
    (their microbatches' values would not add up)."""
    if a == b or b == ZERO:
        return a
    if a == ZERO:
        return b
    return BATCH if BATCH in (a, b) else STEP
