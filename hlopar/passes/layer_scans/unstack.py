"""Splitting the values stacked along a layer axis into one piece per layer
(`hlopar-unstack-layer-scans`, step 2 of its docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.dataflow import ELEMENTWISE_LIKE_OPS
from hlopar.dialect.attributes import LAYER_PIECES_ATTR
from hlopar.dialect.layers import LayerPieces
from hlopar.ir.signature import FuncSignature
from hlopar.passes.layer_scans.values import constant_int, dense_ints, shape_of

__all__ = ["SplitSummary", "unstack"]

_COMBINING = frozenset({"stablehlo.add", "stablehlo.maximum", "stablehlo.minimum", "stablehlo.and", "stablehlo.or"})


@dataclass(frozen=True)
class SplitSummary:
    split_arguments: int
    split_results: int


def unstack(main: ir.Operation, counts: set[int]) -> SplitSummary:
    """Splits the values of `main` stacked along a leading layer axis of a size in `counts`."""
    splitter = _Splitter(main, counts)
    return splitter.run()


def _piece_type(value: ir.Value) -> ir.Type:
    t = ir.RankedTensorType(value.type)
    return ir.RankedTensorType.get([1] + list(t.shape[1:]), t.element_type, t.encoding)


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
        shape = shape_of(value)
        return shape[0] if shape and shape[0] in self.counts else None

    def _layer_index(self, op: ir.Operation, sizes_or_update: list[int], indices: list[ir.Value]) -> int | None:
        """The layer a dynamic_slice reads or a dynamic_update_slice writes, when it is one layer at a constant."""
        if not indices or sizes_or_update[0] != 1:
            return None
        return constant_int(indices[0])

    def _reads_follow(self, value: ir.Value) -> bool:
        for use in value.uses:
            op, number = use.owner, use.operand_number
            op = op.operation if isinstance(op, ir.OpView) else op
            if op == self.ret or op.name in ELEMENTWISE_LIKE_OPS:
                continue
            if op.parent != self.main:
                return False
            if op.name == "stablehlo.dynamic_slice" and number == 0:
                if self._layer_index(op, dense_ints(op, "slice_sizes"), list(op.operands)[1:]) is None:
                    return False
            elif op.name == "stablehlo.slice" and number == 0:
                start, limit = dense_ints(op, "start_indices"), dense_ints(op, "limit_indices")
                if limit[0] - start[0] != 1 or dense_ints(op, "strides")[0] != 1:
                    return False
            elif op.name == "stablehlo.dynamic_update_slice" and number == 0:
                if self._layer_index(op, shape_of(op.operands[1]), list(op.operands)[2:]) is None:
                    return False
            elif op.name == "stablehlo.reduce" and number == 0:
                if len(op.results) != 1 or not self._combines(op):
                    return False
            elif op.name == "stablehlo.transpose":
                if dense_ints(op, "permutation")[0] != 0:
                    return False
            elif op.name == "stablehlo.broadcast_in_dim":
                if dense_ints(op, "broadcast_dimensions")[0] != 0 or self._leading(op.results[0]) is None:
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
            dims = dense_ints(reduce, "dimensions")
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
        if name in ELEMENTWISE_LIKE_OPS or name == "stablehlo.dynamic_update_slice":
            return True
        if name == "stablehlo.constant":
            return ir.DenseElementsAttr(op.attributes["value"]).is_splat
        if name == "stablehlo.broadcast_in_dim":
            dims = dense_ints(op, "broadcast_dimensions")
            return 0 not in dims or dims[0] == 0
        if name == "stablehlo.transpose":
            return dense_ints(op, "permutation")[0] == 0
        if name == "stablehlo.reduce":
            return 0 not in dense_ints(op, "dimensions") and len(op.results) == 1 and self._combines(op)
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
        """Rewrites `op` on the pieces of the stacked values it reads or makes."""
        name = op.name
        if name == "stablehlo.dynamic_slice" or name == "stablehlo.slice":
            self._rewrite_read(op)
            return
        result = op.results[0] if len(op.results) == 1 else None
        layers = self._leading(result) if result is not None and result in chosen else None
        if name == "stablehlo.dynamic_update_slice":
            self._rewrite_write(op, result)
        elif name == "stablehlo.constant":
            value = ir.DenseElementsAttr(op.attributes["value"])
            shared = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(_piece_type(result), value.get_splat_value()))
            self.pieces[result] = [shared.result] * layers
        elif name == "stablehlo.broadcast_in_dim" and op.operands[0] not in chosen:
            # One per layer, as the unrolled model has: a shared one would be made by the first
            # layer's stage and sent to every other stage.
            made = []
            for _ in range(layers):
                clone = op.clone()
                clone.results[0].set_type(_piece_type(result))
                made.append(clone.results[0])
            self.pieces[result] = made
        elif name == "stablehlo.reduce" and result not in chosen:  # over the layer axis
            self._rewrite_layer_sum(op, result)
        else:
            self._rewrite_per_piece(op, chosen, layers)

    def _rewrite_read(self, op: ir.Operation) -> None:
        """A read of one layer (`slice` or `dynamic_slice` at a constant index) reads its piece."""
        name = op.name
        source = op.operands[0]
        if name == "stablehlo.slice":
            layer = dense_ints(op, "start_indices")[0]
        else:
            layer = constant_int(op.operands[1])
        layer = min(max(layer, 0), len(self.pieces[source]) - 1)  # dynamic_slice clamps
        piece = self.pieces[source][layer]
        if shape_of(piece) == shape_of(op.results[0]):
            op.results[0].replace_all_uses_with(piece)
            return
        clone = op.clone()
        clone.operands[0] = piece
        if name == "stablehlo.dynamic_slice":
            clone.operands[1] = _zero_like(op.operands[1])
        else:
            start, limit = dense_ints(op, "start_indices"), dense_ints(op, "limit_indices")
            clone.attributes["start_indices"] = ir.DenseI64ArrayAttr.get([0] + start[1:])
            clone.attributes["limit_indices"] = ir.DenseI64ArrayAttr.get([limit[0] - start[0]] + limit[1:])
        op.results[0].replace_all_uses_with(clone.results[0])

    def _rewrite_write(self, op: ir.Operation, result: ir.Value) -> None:
        """A write of one layer (`dynamic_update_slice` at a constant index) replaces its piece."""
        base = self.pieces[op.operands[0]]
        layer = min(max(constant_int(op.operands[2]), 0), len(base) - 1)
        update = op.operands[1]
        if shape_of(update) == shape_of(base[layer]) and all(constant_int(v) == 0 for v in list(op.operands)[3:]):
            written = update
        else:
            clone = op.clone()
            clone.operands[0] = base[layer]
            clone.operands[2] = _zero_like(op.operands[2])
            written = clone.results[0]
        self.pieces[result] = base[:layer] + [written] + base[layer + 1 :]

    def _rewrite_layer_sum(self, op: ir.Operation, result: ir.Value) -> None:
        """A reduce over the layer axis: the sum of the pieces' sums."""
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

    def _rewrite_per_piece(self, op: ir.Operation, chosen: set[ir.Value], layers: int) -> None:
        """Elementwise ops, transposes and broadcasts keeping the layer axis first, reductions
        over other dims: one copy per piece."""
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
