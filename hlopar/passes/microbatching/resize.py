"""Dividing the batch dims by B: result types and the attributes that spell out sizes."""

from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.passes.microbatching.common import TYPE_ONLY_OPS, SplitError, divided_type, int_attr


class Resizer:
    """The resizing of `_Splitter` (after the checks: every value's division is known)."""

    def _resize(self) -> int:
        count = 0
        for op in self.ops:
            self._fix_attributes(op)
        for value, div in self.div.items():
            tensor = ir.RankedTensorType(value.type)
            shape = [s // d for s, d in zip(tensor.shape, div)]
            if any(s % d for s, d in zip(tensor.shape, div)):
                owner = value.owner if isinstance(value, ir.OpResult) else None
                raise SplitError(owner, f"a value of type {tensor} has a batch dim not divisible by {self.b}")
            value.set_type(ir.RankedTensorType.get(shape, tensor.element_type, tensor.encoding))
            count += 1
        block = self.main.regions[0].blocks[0]
        function_type = ir.FunctionType(ir.TypeAttr(self.main.attributes["function_type"]).value)
        self.main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([a.type for a in block.arguments], list(function_type.results))
        )
        return count

    def _fix_attributes(self, op: ir.Operation) -> None:
        name = op.name
        results = [self.divided(v) for v in op.results]
        operands = [self.divided(v) for v in op.operands]
        if not any(results) and not any(operands):
            return
        if name == "stablehlo.constant":
            attr = ir.DenseElementsAttr(op.attributes["value"])
            if not attr.is_splat:
                raise SplitError(
                    op,
                    "a constant that is not a splat has the batch's shape: its rows would have "
                    "to be cut per microbatch",
                )
            new_type = divided_type(op.results[0].type, results[0])
            op.attributes["value"] = ir.DenseElementsAttr.get_splat(new_type, attr.get_splat_value())
        elif name == "stablehlo.iota":
            if results[0][int_attr(op, "iota_dimension")] > 1:
                self.iotas.append(op)  # counts the batch's rows: made global after resizing
        elif name == "stablehlo.slice":
            self._fix_full_range(op, operands[0], ("start_indices", "limit_indices", "strides"))
        elif name == "stablehlo.dynamic_slice":
            self._fix_sizes(op, operands[0], "slice_sizes", "dynamic_slice")
        elif name == "stablehlo.gather":
            self._fix_sizes(op, operands[0], "slice_sizes", "gather", allow_one=True)
        elif name == "stablehlo.pad":
            for key in ("edge_padding_low", "edge_padding_high", "interior_padding"):
                values = list(ir.DenseI64ArrayAttr(op.attributes[key]))
                if any(values[d] for d, div in enumerate(operands[0]) if div > 1):
                    raise SplitError(op, "'stablehlo.pad' pads the batch dim")
        elif name == "stablehlo.rng":
            self._fix_rng_shape(op, results[0])
        elif name not in TYPE_ONLY_OPS and name not in ("sdy.sharding_constraint", "sdy.reshard"):
            raise SplitError(op, f"hlopar-split-microbatches cannot resize '{name}' along the batch")

    def _fix_full_range(self, op, div, keys) -> None:
        start, limit, strides = (list(ir.DenseI64ArrayAttr(op.attributes[k])) for k in keys)
        shape = ir.RankedTensorType(op.operands[0].type).shape
        for d, factor in enumerate(div):
            if factor > 1:
                if (start[d], limit[d], strides[d]) != (0, shape[d], 1):
                    raise SplitError(
                        op,
                        f"'{op.name}' takes part of the batch dim ([{start[d]}:{limit[d]}:{strides[d]}] of {shape[d]})",
                    )
                limit[d] = shape[d] // factor
        op.attributes[keys[1]] = ir.DenseI64ArrayAttr.get(limit)

    def _fix_sizes(self, op, div, key, what, allow_one=False) -> None:
        sizes = list(ir.DenseI64ArrayAttr(op.attributes[key]))
        shape = ir.RankedTensorType(op.operands[0].type).shape
        for d, factor in enumerate(div or ()):
            if factor > 1:
                if sizes[d] == shape[d]:
                    sizes[d] = shape[d] // factor
                elif not (allow_one and sizes[d] == 1):
                    raise SplitError(
                        op, f"'{op.name}' takes a slice of size {sizes[d]} of the batch dim (size {shape[d]})"
                    )
        op.attributes[key] = ir.DenseI64ArrayAttr.get(sizes)

    def _fix_rng_shape(self, op, div) -> None:
        shape_value = op.operands[2]
        new_shape = [s // d for s, d in zip(ir.RankedTensorType(op.results[0].type).shape, div)]
        shape_type = ir.RankedTensorType(shape_value.type)
        with ir.InsertionPoint(op), op.location:
            constant = stablehlo.ConstantOp(
                ir.DenseElementsAttr.get(
                    np.array(new_shape, dtype="int64"), type=shape_type.element_type, shape=list(shape_type.shape)
                )
            )
        op.operands[2] = constant.result

    def _per_microbatch_random(self, op) -> None:
        """A generator of the whole shape at once: a microbatch cannot draw the batch's rows of it."""
        if self.rng != "per-microbatch":
            raise SplitError(
                op,
                f"'{op.name}' draws random numbers for the whole batch at once: a microbatch "
                "cannot draw its rows of them; rng=per-microbatch accepts other random numbers "
                "per microbatch (JAX's default threefry generator is split exactly)",
            )
        self.context.warn(
            op,
            f"hlopar-split-microbatches: '{op.name}' draws random numbers per microbatch "
            "(rng=per-microbatch): other numbers than the whole batch's",
        )
