"""Unrolling a loop over layers, and tidying the reshapes and reads the unstacked pieces leave
(`hlopar-unstack-layer-scans`, steps 1 and 3 of its docstring)."""

from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.dataflow import ELEMENTWISE_LIKE_OPS
from hlopar.dialect.attributes import LAYER_ITERATION_ATTR
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.extract import clone_into
from hlopar.ir.graph import FuncGraph
from hlopar.passes.layer_scans.values import constant_int, dense_ints, is_constant, shape_of

__all__ = ["canonicalize", "fold_unit_reshapes", "merge_repeated_reshapes", "read_where_used", "unroll"]


def unroll(
    op: ir.Operation, trips: int, masks: dict[tuple[ir.Value, int], ir.Value] | None = None, loop: int = 0
) -> None:
    """Replaces a `while` that runs `trips` times by `trips` copies of its body.

    A value the loop carries unchanged and that is computed from constants alone (the causal
    mask JAX hoists out of a scan) is recomputed at the start of each copy, as each layer of
    the model written with a Python loop computes it: one shared copy, as big as an attention
    score tensor, would be read by every layer across every stage boundary. `masks` keeps the
    copies by (hoisted value, layer): a later loop over the same layers (the backward, layer
    L-1-i in its copy i) reads the copy of its copy's layer, as the backward of the
    Python-loop model reads its forward's mask (a residual, stashed like the twin's).

    Each copy of a body op is tagged `hlopar.layer_iteration = [loop, iteration, body op,
    layer]` (`loop`: the loop's number among the unrolled ones; layer -1 where the body reads
    no layer slice), so that `hlopar-reroll-stage-loops` can find a stage's iterations again."""
    masks = {} if masks is None else masks
    loop_op = op
    body = loop_op.regions[1].blocks[0]
    carried = list(loop_op.operands)
    ops = list(body.operations)
    returned = list(ops[-1].operands)
    recomputed = [
        k
        for k, (arg, value) in enumerate(zip(body.arguments, carried))
        if returned[k] == arg and _from_constants(value) and not is_constant(value)
    ]
    layer_read = _layer_read(body, trips)
    with ir.InsertionPoint(loop_op), loop_op.location:
        for iteration in range(trips):
            carried = [_folded(v) for v in carried]  # the counter: the copies' layer indices are constants
            mapping = dict(zip(body.arguments, carried))
            recomputes: list[ir.Operation] = []
            for k in recomputed:
                mapping[body.arguments[k]] = _recompute(carried[k], recomputes)
            clones = [clone_into(body_op.operation, mapping) for body_op in ops[:-1]]
            layer = constant_int(mapping[layer_read]) if layer_read is not None else None
            for number, clone in [(-1, op) for op in recomputes] + list(enumerate(clones)):
                clone.attributes[LAYER_ITERATION_ATTR] = ir.DenseI64ArrayAttr.get(
                    [loop, iteration, number, -1 if layer is None else layer]
                )
            for k in recomputed if layer is not None else ():
                copy, key = mapping[body.arguments[k]], (loop_op.operands[k], layer)
                if key in masks:
                    copy.replace_all_uses_with(masks[key])  # the recomputed copy is dead now
                else:
                    masks[key] = copy
            carried = [mapping.get(v, v) for v in ops[-1].operands]
            for k in recomputed:
                carried[k] = loop_op.operands[k]
    for old, new in zip(loop_op.results, carried):
        old.replace_all_uses_with(new)
    loop_op.erase()


def _layer_read(body: ir.Block, trips: int) -> ir.Value | None:
    """The index at which the loop body reads its layer's slice of a stacked operand."""
    for op in body.operations:
        op = op.operation
        if (
            op.name == "stablehlo.dynamic_slice"
            and isinstance(op.operands[0].owner, ir.Block)
            and (shape_of(op.operands[0]) or [0])[0] == trips
            and dense_ints(op, "slice_sizes")[0] == 1
        ):
            return op.operands[1]
    return None


def _folded(value: ir.Value) -> ir.Value:
    """A constant for a scalar integer computed from constants (a loop counter), else `value`."""
    if shape_of(value) != [] or is_constant(value):
        return value
    t = ir.RankedTensorType(value.type)
    number = constant_int(value) if isinstance(t.element_type, ir.IntegerType) else None
    if number is None:
        return value
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, number))).result


# Ops cheap to recompute where a layer reads their result, when they read only constants.
_RECOMPUTABLE = (
    frozenset(
        {
            "stablehlo.iota",
            "stablehlo.broadcast_in_dim",
            "stablehlo.reshape",
            "stablehlo.transpose",
            "stablehlo.convert",
        }
    )
    | ELEMENTWISE_LIKE_OPS
)


def _from_constants(value: ir.Value) -> bool:
    """Whether `value` is computed by recomputable ops from constants and iotas alone."""
    owner = value.owner
    if not isinstance(owner, ir.OpView):
        return False
    op = owner.operation
    if op.name == "stablehlo.constant":
        return True
    return op.name in _RECOMPUTABLE and all(_from_constants(v) for v in op.operands)


def _recompute(value: ir.Value, made: list[ir.Operation]) -> ir.Value:
    """A fresh copy, at the insertion point, of the ops that make `value` from constants
    (appended to `made`)."""
    op = value.owner.operation
    if op.name == "stablehlo.constant":
        return value
    operands = [_recompute(operand, made) for operand in op.operands]  # made first: they come before
    clone = op.clone()
    made.append(clone)
    for k, operand in enumerate(operands):
        clone.operands[k] = operand
    return clone.results[list(op.results).index(value)]


