"""Iotas along the batch under microbatching: counting the whole batch's rows.

An iota along the batch dim numbers the examples. JAX's default random numbers depend on
it: with `jax_threefry_partitionable` (the default), the bits of a draw of shape S are
threefry2x32(key, counter) with counter = sum over dims d of iota_d * stride_d, the strides
being the products of the later dims' sizes (`iota_2x32_shape` in jax/_src/random/prng.py).
The microbatch program keeps the strides (constants of the whole batch's shape), so a
microbatch draws exactly the whole batch's bits for its rows when its iota along the batch
counts the global position: the local iota plus k * (the dim's microbatch size) in
microbatch k. Any other use of an iota along the batch (example weights, positions) is
exact for the same reason.

The split `@main` takes k as one more argument, `tensor<1xi32>`, appended after the
step's own arguments and listed among the batch arguments (`hlopar.batch_args`), of B
rows in the whole step: every executor that cuts the batch arguments per microbatch hands
microbatch k its row k of arange(B), with no code of its own (`dialect.split.microbatch_index_values`
makes the whole argument; `runtime.step_arguments` adds it to the caller's arguments).
`@main` names it in `hlopar.microbatch_index_arg`. A scalar offset would be simpler IR but
would need every executor to know it is not sliced like the batch.
"""

from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.dialect.split import index_argument

__all__ = ["count_globally", "microbatch_offset"]


def count_globally(main: ir.Operation, iota: ir.Operation, kind_attrs: dict[str, ir.Attribute]) -> list[ir.Operation]:
    """Replaces `iota` (already of the microbatch's shape, along a dim the split divided) by
    iota + k * size, k the microbatch index (module docstring). Returns the new ops, which
    get `kind_attrs` when the iota was at the top level of `@main`."""
    result_type = ir.RankedTensorType(iota.results[0].type)
    dim = ir.IntegerAttr(iota.attributes["iota_dimension"]).value
    with ir.InsertionPoint(iota), iota.location:
        offset, made = microbatch_offset(main, result_type.shape[dim], result_type.element_type)
        spread = stablehlo.BroadcastInDimOp(result_type, offset, ir.DenseI64ArrayAttr.get([]))
        local = stablehlo.IotaOp(result_type, iota.attributes["iota_dimension"])
        total = stablehlo.AddOp(local.result, spread.result)
    made += [op.operation for op in (spread, local, total)]
    top = iota.parent == main
    iota.results[0].replace_all_uses_with(total.result)
    iota.erase()
    if top:
        for op in made:
            if op.name == "stablehlo.constant":
                continue  # independent of the batch
            for key, value in kind_attrs.items():
                op.attributes[key] = value
    return made


def microbatch_offset(main: ir.Operation, size: int, element: ir.Type) -> tuple[ir.Value, list[ir.Operation]]:
    """k * size, a scalar of `element` (k the microbatch index), made at the current insertion
    point: the position of microbatch k's first row along a dim of `size` rows per microbatch.
    Returns it and the ops made."""
    index = index_argument(main)
    scalar = ir.RankedTensorType.get([], element)
    k = stablehlo.ReshapeOp(ir.RankedTensorType.get([], ir.RankedTensorType(index.type).element_type), index)
    converted = stablehlo.ConvertOp(scalar, k.result)
    rows = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(scalar, _number(element, size)))
    offset = stablehlo.MulOp(converted.result, rows.result)
    return offset.result, [op.operation for op in (k, converted, rows, offset)]


def _number(element: ir.Type, value: int) -> ir.Attribute:
    if isinstance(element, ir.IntegerType):
        return ir.IntegerAttr.get(element, value)
    return ir.FloatAttr.get(element, float(value))
