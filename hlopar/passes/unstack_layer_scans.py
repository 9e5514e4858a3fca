"""hlopar-unstack-layer-scans: a layer stack under `scan` becomes one piece per layer.

A scanned model (`jax.lax.scan` over stacked weights, Flax `nn.scan`) keeps its layers'
parameters in arrays with a leading layer axis and runs its blocks in a `while` loop
(`analysis.layer_scans`); its backward loop writes the stacked gradients, and the optimizer
updates the stacked parameters and state elementwise. A pipeline stage must hold only its
own layers, and stage construction cuts between top-level ops, so this pass:

1. unrolls each loop over layers (its body cloned once per iteration, the counter folded to
   constants by `canonicalize`), so that layer i's ops are ops of their own;
2. splits every value stacked along the layer axis (the stacked parameters and optimizer
   state among the arguments, the loop's stacked residuals, the stacked gradients, the
   updated state among the results) into L pieces of leading dim 1: reads of layer i
   (`dynamic_slice` at constant index i) read piece i, writes (`dynamic_update_slice`) replace
   piece i, elementwise ops (the optimizer) run per piece, sums over the layer axis (a global
   gradient norm) add the pieces' sums;
3. tidies what the loops leave that the model written with a Python loop has not, since
   clustering places ops by program order and by what they read: a residual stacked by
   `broadcast_in_dim` and read back by `reshape` is read directly (`fold_unit_reshapes`),
   the backward's reshape of a residual reads the forward's (`merge_repeated_reshapes`), and
   a layer's parameter reshapes and recomputed mask move to where they are read
   (`read_where_used`). The unrolled scanned GPT then clusters as its Python-loop twin does
   (same cuts, same matmuls per layer) and gets the same stages.

A value is split only if everything that reads it can follow the pieces, and only if it is
connected to a per-layer read or write; the rest is left as it is. `@main` then takes
the pieces as arguments and returns them as results: `hlopar.layer_pieces` on `@main` says
which argument and result of the original signature each one is a piece of (docs/ir.md),
so a caller slices the stacked arrays it passes and concatenates the pieces it gets back
(`dialect.layers.LayerPieces`).

Unrolling is what makes the cut points ops; it costs IR size (the unrolled stack is the size
of the same model written with a Python loop) and nothing at run time: the pieces are the
slices a stage would hold anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.layer_scans import layer_scans
from hlopar.dialect.attributes import LAYER_ITERATION_ATTR, LAYER_PIECES_ATTR
from hlopar.dialect.layers import LayerPieces
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.extract import clone_into
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions
from hlopar.ir.signature import FuncSignature
from hlopar.passes.base import ModulePass, PassContext, option, report_option

__all__ = ["UnstackLayerScansPass", "unroll", "unstack"]


ELEMENTWISE = frozenset(
    f"stablehlo.{name}"
    for name in (
        "abs add and atan2 cbrt ceil clamp compare convert cosine divide exponential exponential_minus_one floor "
        "imag is_finite log log_plus_one logistic maximum minimum multiply negate not or popcnt power real remainder "
        "round_nearest_afz round_nearest_even rsqrt select shift_left shift_right_arithmetic shift_right_logical sign "
        "sine sqrt subtract tan tanh xor"
    ).split()
) | {"sdy.sharding_constraint"}
_COMBINING = frozenset({"stablehlo.add", "stablehlo.maximum", "stablehlo.minimum", "stablehlo.and", "stablehlo.or"})


@dataclass
class UnstackLayerScansPass(ModulePass):
    name = "hlopar-unstack-layer-scans"
    summary = (
        "unroll scans over stacked layers and split their stacked parameters, state and results into one "
        "piece per layer (so that stages can cut between layers)"
    )

    max_layers: int = option(512, "unroll loops over at most this many layers")
    report: str | None = report_option("write a JSON report of the unrolled loops and split values to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        funcs = planned_functions(module)
        if len(funcs) != 1:
            self.fail(module, f"expects one entry function (@main), found {len(funcs)}")
        (main,) = funcs
        clock = time.perf_counter()
        with module.context, ir.Location.unknown():
            graph = FuncGraph.from_func(main)
            scans = [s for s in layer_scans(graph) if s.trips <= self.max_layers]
            masks: dict[tuple[ir.Value, int], ir.Value] = {}
            for number, scan in enumerate(scans):
                unroll(graph.ops[scan.op].mlir_op, scan.trips, masks, loop=number)
            _canonicalize(module)
            pieces = None
            if scans:
                pieces = unstack(planned_functions(module)[0], {s.trips for s in scans})
                fold_unit_reshapes(planned_functions(module)[0])
                _canonicalize(module)  # what read or made the whole stacks is dead now
                merge_repeated_reshapes(planned_functions(module)[0])
                read_where_used(planned_functions(module)[0])
        if self.wants_report(context):
            report = {
                "pass": self.name,
                "seconds": time.perf_counter() - clock,
                "loops": [{"trips": s.trips, "stacked_operands": len(s.stacked)} for s in scans],
                "split_arguments": pieces.split_arguments if pieces else 0,
                "split_results": pieces.split_results if pieces else 0,
            }
            self.emit_report(module, context, report, end="")


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
        if returned[k] == arg and _from_constants(value) and not _is_constant(value)
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
            layer = _constant_int(mapping[layer_read]) if layer_read is not None else None
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
            and (_shape(op.operands[0]) or [0])[0] == trips
            and _dense_ints(op, "slice_sizes")[0] == 1
        ):
            return op.operands[1]
    return None


def _folded(value: ir.Value) -> ir.Value:
    """A constant for a scalar integer computed from constants (a loop counter), else `value`."""
    if _shape(value) != [] or _is_constant(value):
        return value
    t = ir.RankedTensorType(value.type)
    number = _constant_int(value) if isinstance(t.element_type, ir.IntegerType) else None
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
    | ELEMENTWISE
)


def _is_constant(value: ir.Value) -> bool:
    owner = value.owner
    return isinstance(owner, ir.OpView) and owner.operation.name == "stablehlo.constant"


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
        if op.name == "stablehlo.reshape":
            value = op.operands[0]
        elif op.name == "stablehlo.broadcast_in_dim" and _adds_unit_dims(op):
            value = op.operands[0]
        else:
            break
    return value


def _adds_unit_dims(broadcast: ir.Operation) -> bool:
    """Whether a broadcast_in_dim keeps its operand's elements in order and only inserts dims of size 1."""
    dims = _dense_ints(broadcast, "broadcast_dimensions")
    source, result = _shape(broadcast.operands[0]), _shape(broadcast.results[0])
    return (
        dims == sorted(dims)
        and int(np.prod(source)) == int(np.prod(result))
        and all(result[d] == n for d, n in zip(dims, source))
    )