def fold_unit_reshapes(main: ir.Operation) -> None:
    """Reshapes of values that only gained unit dims read the value itself.

    A scan stacks each residual by `broadcast_in_dim` to `1 x shape` (then written at layer i);
    its backward loop reads it back by `reshape` to `shape`. Unstacked, that pair is all that
    is left, between a forward value and its backward readers: clustering would see the
    backward read an op of the backward (its layer: the nearest cotangent) instead of the
    forward value (its layer: the forward readers'), and shift the weight gradients of each
    layer to another. The model written with a Python loop reads the forward value directly,
    and so does this after the fold. `canonicalize` does not fold a reshape of a broadcast."""
    for op in list(main.regions[0].blocks[0].operations):
        op = op.operation
        if op.name != "stablehlo.reshape":
            continue
        source = _before_unit_dims(op.operands[0])
        if source == op.operands[0]:
            continue
        if source.type == op.results[0].type:
            op.results[0].replace_all_uses_with(source)
        else:
            op.operands[0] = source


def merge_repeated_reshapes(main: ir.Operation) -> None:
    """A reshape of a value that an earlier reshape already made, to the same type, reads that one.

    The backward loop of a scan reshapes the residuals it reads (a query's heads split) as
    the forward loop did; the model written with a Python loop reads the forward's reshape.
    Clustering places a backward op by what it reads: the forward's reshape (a forward
    value, the layer of its readers) or the backward's own copy (a backward value, the layer
    of the nearest cotangent) can place an attention gradient in different layers. Not `cse`
    at large (see `_canonicalize`): reshapes of one value only, which is one value either way;
    not of arguments, which the twin's backward reads itself (a reshape made in the forward
    and read by the backward would be stashed per microbatch as an activation)."""
    made: dict[tuple, ir.Value] = {}
    for op in list(main.regions[0].blocks[0].operations):
        op = op.operation
        if op.name != "stablehlo.reshape" or isinstance(op.operands[0].owner, ir.Block):
            continue  # the backward's reshape of a parameter stays: the forward's is no activation
        key = (op.operands[0], str(op.results[0].type))
        if key in made:
            op.results[0].replace_all_uses_with(made[key])
            op.erase()
        else:
            made[key] = op.results[0]


def read_where_used(main: ir.Operation) -> None:
    """Reshapes of arguments and values made from constants alone move to just before their
    first reader (the other ops keep their order).

    A scan's body reads all its layer's parameters at its start, and the unrolled copies
    recompute the hoisted causal mask there too: layer i's reshapes of its parameter pieces
    (`1 x shape` to `shape`) and its mask come ahead of the ops that read them. Clustering
    cuts the forward in program order: with a cut inside a block, the mask (as big as the
    attention scores) would cross the cut, and the parameters read after it would be updated
    in the layer before it (an update follows the first forward op reading its parameter).
    The model written with a Python loop reads each where it is used, and so does this."""
    graph = FuncGraph.from_func(main)
    # Not the parameters of checkpointed blocks: the backward's recompute of a block is placed
    # by the parameter reshapes it reads (where the twin's barrier reads the parameters), so
    # with them spread over a block's layers, a cut inside the block would make the recompute
    # of its second half read the barrier of its first: a backward running forwards.
    checkpointed = any(node.name == "stablehlo.optimization_barrier" for node in graph.ops)
    arguments = set() if checkpointed else set(graph.args)
    constant = [node.name == "stablehlo.constant" for node in graph.ops]
    movable = [False] * len(graph.ops)
    for node in graph.ops:
        made = [graph.values[v].producer for v in node.operands]
        if node.name in _RECOMPUTABLE and not node.regions and all(p is not None and constant[p] for p in made):
            constant[node.index] = movable[node.index] = True
        elif node.name == "stablehlo.reshape" and node.operands[0] in arguments:
            movable[node.index] = True
    order: list[int] = []
    placed = [False] * len(graph.ops)

    def place(i: int) -> None:
        for p in graph.predecessors(i):
            if movable[p] and not placed[p]:
                place(p)
        placed[i] = True
        order.append(i)

    *body, ret = graph.ops
    for node in body:
        if not movable[node.index]:
            place(node.index)
    for node in body:  # read by nobody
        if not placed[node.index]:
            place(node.index)
    for i in order:
        graph.ops[i].mlir_op.move_before(ret.mlir_op)


def _before_unit_dims(value: ir.Value) -> ir.Value:
    """The value `value` is a reshape of, through reshapes and broadcasts that only add unit dims."""
    while isinstance(value.owner, ir.OpView):
        op = value.owner.operation
        if op.name == "stablehlo.reshape" or op.name == "stablehlo.broadcast_in_dim" and _adds_unit_dims(op):
            value = op.operands[0]
        else:
            break
    return value


def _adds_unit_dims(broadcast: ir.Operation) -> bool:
    """Whether a broadcast_in_dim keeps its operand's elements in order and only inserts dims of size 1."""
    dims = dense_ints(broadcast, "broadcast_dimensions")
    source, result = shape_of(broadcast.operands[0]), shape_of(broadcast.results[0])
    return (
        dims == sorted(dims)
        and int(np.prod(source)) == int(np.prod(result))
        and all(result[d] == n for d, n in zip(dims, source))
    )


def canonicalize(module: ir.Operation) -> None:
    """Folds the unrolled counters and removes dead ops. Not `cse`: merging the layers'
    identical ops (a zero buffer of the forward and one of the update) would make one value
    that several stages' fragments read, made in whichever stage comes first."""
    try:
        passmanager.PassManager.parse("builtin.module(canonicalize)", context=module.context).run(module)
    except ir.MLIRError as error:
        raise DiagnosticError.from_mlir_error(error) from None
