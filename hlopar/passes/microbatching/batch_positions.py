"""Gathers and scatters indexed by the batch's own positions, as batched gathers and scatters.

`logp[jnp.arange(B), labels]` picks, for each example r, an element of row r. In the IR it is a
gather whose index vector holds an iota along the batch (JAX wraps it as
`select(i < 0, i + B, i)`) beside the labels; its gradient scatters into the same rows with the
same indices, and Flax's `nn.RNN(seq_lengths=...)` picks each sequence's last carry the same
way. Read as written, the gather indexes the batch dim of its operand with values that carry
the batch: its sharding rule cannot say that row r of the result reads row r of the operand,
and the batch factor looks reduced. StableHLO says it with batching dims
(`operand_batching_dims`, as `take_along_axis` lowers): rewritten so, the batch splits through
the op as through an elementwise op, and each microbatch indexes its own rows with its own
positions (the iota component is gone: no offset to add). The rewrite is exact whatever the
values: the component dropped equals the position along the batching dim, in range.

Only gathers whose operand is computed from the batch arguments are rewritten, and scatters
into such an operand or by the indices of a gather rewritten (its gradient: a scatter into
zeros, whose rows are the examples' too).
Where an iota along the batch indexes a value that does not carry the batch (a table indexed
by example), the split makes the iota count the whole batch's rows instead (`global_iota`),
so each microbatch reads its rows of the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.passes.microbatching.batch_statistics import splat_value
from hlopar.passes.microbatching.common import int_attr, walk_ops

__all__ = ["batch_gathers", "position_dim"]

# Ops erased with the index components they made, once nothing reads them.
_INDEX_OPS = frozenset(
    "stablehlo." + n
    for n in [
        "constant",
        "iota",
        "broadcast_in_dim",
        "reshape",
        "convert",
        "select",
        "compare",
        "add",
        "clamp",
        "concatenate",
    ]
)


def position_dim(value: ir.Value) -> int | None:
    """The dim d such that `value` at every index i is i_d (an iota along d, as JAX builds
    `arange` indices), seen through broadcasts, reshapes of unit dims, integer converts, the
    wrap of negative indices (`select(i < 0, i + n, i)`) and clamps into range; else None."""
    if not isinstance(value, ir.OpResult):
        return None
    op = value.owner
    shape = ir.RankedTensorType(value.type).shape
    if op.name == "stablehlo.iota":
        return int_attr(op, "iota_dimension")
    if op.name == "stablehlo.convert":
        if not isinstance(ir.RankedTensorType(op.operands[0].type).element_type, ir.IntegerType):
            return None
        return position_dim(op.operands[0])
    if op.name == "stablehlo.broadcast_in_dim":
        inner = position_dim(op.operands[0])
        if inner is None:
            return None
        dim = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))[inner]
        return dim if ir.RankedTensorType(op.operands[0].type).shape[inner] == shape[dim] else None
    if op.name == "stablehlo.reshape":
        inner = position_dim(op.operands[0])
        before = ir.RankedTensorType(op.operands[0].type).shape
        if inner is None or [s for s in before if s != 1] != [s for s in shape if s != 1] or before[inner] == 1:
            return None
        rank = sum(1 for s in before[:inner] if s != 1)  # the inner dim is the rank-th dim not of size 1
        return [d for d, s in enumerate(shape) if s != 1][rank]
    if op.name == "stablehlo.select":
        pred, _, kept = op.operands
        inner = position_dim(kept)
        return inner if inner is not None and _is_negative_test(pred, kept) else None
    if op.name == "stablehlo.clamp":
        low, kept, high = (splat_value(op.operands[0]), op.operands[1], splat_value(op.operands[2]))
        inner = position_dim(kept)
        if inner is None or low is None or high is None:
            return None
        return inner if low <= 0 and high >= shape[inner] - 1 else None
    return None


def _is_negative_test(pred: ir.Value, value: ir.Value) -> bool:
    """`pred` is `value < c` for some c <= 0: false wherever `value` is a position."""
    if not isinstance(pred, ir.OpResult) or pred.owner.name != "stablehlo.compare":
        return False
    compare = pred.owner
    bound = splat_value(compare.operands[1])
    direction = stablehlo.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value
    return compare.operands[0] == value and direction == "LT" and bound is not None and bound <= 0


def batch_gathers(func: ir.Operation, batch_args: Sequence[int]) -> int:
    """Rewrites every gather and scatter in `func` that indexes a dim of an operand computed
    from the batch arguments by the positions along a dim of its indices of the same size
    into a batched one (module docstring); returns how many."""
    rewritten = 0
    replaced: set[ir.Operation] = set()  # the old index vectors' makers
    arguments = func.regions[0].blocks[0].arguments
    from_batch = _computed_from(func, [arguments[i] for i in batch_args])
    gathered: set[ir.Value] = set()  # the index vectors of the gathers rewritten
    for op in walk_ops(func):
        if op.name == "stablehlo.gather" and op.operands[0] in from_batch:
            indices = op.operands[1]
            if _batch_gather(op, replaced):
                gathered.add(indices)
                rewritten += 1
        elif op.name == "stablehlo.scatter":
            inputs = (len(op.operands) - 1) // 2
            if op.operands[0] in from_batch or op.operands[inputs] in gathered:
                rewritten += _batch_scatter(op, replaced)
    _erase_unused(func, replaced)
    return rewritten


def _computed_from(func: ir.Operation, sources: Sequence[ir.Value]) -> set[ir.Value]:
    """The values of `func` computed from `sources` (a loop or branch's values all are when
    it reads one, inside or as an operand)."""
    found = set(sources)

    def visit(block: ir.Block) -> bool:
        seen = False
        for op in block.operations:
            op = op.operation
            hit = any(v in found for v in op.operands)
            for region in op.regions:
                for inner in region.blocks:
                    if hit:
                        found.update(inner.arguments)
                    hit = visit(inner) or hit
            if hit:
                found.update(op.results)
                seen = True
        return seen

    visit(func.regions[0].blocks[0])
    return found


def _batch_gather(op: ir.Operation, replaced: set[ir.Operation]) -> int:
    numbers = stablehlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    index_map = list(numbers.start_index_map)
    found = _diagonal(op.operands[0], op.operands[1], numbers.index_vector_dim, index_map, numbers.collapsed_slice_dims)
    if found is None:
        return 0
    component, operand_dim, indices_dim, remaining = found
    pairs = sorted(
        [*zip(numbers.operand_batching_dims, numbers.start_indices_batching_dims), (operand_dim, indices_dim)]
    )
    op.attributes["dimension_numbers"] = stablehlo.GatherDimensionNumbers.get(
        offset_dims=list(numbers.offset_dims),
        collapsed_slice_dims=[d for d in numbers.collapsed_slice_dims if d != operand_dim],
        operand_batching_dims=[a for a, _ in pairs],
        start_indices_batching_dims=[b for _, b in pairs],
        start_index_map=index_map[:component] + index_map[component + 1 :],
        index_vector_dim=numbers.index_vector_dim,
    )
    _replace_indices(op, 1, remaining, replaced)
    return 1


def _batch_scatter(op: ir.Operation, replaced: set[ir.Operation]) -> int:
    numbers = stablehlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    inputs = (len(op.operands) - 1) // 2
    index_map = list(numbers.scattered_dims_to_operand_dims)
    found = _diagonal(
        op.operands[0], op.operands[inputs], numbers.index_vector_dim, index_map, numbers.inserted_window_dims
    )
    if found is None:
        return 0
    component, operand_dim, indices_dim, remaining = found
    pairs = sorted(
        [*zip(numbers.input_batching_dims, numbers.scatter_indices_batching_dims), (operand_dim, indices_dim)]
    )
    op.attributes["scatter_dimension_numbers"] = stablehlo.ScatterDimensionNumbers.get(
        update_window_dims=list(numbers.update_window_dims),
        inserted_window_dims=[d for d in numbers.inserted_window_dims if d != operand_dim],
        input_batching_dims=[a for a, _ in pairs],
        scatter_indices_batching_dims=[b for _, b in pairs],
        scattered_dims_to_operand_dims=index_map[:component] + index_map[component + 1 :],
        index_vector_dim=numbers.index_vector_dim,
    )
    _replace_indices(op, inputs, remaining, replaced)
    return 1


def _diagonal(
    operand: ir.Value, indices: ir.Value, vector_dim: int, index_map: list[int], collapsed
) -> tuple[int, int, int, list[ir.Value]] | None:
    """The first index component that is the position along a dim of the indices as large as
    the operand dim it indexes (which the op collapses): (component, operand dim, indices
    dim, the index pieces that remain). None where none is, or where it is the only one
    (an index vector of no component: nothing to gather by)."""
    pieces = _pieces(indices, vector_dim)
    if pieces is None or len(index_map) < 2:
        return None
    operand_shape = ir.RankedTensorType(operand.type).shape
    indices_shape = ir.RankedTensorType(indices.type).shape
    component = 0
    for number, piece in enumerate(pieces):
        width = ir.RankedTensorType(piece.type).shape[vector_dim]
        dim = position_dim(piece) if width == 1 else None
        operand_dim = index_map[component]
        if (
            dim is not None
            and dim != vector_dim
            and operand_dim in collapsed
            and indices_shape[dim] == operand_shape[operand_dim]
        ):
            return component, operand_dim, dim, pieces[:number] + pieces[number + 1 :]
        component += width
    return None


def _pieces(indices: ir.Value, vector_dim: int) -> list[ir.Value] | None:
    """The pieces the index vectors are concatenated from along `vector_dim` (JAX stacks
    each index array as one), or None when they are not (an implicit vector dim included)."""
    rank = len(ir.RankedTensorType(indices.type).shape)
    if vector_dim >= rank or not isinstance(indices, ir.OpResult):
        return None
    op = indices.owner
    if op.name != "stablehlo.concatenate" or int_attr(op, "dimension") != vector_dim:
        return None
    return list(op.operands)


def _replace_indices(op: ir.Operation, number: int, pieces: list[ir.Value], replaced: set[ir.Operation]) -> None:
    old = op.operands[number]
    if len(pieces) == 1:
        new = pieces[0]
    else:
        with ir.InsertionPoint(op), op.location:
            new = stablehlo.ConcatenateOp(pieces, int_attr(old.owner, "dimension")).result
    op.operands[number] = new
    for flag in ("indices_are_sorted", "unique_indices"):  # said of the old index vectors
        if flag in op.attributes:
            op.attributes[flag] = ir.BoolAttr.get(False)
    replaced.add(old.owner)


def _erase_unused(func: ir.Operation, replaced: set[ir.Operation]) -> None:
    """Erases the old index vectors and the index ops they were made of that nothing else
    reads (users before producers: reverse program order)."""
    made_of: set[ir.Operation] = set()
    stack = list(replaced)
    while stack:
        op = stack.pop()
        if op not in made_of and op.name in _INDEX_OPS:
            made_of.add(op)
            stack += [v.owner for v in op.operands if isinstance(v, ir.OpResult)]
    for op in reversed(walk_ops(func)):
        if op in made_of and not any(True for r in op.results for _ in r.uses):
            op.erase()