def _canonicalize(module: ir.Operation) -> None:
    """Folds the unrolled counters and removes dead ops. Not `cse`: merging the layers'
    identical ops (a zero buffer of the forward and one of the update) would make one value
    that several stages' fragments read, made in whichever stage comes first."""
    try:
        passmanager.PassManager.parse("builtin.module(canonicalize)", context=module.context).run(module)
    except ir.MLIRError as error:
        raise DiagnosticError.from_mlir_error(error) from None


# --------------------------------------------------------------------------- splitting


@dataclass(frozen=True)
class SplitSummary:
    split_arguments: int
    split_results: int


def unstack(main: ir.Operation, counts: set[int]) -> SplitSummary:
    """Splits the values of `main` stacked along a leading layer axis of a size in `counts`."""
    splitter = _Splitter(main, counts)
    return splitter.run()


def _shape(value: ir.Value) -> list[int] | None:
    try:
        return list(ir.RankedTensorType(value.type).shape)
    except ValueError:
        return None


def _piece_type(value: ir.Value) -> ir.Type:
    t = ir.RankedTensorType(value.type)
    return ir.RankedTensorType.get([1] + list(t.shape[1:]), t.element_type, t.encoding)


def _constant_int(value: ir.Value) -> int | None:
    """The value of a scalar integer computed from constants (an unrolled loop's layer index:
    the counter, `L - 1 - i` of a reversed scan, JAX's wrap of negative indices), else None."""
    owner = value.owner
    if not isinstance(owner, ir.OpView):
        return None
    op = owner.operation
    name = op.name
    if name == "stablehlo.constant":
        try:
            attr = ir.DenseIntElementsAttr(op.attributes["value"])
        except ValueError:
            return None
        return int(attr[0]) if attr.is_splat or len(attr) == 1 else None
    if name in ("stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim", "sdy.sharding_constraint"):
        shape = _shape(op.results[0])
        return _constant_int(op.operands[0]) if shape is not None and all(d == 1 for d in shape) else None
    operands = [_constant_int(v) for v in op.operands]
    if any(x is None for x in operands):
        return None
    if name == "stablehlo.compare":
        a, b = operands
        direction = str(op.attributes["comparison_direction"])
        for key, result in (
            ("LT", a < b),
            ("LE", a <= b),
            ("GT", a > b),
            ("GE", a >= b),
            ("EQ", a == b),
            ("NE", a != b),
        ):
            if key in direction:
                return int(result)
        return None
    arithmetic = {
        "stablehlo.add": lambda a, b: a + b,
        "stablehlo.subtract": lambda a, b: a - b,
        "stablehlo.multiply": lambda a, b: a * b,
        "stablehlo.maximum": max,
        "stablehlo.minimum": min,
        "stablehlo.negate": lambda a: -a,
        "stablehlo.select": lambda p, a, b: a if p else b,
        "stablehlo.clamp": lambda lo, x, hi: min(max(x, lo), hi),
    }
    return arithmetic[name](*operands) if name in arithmetic else None


