"""The kind of every top-level op of a split step (`batch`, `sum`, `step`, none), loops and
branches included, and the loss and statistics checks that go with it (the split pass's
docstring, "Loops and branches", "Batch statistics").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from jaxlib.mlir import ir

from hlopar.analysis.auto_sharding.rules import PASS_THROUGH_OPS
from hlopar.analysis.training_roles import classify
from hlopar.dialect.attributes import BATCH, STEP, SUM
from hlopar.ir.extract import value_of
from hlopar.ir.graph import FuncGraph
from hlopar.ir.signature import FuncSignature
from hlopar.passes.microbatching.batch_scales import batch_only_values, factor_scales, scale_uses
from hlopar.passes.microbatching.batch_statistics import mean_divisions, reduced_count
from hlopar.passes.microbatching.common import (
    CONTROL_FLOW_OPS,
    LOCAL,
    LOCAL_SUM,
    ZERO,
    SplitError,
    ancestors,
    ancestors_of,
    is_zero,
    join_kinds,
    linear_in_sums,
    op_place,
    value_origin,
    walk_ops,
)


@dataclass
class KindPass:
    """What one walk over the top-level ops found."""

    op_kinds: list[str | None] = field(default_factory=list)
    value_kind: dict[int, str | None] = field(default_factory=dict)
    per_example: set[int] = field(default_factory=set)  # ops reading or carrying per-example values
    reductions: dict[int, int | None] = field(default_factory=dict)  # of those, sums over the batch: count
    statistics: list[tuple[int, int]] = field(default_factory=list)  # (op, value of the whole batch it uses)
    refusals: list[SplitError] = field(default_factory=list)  # inside loops and branches, in the order found


class KindAnalysis:
    """The kinds analysis of `_Splitter`."""

    def _kinds(self) -> tuple[list[str | None], dict[int, str | None], SplitError | None, list[int]]:
        """Each top-level op's kind, each value's (LOCAL: a per-microbatch statistic), the first
        batch statistic that cannot be split (raised after the loss is checked, whose error
        says more when the loss is to blame), and the means over the batch used per example
        (`batch_statistics.mean_divisions`), computed per microbatch."""
        first = self._kind_pass(frozenset())
        means = mean_divisions(self.graph, first.value_kind, first.per_example, first.reductions)
        # A mean the loss is computed from is the loss's (its nonlinearity is the error), not a statistic.
        loss = self.loss_result if self.loss_result is not None else classify(self.graph).loss_result
        if loss is not None and 0 <= loss < len(self.graph.results):
            before_loss = ancestors(self.graph, self.graph.values[self.graph.results[loss]].producer, first.per_example)
            means = [i for i in means if i not in before_loss]
        found = self._kind_pass(frozenset(means))
        if found.refusals:
            raise found.refusals[0]
        if self.b > 1 and found.statistics and self._factor_scales(found):
            return self._kinds()  # the IR changed: its kinds anew
        self._mark_per_microbatch(found)
        error = None
        if self.b == 1:
            self._one_microbatch(found)
        elif found.statistics:
            index, statistic = found.statistics[0]
            node = self.graph.ops[index]
            source = self.graph.values[statistic].producer
            where = op_place(self.graph.ops[source].mlir_op) if source is not None else "an argument"
            error = SplitError(
                node.mlir_op,
                f"'{node.name}' uses a value computed from the whole batch (at {where}) "
                "per example: a batch statistic that is not a mean over the batch (means "
                "are taken per microbatch, as GPipe does), or the backward of a loss that "
                "is not a sum or mean over the batch, cannot be split into microbatches, "
                "and it is not a normalizer that can (a float scalar of the batch only, used "
                f"linearly: {self.scale_refusal}) (with microbatches=1 the step runs as written)",
            )
        return found.op_kinds, found.value_kind, error, means

    def _factor_scales(self, found: KindPass) -> bool:
        """Factors the batch's normalizers out of the microbatches (`batch_scales`) where the
        statistics used per example are such; whether the IR changed (else why not, in
        `scale_refusal`)."""
        if any(i not in found.per_example for i, _ in found.statistics):
            self.scale_refusal = "a statistic of the microbatch uses it"
            return False
        uses = scale_uses(
            self.graph,
            found.statistics,
            batch_only_values(self.graph, self.batch_args),
            lambda v: self.divided(value_of(self.graph, v)) is not None,
        )
        if isinstance(uses, str):
            self.scale_refusal = uses
            return False
        factor_scales(self.graph, uses)
        self.graph, self.ops = FuncGraph.from_func(self.main), walk_ops(self.main)
        self.scales += len(uses.readers)
        return True

    def _kind_pass(self, means: frozenset[int]) -> KindPass:
        """Kinds in program order; `means` (op indices) are per-microbatch statistics."""
        graph = self.graph
        found = KindPass()
        kind = found.value_kind
        for i, a in enumerate(graph.args):
            kind[a] = BATCH if i in self.batch_args else None
        for index, node in enumerate(graph.ops):
            op = node.mlir_op
            reads = graph.reads(index)
            read_kinds = {kind[v] for v in reads}
            if node.name in PASS_THROUGH_OPS:  # result k is operand k, of its kind
                for operand, result in zip(node.operands, node.results):
                    kind[result] = kind[operand]
                if BATCH in read_kinds and STEP in read_kinds:
                    raise SplitError(
                        op,
                        f"'{node.name}' holds per-example values together with values computed "
                        "once per step from the whole batch",
                    )
                found.op_kinds.append(next((k for k in (BATCH, LOCAL, LOCAL_SUM, SUM, STEP) if k in read_kinds), None))
                if BATCH in read_kinds:
                    found.per_example.add(index)
                continue
            carries = [self.divided(value_of(graph, v)) is not None for v in node.results]
            if any(carries) or BATCH in read_kinds:
                found.per_example.add(index)
                results = [BATCH if c else SUM for c in carries]  # a sum over the batch: checked by _check_op
                if node.name in CONTROL_FLOW_OPS:
                    # A loop or branch: what it carries or returns, from the ops inside.
                    found.reductions[index] = None
                    if self.b > 1:
                        known = {value_of(graph, v): kind[v] for v in reads}
                        results = [None if k == ZERO else k for k in self._control_flow_kinds(op, known, found)]
                else:
                    found.statistics += [(index, v) for v in reads if kind[v] in (SUM, STEP)]
                    if not any(carries):
                        found.reductions[index] = reduced_count(graph, index)
                for v, k in zip(node.results, results):
                    kind[v] = k
                found.op_kinds.append(BATCH if any(carries) else SUM)
                continue
            summed = [kind[v] in (SUM, LOCAL_SUM) for v in node.operands]
            if index in means:
                result = LOCAL
            elif (
                read_kinds & {LOCAL, LOCAL_SUM}
                and any(summed)
                and linear_in_sums(node.name, op, [SUM if s else None for s in summed])
            ):
                result = LOCAL_SUM  # e.g. a gradient's sum times a statistic of the microbatch
            elif LOCAL in read_kinds:
                found.statistics += [(index, v) for v in reads if kind[v] == STEP]
                result = LOCAL
            elif LOCAL_SUM in read_kinds:
                result = STEP  # not linear: runs once, on the sums (an optimizer)
            elif read_kinds <= {None}:
                result = None
            elif STEP in read_kinds:
                result = STEP
            else:
                result = SUM if linear_in_sums(node.name, op, [kind[v] for v in node.operands]) else STEP
            for v in node.results:
                kind[v] = result
            found.op_kinds.append(result)
        return found

    def _mark_per_microbatch(self, found: KindPass) -> None:
        """`self.per_microbatch`: the ops that run per microbatch, those that read or carry
        examples, the statistics and what is computed from them, and what they read."""
        starts = [i for i, k in enumerate(found.op_kinds) if k in (BATCH, LOCAL, LOCAL_SUM) or i in found.per_example]
        self.per_microbatch = ancestors_of(self.graph, starts, set())

    def _one_microbatch(self, found: KindPass) -> None:
        """B = 1 splits nothing: every statistic is the whole batch's, so the ops the
        per-microbatch part reads run there (as LOCAL), whatever they compute."""
        for i in self.per_microbatch:
            if found.op_kinds[i] == STEP:
                found.op_kinds[i] = LOCAL
                for v in self.graph.ops[i].results:
                    found.value_kind[v] = LOCAL

    # -- kinds inside loops and branches that read or carry the batch

    def _control_flow_kinds(
        self, op: ir.Operation, known: dict[ir.Value, str | None], found: KindPass
    ) -> list[str | None]:
        """The kind of each result of a loop or branch run per microbatch, from the ops inside
        (`known`: the kinds of the values defined so far, the values it reads included; it
        gets those of the values inside). Such an op may carry the batch and accumulate sums
        over it: a carry that starts at zeros (or a sum) and that the body writes sums into
        (`dynamic_update_slice`, the stacked gradients of a scanned layer stack) or adds sums
        to is a sum, whose microbatches' values add up to the whole batch's. Refused (to
        `found.refusals`): a sum used per example inside (a batch statistic), any op that is
        not linear in the sums it reads (an update inside the loop), a trip count or branch
        chosen from sums, and a carry that mixes a sum with a value independent of the batch."""
        if op.name == "stablehlo.while":
            cond, body = (region.blocks[0] for region in op.regions)
            state = [self._kind_in(v, known) for v in op.operands]
            state = [ZERO if k is None and is_zero(v) else k for k, v in zip(state, op.operands)]
            while True:
                for block in (cond, body):
                    for arg, k in zip(block.arguments, state):
                        known[arg] = k
                if self._block_kinds(cond, known, KindPass())[0] not in (None, ZERO, BATCH):
                    self._refuse(
                        found,
                        op,
                        f"'{op.name}' runs a number of iterations chosen from sums over the "
                        "batch: each microbatch would run its own",
                    )
                joined = [join_kinds(k, r) for k, r in zip(state, self._block_kinds(body, known, found))]
                if joined == state:
                    break
                state = joined
        else:  # stablehlo.case / stablehlo.if: the branch index (a scalar) must not depend on the batch
            if self._kind_in(op.operands[0], known) not in (None, ZERO):
                self._refuse(
                    found,
                    op,
                    f"'{op.name}' chooses its branch from a sum over the batch: each microbatch would choose its own",
                )
            branches = [self._block_kinds(region.blocks[0], known, found) for region in op.regions]
            state = [functools.reduce(join_kinds, kinds) for kinds in zip(*branches)]
        kinds = [BATCH if self.divided(r) is not None else k for r, k in zip(op.results, state)]
        for number, k in enumerate(kinds):
            if k == STEP:
                self._refuse(
                    found,
                    op,
                    f"result {number} of '{op.name}' is a sum over the batch in some "
                    "iterations or branches and a value independent of it in others (a sum "
                    "written into a buffer that does not start at zeros?): its microbatches' "
                    "values would not add up to the whole batch's",
                )
        return kinds

    def _block_kinds(self, block: ir.Block, known: dict[ir.Value, str | None], found: KindPass) -> list[str | None]:
        """Kinds of the values a region's block computes; those it returns."""
        for inner in block.operations:
            inner = inner.operation
            if inner.name == "stablehlo.return":
                return [self._kind_in(v, known) for v in inner.operands]
            for result, k in zip(inner.results, self._inner_kinds(inner, known, found)):
                known[result] = k
        raise AssertionError("a region without stablehlo.return")

    def _inner_kinds(self, op: ir.Operation, known: dict[ir.Value, str | None], found: KindPass) -> list[str | None]:
        """The kinds of an op's results inside a loop or branch that runs per microbatch."""
        if op.name in CONTROL_FLOW_OPS:
            return self._control_flow_kinds(op, known, found)
        reads = [self._kind_in(v, known) for v in op.operands]
        carries = [self.divided(r) is not None for r in op.results]
        if op.name in PASS_THROUGH_OPS:  # result k is operand k
            return [BATCH if c else k for c, k in zip(carries, reads)]
        if any(carries) or BATCH in reads:
            summed = [v for v, k in zip(op.operands, reads) if k in (SUM, STEP)]
            if summed:
                self._refuse(
                    found,
                    op,
                    f"'{op.name}' uses a sum over the batch ({value_origin(summed[0])}) per "
                    "example inside a loop or branch: a statistic of the batch used inside a "
                    "loop cannot be split into microbatches (with microbatches=1 the step runs "
                    "as written)",
                )
            return [BATCH if c else SUM for c in carries]  # a sum over the batch: checked by _check_op
        if all(k in (None, ZERO) for k in reads):  # independent of the batch; zeros may start a sum
            return [ZERO if is_zero(r) else None for r in op.results]
        if {LOCAL, LOCAL_SUM} & set(reads):
            self._refuse(
                found,
                op,
                f"'{op.name}' computes a value without examples from statistics of the "
                "microbatch inside a loop or branch: not supported",
            )
        elif STEP not in reads and linear_in_sums(op.name, op, reads):
            return [SUM] * len(op.results)
        elif STEP not in reads:
            self._refuse(
                found,
                op,
                f"'{op.name}' is not linear in the sums over the batch it reads, inside a loop "
                "or branch that runs once per microbatch: only sums can be accumulated over "
                "microbatches (a sum added to or written into a value that is not zero, or an "
                "update or a statistic computed inside the loop?)",
            )
        return [STEP] * len(op.results)

    def _kind_in(self, value: ir.Value, known: dict[ir.Value, str | None]) -> str | None:
        return BATCH if self.divided(value) is not None else known.get(value)

    @staticmethod
    def _refuse(found: KindPass, op: ir.Operation, message: str) -> None:
        if not any(r.op == op and str(r) == message for r in found.refusals):
            found.refusals.append(SplitError(op, message))

    def _check_loss(self, kind: dict[int, str | None]) -> int | None:
        """The loss result; with several microbatches it must be a sum over the batch (with
        one, the step runs as written: nothing is required of it)."""
        graph = self.graph
        loss = self.loss_result
        if loss is not None and not 0 <= loss < len(graph.results):
            raise SplitError(self.main, f"loss result {loss} out of range: @main has {len(graph.results)} results")
        if loss is None:
            loss = classify(graph).loss_result
        if self.b == 1:
            return loss
        if loss is None:
            raise SplitError(
                self.main,
                "no loss found: @main returns no floating-point scalar that it takes gradients of: "
                "microbatches split a training step (give loss-result=N)",
            )
        value = graph.results[loss]
        if kind[value] == LOCAL:
            raise SplitError(
                self.main,
                f"the loss ({FuncSignature.of(self.main).result(loss)}) is computed from a "
                "statistic of the batch other "
                "than through per-example values: with microbatches its microbatches' "
                "values would not add up to it",
            )
        if kind[value] is None:
            names = FuncSignature.of(self.main)
            raise SplitError(
                self.main,
                f"the loss ({names.result(loss)}) does not depend on the batch arguments "
                f"({', '.join(names.arg(i) for i in self.batch_args)}); name them with "
                "batch-args=...",
            )
        if kind[value] == STEP and not self._scaled_sum(value, kind, batch_only_values(graph, self.batch_args)):
            culprit = self._first_nonlinear(value, kind)
            raise SplitError(
                culprit,
                f"the loss (result {loss}) is not a sum or a mean over the batch: "
                f"'{culprit.name}' is not linear in the sums over the batch it reads; between "
                "the batch reductions and the loss only add, subtract, negate, and multiplying "
                "or dividing by values independent of the batch may appear",
            )
        return loss

    def _scaled_sum(self, value: int, kind: dict[int, str | None], batch_only: set[int]) -> bool:
        """Whether `value` (of kind STEP) is linear in the sums over the batch that depend on
        the parameters, values computed from the batch only taken as constants: a sum over
        the batch normalized by one (`sum(loss * weights) / sum(weights)`, `batch_scales`)."""
        node = self.graph.ops[self.graph.values[value].producer]
        kinds: list[str | None] = []
        for v in node.operands:
            if v in batch_only or kind[v] is None:
                kinds.append(None)
            elif kind[v] == SUM or (kind[v] == STEP and self._scaled_sum(v, kind, batch_only)):
                kinds.append(SUM)
            else:
                return False
        return linear_in_sums(node.name, node.mlir_op, kinds)

    def _first_nonlinear(self, value: int, kind: dict[int, str | None]) -> ir.Operation:
        """The STEP op on the way to `value` whose inputs are all sums or independent."""
        graph = self.graph
        while True:
            producer = graph.values[value].producer
            node = graph.ops[producer]
            step_inputs = [v for v in graph.reads(producer) if kind[v] == STEP]
            if not step_inputs:
                return node.mlir_op
            value = step_inputs[0]

    # -- rewriting
