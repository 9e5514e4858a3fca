"""Results that carry the batch under microbatching: concatenated along the batch.

A result of the step computed per example (predictions returned as `has_aux` output,
per-example losses) holds, in the one-microbatch `@main`, its microbatch's rows only. The
whole step's result is the microbatches' rows in order along its batch dim. The split
writes that as one more sum over microbatches, which every executor already makes: the
result becomes

    dynamic_update_slice(zeros of the whole batch's shape, its rows, k * rows along the dim)

of kind `sum`, k the microbatch index (`microbatch_index`, an argument every executor
supplies). Added up over microbatches, the B results are the concatenation, exactly: each
element is one microbatch's value plus zeros. The op carries `hlopar.per_example_dim`
(its batch dim), so that codegen need not pay for a whole batch of zeros per microbatch:
an executable accumulating such a result writes the rows into its donated accumulator in
place (`codegen.executables.accumulating_module`), which is the same sum because the
microbatches' rows do not overlap and accumulators start at zero.

Only a result whose batch dim holds the microbatches whole, in order (one dim divided by
B: block k of it is microbatch k's), is a concatenation; a result whose batch is spread
over several dims (a reshape folding it into others) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.dialect.attributes import PER_EXAMPLE_ATTR
from hlopar.passes.microbatching.global_iota import microbatch_offset

__all__ = ["concatenated_dim", "place_rows"]


def concatenated_dim(division: Sequence[int], microbatches: int) -> int | None:
    """The dim along which the microbatches' values of a value divided by `division` (per
    dim, how many parts the split cut it into) concatenate, or None when they do not along
    one dim."""
    cut = [d for d, parts in enumerate(division) if parts > 1]
    return cut[0] if len(cut) == 1 and division[cut[0]] == microbatches else None


def place_rows(
    main: ir.Operation,
    results: Mapping[int, int],
    batch_attrs: Mapping[str, ir.Attribute],
    sum_attrs: Mapping[str, ir.Attribute],
) -> None:
    """Rewrites `@main`'s results `results` (result number -> batch dim; their values of the
    microbatch's shape, `@main`'s result types the whole batch's) into their microbatch's
    rows placed in zeros of the whole batch (module docstring). The placements get
    `sum_attrs`, the ops of the microbatch that lead to them `batch_attrs`."""
    if not results:
        return
    returned = list(main.regions[0].blocks[0].operations)[-1]
    whole = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results
    i32 = ir.IntegerType.get_signless(32)
    made: list[ir.Operation] = []
    offsets: dict[int, ir.Value] = {}  # rows per microbatch -> microbatch k's first row
    placed: dict[tuple[ir.Value, int], ir.Value] = {}
    with ir.InsertionPoint(returned), returned.location:
        zero = stablehlo.ConstantOp(
            ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([], i32), ir.IntegerAttr.get(i32, 0))
        ).result
        for number, dim in sorted(results.items()):
            value = returned.operands[number]
            part = ir.RankedTensorType(value.type)
            if (value, dim) not in placed:
                if part.shape[dim] not in offsets:
                    offsets[part.shape[dim]], ops = microbatch_offset(main, part.shape[dim], i32)
                    made += ops
                nothing = stablehlo.ConvertOp(ir.RankedTensorType.get([], part.element_type), zero)  # any type
                zeros = stablehlo.BroadcastInDimOp(whole[number], nothing.result, ir.DenseI64ArrayAttr.get([]))
                starts = [offsets[part.shape[dim]] if d == dim else zero for d in range(part.rank)]
                rows = stablehlo.DynamicUpdateSliceOp(zeros.result, value, starts)
                made += [nothing.operation, zeros.operation]
                for key, attr in sum_attrs.items():
                    rows.operation.attributes[key] = attr
                rows.operation.attributes[PER_EXAMPLE_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), dim)
                placed[value, dim] = rows.result
            returned.operands[number] = placed[value, dim]
    for op in made:
        if op.name != "stablehlo.constant":
            for key, attr in batch_attrs.items():
                op.attributes[key] = attr