def _dense_ints(op: ir.Operation, name: str) -> list[int]:
    attr = op.attributes[name]
    try:
        return list(ir.DenseI64ArrayAttr(attr))
    except ValueError:
        return [int(x) for x in ir.DenseIntElementsAttr(attr)]


class _Splitter:
    def __init__(self, main: ir.Operation, counts: set[int]):
        self.main = main
        self.block = main.regions[0].blocks[0]
        self.counts = counts
        self.ops = [op.operation for op in self.block.operations]
        self.ret = self.ops[-1]
        self.pieces: dict[ir.Value, list[ir.Value]] = {}

    # -- which values: every reader and the maker can follow the pieces, and a per-layer access

    def _leading(self, value: ir.Value) -> int | None:
        shape = _shape(value)
        return shape[0] if shape and shape[0] in self.counts else None

    def _layer_index(self, op: ir.Operation, sizes_or_update: list[int], indices: list[ir.Value]) -> int | None:
        """The layer a dynamic_slice reads or a dynamic_update_slice writes, when it is one layer at a constant."""
        if not indices or sizes_or_update[0] != 1:
            return None
        return _constant_int(indices[0])

    def _reads_follow(self, value: ir.Value) -> bool:
        for use in value.uses:
            op, number = use.owner, use.operand_number
            op = op.operation if isinstance(op, ir.OpView) else op
            if op == self.ret or op.name in ELEMENTWISE:
                continue
            if op.parent != self.main:
                return False
            if op.name == "stablehlo.dynamic_slice" and number == 0:
                if self._layer_index(op, _dense_ints(op, "slice_sizes"), list(op.operands)[1:]) is None:
                    return False
            elif op.name == "stablehlo.slice" and number == 0:
                start, limit = _dense_ints(op, "start_indices"), _dense_ints(op, "limit_indices")
                if limit[0] - start[0] != 1 or _dense_ints(op, "strides")[0] != 1:
                    return False
            elif op.name == "stablehlo.dynamic_update_slice" and number == 0:
                if self._layer_index(op, _shape(op.operands[1]), list(op.operands)[2:]) is None:
                    return False
            elif op.name == "stablehlo.reduce" and number == 0:
                if len(op.results) != 1 or not self._combines(op):
                    return False
            elif op.name == "stablehlo.transpose":
                if _dense_ints(op, "permutation")[0] != 0:
                    return False
            elif op.name == "stablehlo.broadcast_in_dim":
                if _dense_ints(op, "broadcast_dimensions")[0] != 0 or self._leading(op.results[0]) is None:
                    return False
            else:
                return False
        return True

    def _combines(self, reduce: ir.Operation) -> bool:
        body = reduce.regions[0].blocks[0]
        ops = list(body.operations)
        if len(ops) != 2 or ops[0].operation.name not in _COMBINING:
            return False
        if ops[0].operation.name == "stablehlo.add" and _constant_float(reduce.operands[1]) != 0:
            dims = _dense_ints(reduce, "dimensions")
            return 0 not in dims  # summing the pieces would add the initial value L times
        return True

    def _made_followably(self, value: ir.Value) -> bool:
        owner = value.owner
        if isinstance(owner, ir.Block):
            return owner == self.block
        op = owner.operation
        if op.parent != self.main:
            return False
        name = op.name
        if name in ELEMENTWISE or name == "stablehlo.dynamic_update_slice":
            return True
        if name == "stablehlo.constant":
            return ir.DenseElementsAttr(op.attributes["value"]).is_splat
        if name == "stablehlo.broadcast_in_dim":
            dims = _dense_ints(op, "broadcast_dimensions")
            return 0 not in dims or dims[0] == 0
        if name == "stablehlo.transpose":
            return _dense_ints(op, "permutation")[0] == 0
        if name == "stablehlo.reduce":
            return 0 not in _dense_ints(op, "dimensions") and len(op.results) == 1 and self._combines(op)
        return False

    def _linked(self, op: ir.Operation) -> list[ir.Value]:
        """The stacked operands and results of `op` that are split together or not at all."""
        values = [v for v in list(op.operands) + list(op.results) if self._leading(v) is not None]
        if op.name == "stablehlo.dynamic_update_slice":
            values = [op.operands[0], op.results[0]]
        elif op.name in ("stablehlo.dynamic_slice", "stablehlo.slice"):
            values = [op.operands[0]]
        elif op.name == "stablehlo.reduce":
            values = [v for v in (op.operands[0], op.results[0]) if self._leading(v) is not None]
        return values

    def _choose(self) -> set[ir.Value]:
        candidates = [a for a in self.block.arguments if self._leading(a) is not None]
        for op in self.ops[:-1]:
            candidates += [r for r in op.results if self._leading(r) is not None]
        chosen = {v for v in candidates if self._made_followably(v) and self._reads_follow(v)}
        changed = True
        while changed:  # values split together: all of them or none
            changed = False
            for op in self.ops[:-1]:
                linked = self._linked(op)
                if any(v in chosen for v in linked) and not all(v in chosen for v in linked):
                    chosen.difference_update(linked)
                    changed = True
        # Only what is connected to a per-layer read or write.
        seeds = set()
        for op in self.ops[:-1]:
            if op.name in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.dynamic_update_slice"):
                seeds.update(v for v in self._linked(op) if v in chosen)
        component, frontier = set(seeds), list(seeds)
        neighbours: dict[ir.Value, list[ir.Value]] = {}
        for op in self.ops[:-1]:
            linked = [v for v in self._linked(op) if v in chosen]
            for v in linked:
                neighbours.setdefault(v, []).extend(linked)
        while frontier:
            for w in neighbours.get(frontier.pop(), ()):
                if w not in component:
                    component.add(w)
                    frontier.append(w)
        return component

    # -- rewriting

    def run(self) -> SplitSummary:
        chosen = self._choose()
        if not chosen:
            return SplitSummary(0, 0)
        arguments = self._split_arguments(chosen)
        for op in self.ops[:-1]:
            if any(v in chosen for v in list(op.operands) + list(op.results)):
                with ir.InsertionPoint(op), op.location:
                    self._rewrite(op, chosen)
        results = self._split_results(chosen)
        for op in reversed(self.ops[:-1]):  # what read or made whole stacks (arguments erased below)
            if all(not list(r.uses) for r in op.results) and any(v in chosen for v in op.operands):
                op.erase()
        for number in reversed(arguments):
            self.block.erase_argument(number)
        self._retype()
        return SplitSummary(len(arguments), len(results))

    def _split_arguments(self, chosen: set[ir.Value]) -> list[int]:
        numbers = [a.arg_number for a in self.block.arguments if a in chosen]
        arg_attrs = self._attrs("arg_attrs", len(self.block.arguments))
        count = len(self.block.arguments)
        names = FuncSignature.of(self.main).arg_names
        origin = list(range(count))
        piece = [-1] * count
        new_attrs = list(arg_attrs)
        for number in numbers:
            argument = self.block.arguments[number]
            layers = self._leading(argument)
            name = names[number]
            made = []
            for i in range(layers):
                location = ir.Location.name(f"{name}[{i}]") if name is not None else argument.location
                made.append(self.block.add_argument(_piece_type(argument), location))
                origin.append(number)
                piece.append(i)
                new_attrs.append(arg_attrs[number])
            self.pieces[argument] = made
        self._arg_origin = [o for k, o in enumerate(origin) if k not in set(numbers)]
        self._arg_piece = [p for k, p in enumerate(piece) if k not in set(numbers)]
        self._arg_attrs = [a for k, a in enumerate(new_attrs) if k not in set(numbers)]
        return numbers

    def _split_results(self, chosen: set[ir.Value]) -> list[int]:
        old = list(self.ret.operands)
        res_attrs = self._attrs("res_attrs", len(old))
        values, origin, piece, attrs, split = [], [], [], [], []
        for number, value in enumerate(old):
            if value in chosen:
                split.append(number)
                for i, p in enumerate(self.pieces[value]):
                    values.append(p)
                    origin.append(number)
                    piece.append(i)
                    attrs.append(_suffixed(res_attrs[number], f"[{i}]"))
            else:
                values.append(value)
                origin.append(number)
                piece.append(-1)
                attrs.append(res_attrs[number])
        with ir.InsertionPoint(self.ret), self.ret.location:
            func_dialect.ReturnOp(values)
        self.ret.erase()
        self._res_origin, self._res_piece, self._res_attrs = origin, piece, attrs
        return split

    def _retype(self) -> None:
        main = self.main
        ret = list(self.block.operations)[-1].operation
        new_result = {(o, p): k for k, (o, p) in enumerate(zip(self._res_origin, self._res_piece))}
        arg_attrs = []
        for attrs, piece in zip(self._arg_attrs, self._arg_piece):
            arg_attrs.append(_realiased(attrs, piece, new_result))
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([a.type for a in self.block.arguments], [v.type for v in ret.operands])
        )
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        main.attributes["res_attrs"] = ir.ArrayAttr.get(self._res_attrs)
        main.attributes[LAYER_PIECES_ATTR] = LayerPieces(
            tuple(self._arg_origin), tuple(self._arg_piece), tuple(self._res_origin), tuple(self._res_piece)
        ).attribute()

    def _attrs(self, key: str, count: int) -> list[ir.Attribute]:
        if key in self.main.attributes:
            return list(ir.ArrayAttr(self.main.attributes[key]))
        return [ir.DictAttr.get({})] * count

    def _piece_of(self, value: ir.Value, i: int, chosen: set[ir.Value]) -> ir.Value:
        return self.pieces[value][i] if value in chosen else value

    def _rewrite(self, op: ir.Operation, chosen: set[ir.Value]) -> None:
        name = op.name
        if name == "stablehlo.dynamic_slice" or name == "stablehlo.slice":
            source = op.operands[0]
            if name == "stablehlo.slice":
                layer = _dense_ints(op, "start_indices")[0]
            else:
                layer = _constant_int(op.operands[1])
            layer = min(max(layer, 0), len(self.pieces[source]) - 1)  # dynamic_slice clamps
            piece = self.pieces[source][layer]
            if _shape(piece) == _shape(op.results[0]):
                op.results[0].replace_all_uses_with(piece)
                return
            clone = op.clone()
            clone.operands[0] = piece
            if name == "stablehlo.dynamic_slice":
                clone.operands[1] = _zero_like(op.operands[1])
            else:
                start, limit = _dense_ints(op, "start_indices"), _dense_ints(op, "limit_indices")
                clone.attributes["start_indices"] = ir.DenseI64ArrayAttr.get([0] + start[1:])
                clone.attributes["limit_indices"] = ir.DenseI64ArrayAttr.get([limit[0] - start[0]] + limit[1:])
            op.results[0].replace_all_uses_with(clone.results[0])
            return
        result = op.results[0] if len(op.results) == 1 else None
        layers = self._leading(result) if result is not None and result in chosen else None
        if name == "stablehlo.dynamic_update_slice":
            base = self.pieces[op.operands[0]]
            layer = min(max(_constant_int(op.operands[2]), 0), len(base) - 1)
            update = op.operands[1]
            if _shape(update) == _shape(base[layer]) and all(_constant_int(v) == 0 for v in list(op.operands)[3:]):
                written = update
            else:
                clone = op.clone()
                clone.operands[0] = base[layer]
                clone.operands[2] = _zero_like(op.operands[2])
                written = clone.results[0]
            self.pieces[result] = base[:layer] + [written] + base[layer + 1 :]
            return
        if name == "stablehlo.constant":
            value = ir.DenseElementsAttr(op.attributes["value"])
            shared = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(_piece_type(result), value.get_splat_value()))
            self.pieces[result] = [shared.result] * layers
            return
        if name == "stablehlo.broadcast_in_dim" and op.operands[0] not in chosen:
            # One per layer, as the unrolled model has: a shared one would be made by the first
            # layer's stage and sent to every other stage.
            made = []
            for _ in range(layers):
                clone = op.clone()
                clone.results[0].set_type(_piece_type(result))
                made.append(clone.results[0])
            self.pieces[result] = made
            return
        if name == "stablehlo.reduce" and result not in chosen:  # over the layer axis: sum the pieces' sums
            source = self.pieces[op.operands[0]]
            partial = []
            for p in source:
                clone = op.clone()
                clone.operands[0] = p
                partial.append(clone.results[0])
            combine = list(op.regions[0].blocks[0].operations)[0].operation.name
            total = partial[0]
            for p in partial[1:]:
                total = ir.Operation.create(combine, results=[total.type], operands=[total, p]).results[0]
            result.replace_all_uses_with(total)
            return
        # Per piece: elementwise ops, transposes and broadcasts keeping the layer axis first,
        # reductions over other dims.
        made: list[list[ir.Value]] = [[] for _ in op.results]
        for i in range(layers):
            clone = op.clone()
            for k, operand in enumerate(op.operands):
                if operand in chosen:
                    clone.operands[k] = self.pieces[operand][i]
            for k, r in enumerate(op.results):
                if r in chosen:
                    clone.results[k].set_type(_piece_type(r))
                    made[k].append(clone.results[k])
        for k, r in enumerate(op.results):
            if r in chosen:
                self.pieces[r] = made[k]


