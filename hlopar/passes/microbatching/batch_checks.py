"""Which values carry the batch (Shardy propagation of a microbatch axis), and whether each
op computes each microbatch's values from its rows alone (the split pass's docstring, "How").
"""

from __future__ import annotations

import math

from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.auto_sharding.rules import PASS_THROUGH_OPS, OpRule, rule_of
from hlopar.analysis.sharding import ShardingPerValue, TensorSharding
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import find_main
from hlopar.ir.op_attrs import decode_attrs
from hlopar.ir.signature import FuncSignature
from hlopar.passes.microbatching.batch_positions import batch_gathers
from hlopar.passes.microbatching.common import (
    AXIS,
    CONTROL_FLOW_OPS,
    MESH,
    SDY_SHARDING,
    SUM_OPS,
    SplitError,
    allocate,
    batch_sharding,
    int_attr,
    is_zero,
    reduces_by_add,
    unshare_splats,
    walk_ops,
)
from hlopar.passes.microbatching.per_example_results import concatenated_dim


class BatchChecks:
    """The propagation and the per-op checks of `_Splitter` (state: its `graph`, `ops`, `b`, `axis`)."""

    def _propagate(self) -> None:  # noqa: C901 (reason in the docstring)
        """Propagates the batch dimension through a sharded clone of @main and checks each op.

        Whole on purpose: each step reads what the previous left in the clone (the mesh, the
        constraints, the propagated shardings), in the order Shardy's propagation needs."""
        size = math.gcd(*(self.graph.values[self.graph.args[i]].shape[0] for i in self.batch_args))
        # Gathers by the batch's own positions as batched gathers (with B = 1, as written).
        gathers = batch_gathers(self.main, self.batch_args) if self.b > 1 else 0
        if unshare_splats(self.main, size) or gathers:
            self.graph, self.ops = FuncGraph.from_func(self.main), walk_ops(self.main)
        clone_module = self.module.clone()
        clone = find_main(clone_module)
        body = clone_module.regions[0].blocks[0]
        with ir.InsertionPoint(body.operations[0]):
            sdy.MeshOp(MESH, ir.Attribute.parse(f'#sdy.mesh<["{AXIS}"={self.axis}]>'))
        clone_ops = walk_ops(clone)
        for op in clone_ops:  # the input's own shardings are not about microbatches
            if op.name == "sdy.manual_computation":
                raise SplitError(self.ops[clone_ops.index(op)], "manual computations cannot be microbatched")
            if SDY_SHARDING in op.attributes:
                del op.attributes[SDY_SHARDING]
            if op.name == "sdy.sharding_constraint":
                rank = len(ir.RankedTensorType(op.results[0].type).shape)
                op.attributes["sharding"] = batch_sharding(rank, None, closed=False)
        arg_types = [a.type for a in clone.regions[0].blocks[0].arguments]
        attrs = []
        for i, t in enumerate(arg_types):
            rank = len(ir.RankedTensorType(t).shape) if isinstance(t, ir.RankedTensorType) else None
            entry = {}
            if rank is not None:
                entry[SDY_SHARDING] = batch_sharding(
                    rank, 0 if i in self.batch_args else None, closed=i not in self.batch_args
                )
            attrs.append(ir.DictAttr.get(entry))
        clone.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        if "res_attrs" in clone.attributes:
            del clone.attributes["res_attrs"]
        for op in clone_ops:  # Shardy does not propagate through them: their readers read the operands
            if op.name in PASS_THROUGH_OPS:
                for operand, result in zip(op.operands, op.results):
                    result.replace_all_uses_with(operand)
        try:
            passmanager.PassManager.parse(
                "builtin.module(sdy-add-data-flow-edges,sdy-aggressive-propagate,func.func(sdy-sink-data-flow-edges))"
            ).run(clone_module)
            passmanager.PassManager.parse("builtin.module(func.func(sdy-populate-op-sharding-rules))").run(clone_module)
        except ir.MLIRError as error:
            raise DiagnosticError.from_mlir_error(error) from None
        clone_ops = walk_ops(clone)
        assert len(clone_ops) == len(self.ops)
        for i, arg in enumerate(self.main.regions[0].blocks[0].arguments):
            if i in self.batch_args:
                rank = len(ir.RankedTensorType(arg.type).shape)
                self.div[arg] = (self.axis,) + (1,) * (rank - 1)
        for op, twin in zip(self.ops, clone_ops):
            self.rules.append(rule_of(twin))
            if op.name in PASS_THROUGH_OPS:  # result k is operand k
                for operand, result in zip(op.operands, op.results):
                    if operand in self.div:
                        self.div[result] = self.div[operand]
                continue
            if twin.name in ("sdy.sharding_constraint", "sdy.reshard"):
                per_value = (TensorSharding.parse(str(twin.attributes["sharding"])),)
            elif SDY_SHARDING in twin.attributes:
                per_value = ShardingPerValue.parse(str(twin.attributes[SDY_SHARDING])).shardings
            else:
                continue
            for result, sharding in zip(op.results, per_value):
                div = self._division(sharding)
                if div is not None:
                    self.div[result] = div
            if op.name == "stablehlo.while":
                for region in op.regions:
                    for arg, result in zip(region.blocks[0].arguments, op.results):
                        if result in self.div:
                            self.div[arg] = self.div[result]

    def _division(self, sharding: TensorSharding) -> tuple[int, ...] | None:
        if sharding.mesh_name != MESH:
            return None
        div = tuple(
            math.prod(ref.sub[1] if ref.sub else self.axis for ref in axes if ref.name == AXIS)
            for axes in sharding.dim_axes
        )
        return div if any(d > 1 for d in div) else None

    def divided(self, value: ir.Value) -> tuple[int, ...] | None:
        return self.div.get(value)

    # -- per-op checks

    def _check_op(self, op: ir.Operation, rule: OpRule | None) -> None:
        """Refuses an op that would compute something else on a microbatch than on its rows of
        the batch (module docstring: what is refused)."""
        operands = [self.divided(v) for v in op.operands]
        results = [self.divided(v) for v in op.results]
        if not any(operands) and not any(results):
            return
        name = op.name
        if name in ("stablehlo.return", "func.return", "sdy.return"):
            self._check_return(op, operands)
            return
        if name in ("sdy.sharding_constraint", "sdy.reshard"):
            if operands != results:
                raise SplitError(op, f"'{name}' holds the batch along other dims than its input")
            return
        if name == "stablehlo.while":
            if operands != results:
                raise SplitError(
                    op, "'stablehlo.while' carries the batch in some values along other dims than its inputs have it"
                )
            return
        if name in ("stablehlo.case", "stablehlo.if") or not op.operands:
            return  # branches: their returns are checked against the results; constants: when resized
        if name in ("stablehlo.rng", "stablehlo.rng_bit_generator"):
            self._per_microbatch_random(op)  # refused, or resized with a warning
            return
        if name in ("stablehlo.reduce_window", "stablehlo.select_and_scatter"):
            self._check_window(op, next((d for d in operands if d), None))
        if rule is None or rule.is_custom:
            raise SplitError(
                op, f"'{name}' has no sharding rule: hlopar cannot tell whether it mixes the examples of the batch"
            )
        self._check_factors(op, rule, operands, results)

    @staticmethod
    def _check_window(op: ir.Operation, div: tuple[int, ...] | None) -> None:
        """A window op (pooling, a cumulative sum, their gradients) splits along the batch
        like an elementwise op where its window holds one example of the batch dim: size 1,
        stride 1, no dilation, no padding. Checked before the op's rule, whose verdict
        ("moves data") would not say why."""
        attrs = decode_attrs(op)
        for d, parts in enumerate(div or ()):
            if parts == 1:
                continue
            spans = {
                "size": attrs.window_dimensions[d],
                "stride": attrs.window_strides[d],
                "dilation": getattr(attrs, "window_dilations", (1,) * len(div))[d],
                "base dilation": getattr(attrs, "base_dilations", (1,) * len(div))[d],
            }
            wide = [f"{what} {n}" for what, n in spans.items() if n != 1]
            low, high = attrs.padding[d]
            if low or high:
                wide.append(f"padding {low}, {high}")
            if wide:
                raise SplitError(
                    op,
                    f"'{op.name}' slides a window along the batch (dim {d}: {', '.join(wide)}): "
                    "its windows would hold examples of several microbatches (pooling or a "
                    "cumulative sum over the batch?); only windows over the other dims split",
                )

    def _check_return(self, op: ir.Operation, operands: list[tuple[int, ...] | None]) -> None:
        """A function's results: per-example results concatenate along one dim; a region's:
        the batch dims its parent carries."""
        name = op.name
        parent = op.parent
        if name == "func.return":  # per-example results: concatenated along their batch dim
            for number, div in enumerate(operands):
                if div and (dim := concatenated_dim(div, self.b)) is None:
                    raise SplitError(
                        op,
                        f"{FuncSignature.of(self.main).result(number)} of @main carries the "
                        f"batch spread over several dims {div}: the {self.b} microbatches' "
                        "values cannot be concatenated along one (return it with the batch "
                        "in one dim, or use microbatches=1)",
                    )
                if div:
                    self.per_example_results[number] = dim
            return
        if parent.name in CONTROL_FLOW_OPS:
            expected = [self.divided(v) for v in parent.results]
            if operands != expected:
                raise SplitError(op, f"a value carried by '{parent.name}' changes its batch dims inside it")

    def _check_factors(
        self,
        op: ir.Operation,
        rule: OpRule,
        operands: list[tuple[int, ...] | None],
        results: list[tuple[int, ...] | None],
    ) -> None:
        """By the op's sharding rule: the batch sits on the same factors of all operands and
        results, moves along none, and is reduced only by a sum."""
        name = op.name
        factors: dict[int, set[int]] = {}
        tensors = [(d, m, "operand", k) for k, (d, m) in enumerate(zip(operands, rule.operands))]
        tensors += [(d, m, "result", k) for k, (d, m) in enumerate(zip(results, rule.results))]
        for div, mapping, what, number in tensors:
            for dim, dim_factors in enumerate(mapping):
                shares = allocate(div[dim] if div else 1, [rule.factor_sizes[f] for f in dim_factors])
                if shares is None:
                    raise SplitError(
                        op,
                        f"'{name}' reshapes the batch dim of its {what} {number} in a way microbatches cannot follow",
                    )
                for f, share in zip(dim_factors, shares):
                    factors.setdefault(f, set()).add(share)
        moving = [
            f
            for f, shares in factors.items()
            if shares != {1} and (f in rule.need_replication or f in rule.permutation)
        ]
        if moving:
            raise SplitError(
                op,
                f"'{name}' moves data along the batch dim (slices, pads, concatenates, sorts or "
                "reverses it): examples of different microbatches would mix",
            )
        reduced = False
        for f, shares in factors.items():
            if shares == {1}:
                continue
            if len(shares) > 1:
                raise SplitError(
                    op,
                    f"'{name}' combines values that carry the batch along a dim with values that "
                    "do not (a parameter or constant indexed by example?)",
                )
            if f in rule.reduction:
                reduced = True
        if reduced:
            if any(results):
                raise SplitError(op, f"'{name}' sums over part of the batch only")
            why = self._not_a_sum(op)
            if why:
                raise SplitError(op, f"'{name}' reduces over the batch but {why}: microbatches can only sum")

    def _not_a_sum(self, op: ir.Operation) -> str | None:
        name = op.name
        if name not in SUM_OPS:
            return "is not a sum"
        if name == "stablehlo.reduce":
            if len(op.results) != 1:
                return "reduces several values together"
            if not reduces_by_add(op):
                return "its body is not an addition"
            if not is_zero(op.operands[1]):
                return "its initial value is not zero"
        if name == "stablehlo.scatter":
            if len(op.results) != 1 or not reduces_by_add(op):
                return "it does not add its updates"
            if not is_zero(op.operands[0]):
                return "it adds into a buffer that is not zero"
        if name == "stablehlo.convolution" and int_attr(op, "batch_group_count") != 1:
            return "it groups the batch"
        return None

    # -- kinds of top-level values
