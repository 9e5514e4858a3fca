"""Decoders of op attributes into plain Python.

`decode_attrs(op)` turns the attributes of a StableHLO (or `func.call`) operation into a
small frozen dataclass holding ints, tuples and strings only, so that the analyses never
touch MLIR attribute objects. Ops without a decoder give `None`.

Attributes the StableHLO spec lets a producer omit get their documented defaults (unit
strides and dilations, zero padding, ...), so a decoded record is always complete.
Reductions carried by a region (reduce, reduce_window, scatter, select_and_scatter) also
report the *kind* of their body: the name of the single elementwise op it applies
(`add`, `max`, `min`, `mul`, `and`, `or`, `xor`), `set` for a scatter that returns the
update, and `other` for anything else (argmax bodies, sort comparators, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

Ints = tuple[int, ...]
Padding = tuple[tuple[int, int], ...]

_DYNAMIC = ir.ShapedType.get_dynamic_size()


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class DotGeneralDims:
    lhs_batch: Ints
    rhs_batch: Ints
    lhs_contracting: Ints
    rhs_contracting: Ints


@dataclass(frozen=True, slots=True)
class ConvDims:
    input_batch: int
    input_feature: int
    input_spatial: Ints
    kernel_in: int
    kernel_out: int
    kernel_spatial: Ints
    output_batch: int
    output_feature: int
    output_spatial: Ints
    window_strides: Ints
    padding: Padding
    lhs_dilation: Ints
    rhs_dilation: Ints
    window_reversal: tuple[bool, ...]
    feature_group_count: int
    batch_group_count: int


@dataclass(frozen=True, slots=True)
class ReduceAttrs:
    dimensions: Ints
    kind: str


@dataclass(frozen=True, slots=True)
class ReduceWindowAttrs:
    window_dimensions: Ints
    window_strides: Ints
    base_dilations: Ints
    window_dilations: Ints
    padding: Padding
    kind: str


@dataclass(frozen=True, slots=True)
class SelectAndScatterAttrs:
    window_dimensions: Ints
    window_strides: Ints
    padding: Padding
    # Comparison direction of the `select` body when it is a single compare of its two
    # arguments in order (`GE` for the gradient of max pooling), else "other".
    select: str
    kind: str


@dataclass(frozen=True, slots=True)
class BroadcastInDimAttrs:
    dims: Ints


@dataclass(frozen=True, slots=True)
class TransposeAttrs:
    permutation: Ints


@dataclass(frozen=True, slots=True)
class ReshapeAttrs:
    # `None` entries are dynamic sizes; the whole shape is None for unranked types.
    in_shape: tuple[int | None, ...] | None
    out_shape: tuple[int | None, ...] | None


@dataclass(frozen=True, slots=True)
class SliceAttrs:
    start: Ints
    limit: Ints
    strides: Ints


@dataclass(frozen=True, slots=True)
class DynamicSliceAttrs:
    slice_sizes: Ints


@dataclass(frozen=True, slots=True)
class DynamicUpdateSliceAttrs:
    """No attributes: operand 0 is updated with operand 1 at the indices that follow."""


@dataclass(frozen=True, slots=True)
class PadAttrs:
    low: Ints
    high: Ints
    interior: Ints


@dataclass(frozen=True, slots=True)
class ConcatenateAttrs:
    dimension: int


@dataclass(frozen=True, slots=True)
class GatherAttrs:
    offset_dims: Ints
    collapsed_slice_dims: Ints
    operand_batching_dims: Ints
    start_indices_batching_dims: Ints
    start_index_map: Ints
    index_vector_dim: int
    slice_sizes: Ints
    indices_are_sorted: bool


@dataclass(frozen=True, slots=True)
class ScatterAttrs:
    update_window_dims: Ints
    inserted_window_dims: Ints
    input_batching_dims: Ints
    scatter_indices_batching_dims: Ints
    scatter_dims_to_operand_dims: Ints
    index_vector_dim: int
    indices_are_sorted: bool
    unique_indices: bool
    kind: str


@dataclass(frozen=True, slots=True)
class IotaAttrs:
    dimension: int


@dataclass(frozen=True, slots=True)
class SortAttrs:
    dimension: int
    is_stable: bool


@dataclass(frozen=True, slots=True)
class CompareAttrs:
    direction: str  # EQ, NE, GE, GT, LE, LT
    compare_type: str | None  # FLOAT, TOTALORDER, SIGNED, UNSIGNED, or None when absent


@dataclass(frozen=True, slots=True)
class CustomCallAttrs:
    target: str
    has_side_effect: bool
    # The string form of `backend_config`: the string itself for a StringAttr, the printed
    # dictionary for typed-FFI calls; None when absent.
    backend_config: str | None
    api_version: int | None


@dataclass(frozen=True, slots=True)
class ConstantAttrs:
    splat: bool
    # The single element of a splat constant as a Python bool/int/float/complex (None for
    # non-splat constants and values the text form hides, like complex NaNs). Big
    # constants are never materialized.
    splat_value: bool | int | float | complex | None


@dataclass(frozen=True, slots=True)
class ReducePrecisionAttrs:
    exponent_bits: int
    mantissa_bits: int


@dataclass(frozen=True, slots=True)
class ReverseAttrs:
    dimensions: Ints


@dataclass(frozen=True, slots=True)
class GetTupleElementAttrs:
    index: int


@dataclass(frozen=True, slots=True)
class CallAttrs:
    callee: str


OpAttrs = (
    DotGeneralDims
    | ConvDims
    | ReduceAttrs
    | ReduceWindowAttrs
    | SelectAndScatterAttrs
    | BroadcastInDimAttrs
    | TransposeAttrs
    | ReshapeAttrs
    | SliceAttrs
    | DynamicSliceAttrs
    | DynamicUpdateSliceAttrs
    | PadAttrs
    | ConcatenateAttrs
    | GatherAttrs
    | ScatterAttrs
    | IotaAttrs
    | SortAttrs
    | CompareAttrs
    | CustomCallAttrs
    | ConstantAttrs
    | ReducePrecisionAttrs
    | ReverseAttrs
    | GetTupleElementAttrs
    | CallAttrs
)


# --------------------------------------------------------------------------- helpers


def _ints(attr: ir.Attribute | None, default: Ints = ()) -> Ints:
    """A DenseI64ArrayAttr, DenseIntElementsAttr or ArrayAttr of integers as a tuple."""
    if attr is None:
        return default
    # Indexing is several times faster than iterating over these bindings.
    if isinstance(attr, ir.ArrayAttr):
        return tuple([ir.IntegerAttr(attr[i]).value for i in range(len(attr))])
    return tuple([attr[i] for i in range(len(attr))])


def _padding(attr: ir.Attribute | None, rank: int) -> Padding:
    """A `tensor<Nx2xi64>` padding attribute as ((low, high), ...)."""
    if attr is None:
        return ((0, 0),) * rank
    flat = _ints(attr)
    return tuple(zip(flat[0::2], flat[1::2]))


def _int(attr: ir.Attribute | None, default: int) -> int:
    return default if attr is None else ir.IntegerAttr(attr).value


def _bool(attr: ir.Attribute | None, default: bool = False) -> bool:
    return default if attr is None else ir.BoolAttr(attr).value


def _shape(type_: ir.Type) -> tuple[int | None, ...] | None:
    if not isinstance(type_, ir.RankedTensorType):
        return None
    return tuple(None if d == _DYNAMIC else d for d in type_.shape)


# Elementwise binary ops a reduction body may apply, by the kind they name.
_BINARY_KIND = {
    "stablehlo.add": "add",
    "stablehlo.maximum": "max",
    "stablehlo.minimum": "min",
    "stablehlo.multiply": "mul",
    "stablehlo.and": "and",
    "stablehlo.or": "or",
    "stablehlo.xor": "xor",
}


def body_kind(region: ir.Region, *, allow_set: bool = False) -> str:
    """The reduction a body computes, when every result is one binary op on its arguments.

    The body of an n-input reduction has 2n block arguments: the n accumulators, then the
    n incoming elements, and must return, for each i, `op(arg[i], arg[n + i])` (either
    operand order) with the same `op` for every i. With `allow_set`, a body that returns
    its incoming elements unchanged (a scatter that overwrites) is `set`.
    """
    blocks = list(region.blocks)
    if len(blocks) != 1:
        return "other"
    block = blocks[0]
    args = list(block.arguments)
    if not args or len(args) % 2:
        return "other"
    n = len(args) // 2
    ops = [op.operation for op in block.operations]
    terminator = ops[-1] if ops else None
    if terminator is None or len(terminator.operands) != n:
        return "other"
    returned = list(terminator.operands)
    if allow_set and len(ops) == 1 and all(returned[i] == args[n + i] for i in range(n)):
        return "set"
    if len(ops) != n + 1:
        return "other"
    kind = None
    for i, value in enumerate(returned):
        owner = value.owner
        if not isinstance(owner, ir.OpView):
            return "other"
        op = owner.operation
        this = _BINARY_KIND.get(op.name)
        if this is None or (kind is not None and this != kind):
            return "other"
        kind = this
        operands = list(op.operands)
        pair = (args[i], args[n + i])
        if len(operands) != 2 or not (
            (operands[0] == pair[0] and operands[1] == pair[1]) or (operands[0] == pair[1] and operands[1] == pair[0])
        ):
            return "other"
    return kind or "other"


def _select_direction(region: ir.Region) -> str:
    """`GE`/`GT`/... when a select body is `compare(arg0, arg1)` and nothing else."""
    blocks = list(region.blocks)
    if len(blocks) != 1:
        return "other"
    block = blocks[0]
    args = list(block.arguments)
    ops = [op.operation for op in block.operations]
    if len(args) != 2 or len(ops) != 2:
        return "other"
    compare, terminator = ops
    if compare.name != "stablehlo.compare" or len(terminator.operands) != 1:
        return "other"
    operands = list(compare.operands)
    if operands[0] != args[0] or operands[1] != args[1] or terminator.operands[0] != compare.results[0]:
        return "other"
    return stablehlo.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value


# --------------------------------------------------------------------------- decoders


def _dot_general(op: ir.Operation) -> DotGeneralDims:
    dims = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    return DotGeneralDims(
        lhs_batch=tuple(dims.lhs_batching_dimensions),
        rhs_batch=tuple(dims.rhs_batching_dimensions),
        lhs_contracting=tuple(dims.lhs_contracting_dimensions),
        rhs_contracting=tuple(dims.rhs_contracting_dimensions),
    )


def _dot(op: ir.Operation) -> DotGeneralDims:
    # The legacy `stablehlo.dot`: vector/matrix products contracting lhs' last dimension
    # with rhs' first.
    lhs_rank = ir.RankedTensorType(op.operands[0].type).rank
    return DotGeneralDims(lhs_batch=(), rhs_batch=(), lhs_contracting=(lhs_rank - 1,), rhs_contracting=(0,))


def _convolution(op: ir.Operation) -> ConvDims:
    attrs = op.attributes
    dims = stablehlo.ConvDimensionNumbers(attrs["dimension_numbers"])
    spatial = tuple(dims.input_spatial_dimensions)
    rank = len(spatial)
    reversal = attrs.get("window_reversal")
    return ConvDims(
        input_batch=dims.input_batch_dimension,
        input_feature=dims.input_feature_dimension,
        input_spatial=spatial,
        kernel_in=dims.kernel_input_feature_dimension,
        kernel_out=dims.kernel_output_feature_dimension,
        kernel_spatial=tuple(dims.kernel_spatial_dimensions),
        output_batch=dims.output_batch_dimension,
        output_feature=dims.output_feature_dimension,
        output_spatial=tuple(dims.output_spatial_dimensions),
        window_strides=_ints(attrs.get("window_strides"), (1,) * rank),
        padding=_padding(attrs.get("padding"), rank),
        lhs_dilation=_ints(attrs.get("lhs_dilation"), (1,) * rank),
        rhs_dilation=_ints(attrs.get("rhs_dilation"), (1,) * rank),
        window_reversal=(False,) * rank if reversal is None else tuple(bool(x) for x in reversal),
        feature_group_count=_int(attrs.get("feature_group_count"), 1),
        batch_group_count=_int(attrs.get("batch_group_count"), 1),
    )


def _reduce(op: ir.Operation) -> ReduceAttrs:
    return ReduceAttrs(dimensions=_ints(op.attributes["dimensions"]), kind=body_kind(op.regions[0]))


def _reduce_window(op: ir.Operation) -> ReduceWindowAttrs:
    attrs = op.attributes
    window = _ints(attrs["window_dimensions"])
    rank = len(window)
    return ReduceWindowAttrs(
        window_dimensions=window,
        window_strides=_ints(attrs.get("window_strides"), (1,) * rank),
        base_dilations=_ints(attrs.get("base_dilations"), (1,) * rank),
        window_dilations=_ints(attrs.get("window_dilations"), (1,) * rank),
        padding=_padding(attrs.get("padding"), rank),
        kind=body_kind(op.regions[0]),
    )


def _select_and_scatter(op: ir.Operation) -> SelectAndScatterAttrs:
    attrs = op.attributes
    rank = ir.ShapedType(op.operands[0].type).rank
    return SelectAndScatterAttrs(
        window_dimensions=_ints(attrs.get("window_dimensions"), (1,) * rank),
        window_strides=_ints(attrs.get("window_strides"), (1,) * rank),
        padding=_padding(attrs.get("padding"), rank),
        select=_select_direction(op.regions[0]),
        kind=body_kind(op.regions[1]),
    )


def _broadcast_in_dim(op: ir.Operation) -> BroadcastInDimAttrs:
    return BroadcastInDimAttrs(dims=_ints(op.attributes["broadcast_dimensions"]))


def _transpose(op: ir.Operation) -> TransposeAttrs:
    return TransposeAttrs(permutation=_ints(op.attributes["permutation"]))


def _reshape(op: ir.Operation) -> ReshapeAttrs:
    return ReshapeAttrs(in_shape=_shape(op.operands[0].type), out_shape=_shape(op.results[0].type))


def _slice(op: ir.Operation) -> SliceAttrs:
    attrs = op.attributes
    start = _ints(attrs["start_indices"])
    return SliceAttrs(
        start=start,
        limit=_ints(attrs["limit_indices"]),
        strides=_ints(attrs.get("strides"), (1,) * len(start)),
    )


def _dynamic_slice(op: ir.Operation) -> DynamicSliceAttrs:
    return DynamicSliceAttrs(slice_sizes=_ints(op.attributes["slice_sizes"]))


def _dynamic_update_slice(op: ir.Operation) -> DynamicUpdateSliceAttrs:
    return DynamicUpdateSliceAttrs()


def _pad(op: ir.Operation) -> PadAttrs:
    attrs = op.attributes
    low = _ints(attrs["edge_padding_low"])
    return PadAttrs(
        low=low,
        high=_ints(attrs["edge_padding_high"]),
        interior=_ints(attrs.get("interior_padding"), (0,) * len(low)),
    )


def _concatenate(op: ir.Operation) -> ConcatenateAttrs:
    return ConcatenateAttrs(dimension=_int(op.attributes["dimension"], 0))


def _gather(op: ir.Operation) -> GatherAttrs:
    attrs = op.attributes
    dims = stablehlo.GatherDimensionNumbers(attrs["dimension_numbers"])
    return GatherAttrs(
        offset_dims=tuple(dims.offset_dims),
        collapsed_slice_dims=tuple(dims.collapsed_slice_dims),
        operand_batching_dims=tuple(dims.operand_batching_dims),
        start_indices_batching_dims=tuple(dims.start_indices_batching_dims),
        start_index_map=tuple(dims.start_index_map),
        index_vector_dim=dims.index_vector_dim,
        slice_sizes=_ints(attrs["slice_sizes"]),
        indices_are_sorted=_bool(attrs.get("indices_are_sorted")),
    )


def _scatter(op: ir.Operation) -> ScatterAttrs:
    attrs = op.attributes
    dims = stablehlo.ScatterDimensionNumbers(attrs["scatter_dimension_numbers"])
    return ScatterAttrs(
        update_window_dims=tuple(dims.update_window_dims),
        inserted_window_dims=tuple(dims.inserted_window_dims),
        input_batching_dims=tuple(dims.input_batching_dims),
        scatter_indices_batching_dims=tuple(dims.scatter_indices_batching_dims),
        scatter_dims_to_operand_dims=tuple(dims.scattered_dims_to_operand_dims),
        index_vector_dim=dims.index_vector_dim,
        indices_are_sorted=_bool(attrs.get("indices_are_sorted")),
        unique_indices=_bool(attrs.get("unique_indices")),
        kind=body_kind(op.regions[0], allow_set=True),
    )


def _iota(op: ir.Operation) -> IotaAttrs:
    return IotaAttrs(dimension=_int(op.attributes["iota_dimension"], 0))


def _sort(op: ir.Operation) -> SortAttrs:
    attrs = op.attributes
    return SortAttrs(dimension=_int(attrs.get("dimension"), -1), is_stable=_bool(attrs.get("is_stable")))


def _compare(op: ir.Operation) -> CompareAttrs:
    attrs = op.attributes
    compare_type = attrs.get("compare_type")
    return CompareAttrs(
        direction=stablehlo.ComparisonDirectionAttr(attrs["comparison_direction"]).value,
        compare_type=None if compare_type is None else stablehlo.ComparisonTypeAttr(compare_type).value,
    )


def _custom_call(op: ir.Operation) -> CustomCallAttrs:
    attrs = op.attributes
    config = attrs.get("backend_config")
    if config is None:
        config_text = None
    elif isinstance(config, ir.StringAttr):
        # Some targets keep binary data (serialized protos) here.
        config_text = config.value_bytes.decode("utf-8", errors="backslashreplace")
    else:
        config_text = str(config)
    api_version = attrs.get("api_version")
    return CustomCallAttrs(
        target=ir.StringAttr(attrs["call_target_name"]).value,
        has_side_effect=_bool(attrs.get("has_side_effect")),
        backend_config=config_text,
        api_version=None if api_version is None else ir.IntegerAttr(api_version).value,
    )


_COMPLEX_SPLAT = re.compile(r"dense<\(([^,()]+),([^,()]+)\)>")


def _complex_constant(op: ir.Operation) -> ConstantAttrs:
    # The bindings cannot hand out complex dense attributes at all; print the op with
    # large constants elided instead (a splat is never elided, and prints as `dense<(re,im)>`).
    match = _COMPLEX_SPLAT.search(op.get_asm(large_elements_limit=1))
    if match is None:
        return ConstantAttrs(splat=False, splat_value=None)
    try:
        return ConstantAttrs(splat=True, splat_value=complex(float(match[1]), float(match[2])))
    except ValueError:  # NaN and infinities print as hexadecimal bit patterns
        return ConstantAttrs(splat=True, splat_value=None)


def _constant(op: ir.Operation) -> ConstantAttrs:
    try:
        value = op.attributes["value"]
    except TypeError:
        return _complex_constant(op)
    if not isinstance(value, ir.DenseElementsAttr):
        # dense_resource blobs and the like: not splat as far as we can tell cheaply.
        return ConstantAttrs(splat=False, splat_value=None)
    if not value.is_splat:
        return ConstantAttrs(splat=False, splat_value=None)
    element = value.get_splat_value()
    scalar = element.value if isinstance(element, (ir.BoolAttr, ir.IntegerAttr, ir.FloatAttr)) else None
    return ConstantAttrs(splat=True, splat_value=scalar)


def _reduce_precision(op: ir.Operation) -> ReducePrecisionAttrs:
    attrs = op.attributes
    return ReducePrecisionAttrs(
        exponent_bits=_int(attrs["exponent_bits"], 0), mantissa_bits=_int(attrs["mantissa_bits"], 0)
    )


def _reverse(op: ir.Operation) -> ReverseAttrs:
    return ReverseAttrs(dimensions=_ints(op.attributes["dimensions"]))


def _get_tuple_element(op: ir.Operation) -> GetTupleElementAttrs:
    return GetTupleElementAttrs(index=_int(op.attributes["index"], 0))


def _call(op: ir.Operation) -> CallAttrs:
    return CallAttrs(callee=ir.FlatSymbolRefAttr(op.attributes["callee"]).value)


DECODERS: dict[str, Callable[[ir.Operation], OpAttrs]] = {
    "stablehlo.dot_general": _dot_general,
    "stablehlo.dot": _dot,
    "stablehlo.convolution": _convolution,
    "stablehlo.reduce": _reduce,
    "stablehlo.reduce_window": _reduce_window,
    "stablehlo.select_and_scatter": _select_and_scatter,
    "stablehlo.broadcast_in_dim": _broadcast_in_dim,
    "stablehlo.transpose": _transpose,
    "stablehlo.reshape": _reshape,
    "stablehlo.slice": _slice,
    "stablehlo.dynamic_slice": _dynamic_slice,
    "stablehlo.dynamic_update_slice": _dynamic_update_slice,
    "stablehlo.pad": _pad,
    "stablehlo.concatenate": _concatenate,
    "stablehlo.gather": _gather,
    "stablehlo.scatter": _scatter,
    "stablehlo.iota": _iota,
    "stablehlo.sort": _sort,
    "stablehlo.compare": _compare,
    "stablehlo.custom_call": _custom_call,
    "stablehlo.constant": _constant,
    "stablehlo.reduce_precision": _reduce_precision,
    "stablehlo.reverse": _reverse,
    "stablehlo.get_tuple_element": _get_tuple_element,
    "func.call": _call,
}


def decode_attrs(op: ir.Operation) -> OpAttrs | None:
    """The decoded attributes of `op`, or None for ops without a decoder."""
    decoder = DECODERS.get(op.name)
    return None if decoder is None else decoder(op)