def _constant_float(value: ir.Value) -> float | None:
    owner = value.owner
    if not isinstance(owner, ir.OpView) or owner.operation.name != "stablehlo.constant":
        return None
    attr = ir.DenseElementsAttr(owner.operation.attributes["value"])
    if not attr.is_splat:
        return None
    splat = attr.get_splat_value()
    for kind in (ir.FloatAttr, ir.IntegerAttr, ir.BoolAttr):
        try:
            return float(kind(splat).value)
        except (ValueError, TypeError):
            continue
    return None


def _zero_like(index: ir.Value) -> ir.Value:
    t = ir.RankedTensorType(index.type)
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(t.element_type, 0))).result


def _suffixed(attrs: ir.Attribute, suffix: str) -> ir.Attribute:
    entries = {a.name: a.attr for a in ir.DictAttr(attrs)}
    if "jax.result_info" in entries:
        entries["jax.result_info"] = ir.StringAttr.get(ir.StringAttr(entries["jax.result_info"]).value + suffix)
    return ir.DictAttr.get(entries)


def _realiased(attrs: ir.Attribute, piece: int, new_result: dict[tuple[int, int], int]) -> ir.Attribute:
    """An argument's attributes with `tf.aliasing_output` renumbered to the result piece it is donated to."""
    entries = {a.name: a.attr for a in ir.DictAttr(attrs)}
    if "tf.aliasing_output" in entries:
        old = ir.IntegerAttr(entries["tf.aliasing_output"]).value
        new = new_result.get((old, piece), new_result.get((old, -1)))
        if new is None:
            del entries["tf.aliasing_output"]
        else:
            entries["tf.aliasing_output"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), new)
    return ir.DictAttr.get(entries)
