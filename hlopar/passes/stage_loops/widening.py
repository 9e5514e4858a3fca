"""An update fragment computes a held range's update once on the whole range instead of per
layer (`widen_joins`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.dataflow import ELEMENTWISE_LIKE_OPS
from hlopar.analysis.sharding import DimSharding, TensorSharding
from hlopar.passes.stage_loops.rolling import op_structure
from hlopar.passes.stage_loops.rows import int_array, row_range, rows_of_one, shape_of

__all__ = ["widen_joins"]


def widen_joins(fragment: ir.Operation) -> int:
    """In an update fragment, each range result joined by `concatenate` from per-layer pieces
    computed alike (the optimizer's elementwise ops on each layer's rows) is computed once on
    the whole range instead (`_Widen`); returns how many joins were widened."""
    block = fragment.regions[0].blocks[0]
    terminator = list(block.operations)[-1].operation
    widen = _Widen(terminator)
    count = 0
    for value in list(terminator.operands):
        owner = value.owner
        if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.concatenate":
            continue
        join = owner.operation
        if ir.IntegerAttr(join.attributes["dimension"]).value != 0 or any(shape_of(v)[0] != 1 for v in join.operands):
            continue
        wide = widen(tuple(join.operands))
        if wide is not None and wide.type == value.type:
            value.replace_all_uses_with(wide)
            count += 1
    if count:
        for op in reversed(list(block.operations)[:-1]):
            op = op.operation
            if op.name in _PURE and not any(list(r.uses) for r in op.results):
                op.erase()
    return count


_SHARDING = re.compile(r"sdy\.sharding = #sdy\.sharding_per_value<\[(?:<[^<>]*>(?:, )?)*\]>,? ?")
_PURE = ELEMENTWISE_LIKE_OPS | {
    "stablehlo.slice",
    "stablehlo.reshape",
    "stablehlo.concatenate",
    "stablehlo.broadcast_in_dim",
    "stablehlo.constant",
    "stablehlo.reverse",
}


@dataclass
class _Widen:
    """One value of n rows from n values (row i of the result is the i-th: with `lead`, each
    value's unit leading dim becomes the rows, else a leading dim is added), made before
    `before`: a value shared by all rows is broadcast, rows of one stack in order are that
    stack's slice (reversed for a descending order), values made alike by elementwise ops (and
    broadcasts, sharding constraints) are made once from their widened operands; None where
    neither holds."""

    before: ir.Operation
    made: dict[tuple, ir.Value | None] = field(default_factory=dict)

    def __call__(self, values: tuple[ir.Value, ...], lead: bool = True) -> ir.Value | None:
        if (values, lead) not in self.made:
            with ir.InsertionPoint(self.before), self.before.location:
                self.made[(values, lead)] = self._widened(values, lead)
        return self.made[(values, lead)]

    def _widened(self, values: tuple[ir.Value, ...], lead: bool) -> ir.Value | None:
        n, t = len(values), ir.RankedTensorType(values[0].type)
        if lead and (t.rank == 0 or t.shape[0] != 1):
            return values[0] if t.rank == 0 and len(set(values)) == 1 else None  # a shared scalar operand
        rest = list(t.shape[1:] if lead else t.shape)
        wide = ir.RankedTensorType.get([n] + rest, t.element_type, t.encoding)
        if len(set(values)) == 1:
            dims = list(range(t.rank)) if lead else list(range(1, t.rank + 1))
            return stablehlo.BroadcastInDimOp(wide, values[0], ir.DenseI64ArrayAttr.get(dims)).result
        rows = rows_of_one(values)
        if rows is not None:
            return row_range(rows[1], rows[2], rows[3], n, wide)
        owners = [v.owner for v in values]
        ops = [None if isinstance(o, ir.Block) else o.operation for o in owners]
        if any(op is None for op in ops) or len(ops[0].results) != 1:
            return self._joined(values, wide)
        structures = {op_structure(op) for op in ops}
        if len(structures) > 1 and all(op.name == "sdy.sharding_constraint" for op in ops):
            return self(tuple(op.operands[0] for op in ops), lead)  # differing constraints: none
        # Layers laid out differently (a layer cut between stages) are computed alike all the same.
        if len({_SHARDING.sub("", text) for text in structures}) != 1:
            return self._joined(values, wide)
        name = ops[0].name
        if name == "stablehlo.constant":
            attr = ir.DenseElementsAttr(ops[0].attributes["value"])
            if not attr.is_splat:
                return None
            return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(wide, attr.get_splat_value())).result
        if name == "stablehlo.broadcast_in_dim":
            dims = int_array(ops[0], "broadcast_dimensions")
            if lead and 0 in dims:
                return None
            operand = self(tuple(op.operands[0] for op in ops), lead=False)
            if operand is None:
                return None
            return stablehlo.BroadcastInDimOp(
                wide, operand, ir.DenseI64ArrayAttr.get([0] + [d if lead else d + 1 for d in dims])
            ).result
        if name not in ELEMENTWISE_LIKE_OPS:
            return self._joined(values, wide)
        operands = [self(tuple(op.operands[k] for op in ops), lead) for k in range(len(ops[0].operands))]
        if any(v is None for v in operands):
            return None
        clone = ops[0].clone(ip=ir.InsertionPoint(self.before))
        for k, v in enumerate(operands):
            clone.operands[k] = v
        clone.results[0].set_type(wide)
        if name == "sdy.sharding_constraint" and not lead:  # the new rows dim: whole
            sharding = TensorSharding.parse(str(clone.attributes["sharding"]))
            clone.attributes["sharding"] = ir.Attribute.parse(
                replace(sharding, dims=(DimSharding(),) + sharding.dims).format()
            )
        elif "sdy.sharding" in clone.attributes and (not lead or len(structures) > 1):
            del clone.attributes["sdy.sharding"]  # of the rank before, or differing: left to propagation
        return clone.results[0]

    def _joined(self, values: tuple[ir.Value, ...], wide: ir.RankedTensorType) -> ir.Value | None:
        """The values as runs of rows of stacks (in order, each run at least two rows) and
        single values between them, concatenated (the layer a stage computed outside its
        loop beside the loop's rows); None without such a run."""
        segments: list[tuple[int, int]] = []  # (start, end) in values
        start = 0
        while start < len(values):
            end = start + 1
            while end < len(values) and rows_of_one(values[start : end + 1]) is not None:
                end += 1
            segments.append((start, end))
            start = end
        if all(end - start == 1 for start, end in segments):
            return None
        parts = []
        for start, end in segments:
            t = ir.RankedTensorType.get([end - start] + list(wide.shape[1:]), wide.element_type, wide.encoding)
            if end - start == 1:
                value = values[start]
                parts.append(value if value.type == t else stablehlo.ReshapeOp(t, value).result)
            else:
                _, stack, first, step = rows_of_one(values[start:end])
                parts.append(row_range(stack, first, step, end - start, t))
        return stablehlo.ConcatenateOp(parts, 0).result
