"""`hlopar-split-microbatches`: a training step as the program for one of B microbatches.

Gradient accumulation (Alpa §6, GPipe): the batch is cut into B microbatches along its
leading dimension, forward and backward run on each, the gradients are summed, and the
optimizer runs once on the sums. This pass rewrites a training step (after `hlopar-import`:
one `@main`, plain StableHLO) into that form, and refuses, with an error located at the op,
whatever would make it compute something else than the step.

## How

Which values carry the batch is found by Shardy: on a clone, the batch arguments get a
sharding over a fresh mesh axis of size B (`sdy.mesh @hlopar_microbatch = <["mb"=B]>`) on
dim 0, the other arguments are closed replicated, and `sdy-aggressive-propagate` (between
`sdy-add-data-flow-edges` and `sdy-sink-data-flow-edges`, so that loop bodies follow)
spreads the axis to every value computed from the batch along the dimensions that follow it (through
reshapes, transposes, gathers with batching dims ...). Each op is then checked against its
Shardy sharding rule: the axis must sit on the same factors of all its operands and results
(the op then computes each microbatch's slice from the same slice of its inputs), except
on reduction factors, where the op makes a sum over the batch. The dims that carry the axis
are divided by B (`ir.Value.set_type`), and the attributes that spell out sizes follow
(`slice` limits, `dynamic_slice`/`gather` slice sizes, splat constants, `rng` shapes,
`while` block arguments).

Refused with B > 1 (the pass fails, located; each message says what would need the
split): a batch dim not divisible by B; an op that moves data along the batch (slicing or
padding part of it, concatenating, sorting, reversing along it, a non-splat constant of
batch shape); a reduction over the batch that is not a sum (max, a reduce of several
values, a reduce with a non-zero init, a scatter into a non-zero buffer); inside a loop or
branch, anything but accumulating sums over the batch (below); a parameter combined with the
batch along its batch dim;
a result that carries the batch spread over several dims (per-example results with the batch
in one dim are concatenated along it: `per_example_results`);
ops hlopar cannot resize (custom calls, dynamic-shape ops); a statistic of the whole batch
used per example that is not a mean (below); whole-shape random generators (`stablehlo.rng`,
`rng_bit_generator`) unless `rng=per-microbatch`, which resizes them with a warning.

`microbatches=1` splits nothing, so none of these checks run: the step runs as written
(per-example results, loops, statistics and generators included) and equals one device.

## Loops and branches (scanned layer stacks)

A loop that reads or carries the batch runs per microbatch, as a whole. The backward of a
layer stack under `scan` sums each layer's weight gradients over the batch inside the loop
and writes them into a stacked carry (`dynamic_update_slice` at the layer index) or adds
them to a carried accumulator. Such a carry, started at zeros (or at a sum) and given only
sums through ops linear in them, is a sum: its microbatches' values add up to the whole
batch's, so it is accumulated over microbatches like a top-level gradient
(`_control_flow_kinds`: the kinds of the values inside, to a fixed point over the
iterations). The loop's kind is `batch` where it also carries the batch (the activations'
cotangent); its sums leave through a reshape of kind `sum` (as statistics do), its results
independent of the batch that the ops run once read are read from its operands where the
loop returns them unchanged, else refused. Branches (`case`, `if`) likewise. Refused inside:
a sum over the batch used per example (a batch statistic inside the loop), an op not linear
in the sums it reads (an update inside the loop), a trip count or branch chosen from sums,
and a carry that starts from a value independent of the batch and gets sums. Splat constants
with a dim of the batch size get one copy per use first (`_unshare_splats`): `cse` merges
equal splats whatever their dims mean.

## Random numbers and other iotas along the batch

An iota along the batch dim counts the batch's rows; JAX's default threefry generator
(partitionable) builds its counters from such iotas. The split makes every iota along the
batch count globally: `@main` takes the microbatch index as one more (last) batch argument,
and the iota becomes iota + k * (its microbatch size), so each microbatch draws exactly the
whole batch's random bits for its rows (`microbatching.global_iota`; `runtime.step_arguments` adds the
index to the caller's arguments, `microbatching.functions_form` makes it itself).

## Batch statistics (GPipe)

A mean over the batch that is used per example (batch normalization in training mode,
forward and backward) is taken over each microbatch, as GPipe defines it: its count is
divided by B (`batch_statistics`), with a warning. Values computed from such statistics
run per microbatch (kind `batch` in the IR, "local" in the analysis). Where they leave the
microbatch (a result, or the ops run once read them), a value linear in the microbatch's
sums (a gradient through a statistic) is summed over microbatches; any other (BatchNorm's
running statistics, `momentum * ra + (1 - momentum) * mean`) is divided by B before the
sum: the result is the mean over microbatches of each microbatch's value. Both leave
through a reshape of kind `sum`, not elementwise, so that `training_roles` does not take
it (nor what it reads) for the optimizer's arithmetic, with or without JAX's name stacks.
The loss must not depend on a statistic other than through per-example values.

## The IR contract (read through `hlopar.dialect.split`)

`@main` becomes the step for ONE microbatch: same arguments and results, batch arguments
and every value carrying the batch with their dims divided by B, all else unchanged (the 1/N
of a loss's mean included; the counts of batch statistics divided by B). When an iota counts
the batch, one more argument, the microbatch index `tensor<1xi32>` (B rows in the whole
step: arange(B)), follows the step's own, named by `hlopar.microbatch_index_arg = N`; the
index is added too where a result carries the batch: such a result keeps the whole batch's
type, its microbatch's rows placed in zeros, a `sum` (`per_example_results`).
`@main` gets `hlopar.microbatches = B : i64` and `hlopar.batch_args = array<i64: ...>` (the
arguments cut along dim 0, in order, the index included), and every top-level op gets
`hlopar.microbatch`, the kind of its results:

| `hlopar.microbatch` | meaning | runs |
|---|---|---|
| `"batch"` | carries the microbatch's examples, or a statistic of them | once per microbatch |
| `"sum"` | a sum over the examples (linear in them) | per microbatch (then summed) or once on the sums |
| `"step"` | a function of sums (the optimizer) | once per step, on the sums |
| absent | independent of the batch (parameters, constants) | anywhere, same value |

Contract: take any set M of top-level ops that holds every `batch` op and the reductions
(the `sum` ops reading a `batch` value), is closed under operands, and holds no `step` op.
Run M on each of the B microbatches (argument `batch_args[k]` sliced along dim 0), sum
over microbatches the `sum` values M hands to the other ops or returns, then run the other
ops once on those sums (values of ops with no kind are the same for every microbatch):
this gives `@main`'s results on the whole batch, up to the order of float additions.
`dialect.split.split_step` makes the smallest such M, the form the local executor runs; a pipeline puts
its forward and backward fragments in M and its update fragments after the sums.

With `functions=true` the module is written in that split form instead:

    func.func public @main(<the original arguments>) -> <results>   // the whole step:
        slices each batch argument into B parts (stablehlo.slice), calls @microbatch_step on
        each, adds the results up in microbatch order, returns @apply_update's results
    func.func private @microbatch_step(<main_args>) -> (sums...)  {hlopar.main_args = ...}
    func.func private @apply_update(<main_args>, sums...) -> <main's results>  {hlopar.main_args = ...}

`hlopar.main_args` lists the `@main` argument numbers each function takes first, in order;
`@apply_update` then takes the sums, in the order `@microbatch_step` returns them.

## Pipelines

`hlopar-cluster-operators` and `hlopar-stage-construction` run on the one-microbatch
`@main` as on any step (give stage construction `microbatches=1`: the program already is one
microbatch). The kinds travel with the ops into the fragments, and `training_roles` puts
every `step` op in an update fragment and every `batch` op in a forward or backward one
(checked on the zoo's MLP, GPT and U-Transformer); `runtime.local_executor.PipelinedStep`
checks it again, runs forward and backward fragments per microbatch, sums what they hand
to the update fragments or return, and runs the update fragments once.

`microbatches=1` marks the kinds and resizes nothing (the propagation then uses an axis of
the smallest prime dividing the batch); ops that the per-microbatch part reads and that
would otherwise run once after it (statistics, whatever they compute) are marked `batch`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import sdy, stablehlo

from hlopar.analysis.auto_sharding.rules import PASS_THROUGH_OPS, OpRule, rule_of
from hlopar.analysis.limits import check_count
from hlopar.analysis.sharding import ShardingPerValue, TensorSharding
from hlopar.analysis.training_roles import ELEMENTWISE_OPS, RolesError, batch_arguments, classify
from hlopar.dialect.attributes import BATCH, BATCH_ARGS_ATTR, KIND_ATTR, MICROBATCHES_ATTR, STEP, SUM
from hlopar.dialect.split import read_index_arg
from hlopar.ir.diagnostics import DiagnosticError, source_location
from hlopar.ir.extract import value_of
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import find_main
from hlopar.ir.signature import FuncSignature
from hlopar.passes.base import ModulePass, PassContext, option, report_option
from hlopar.passes.microbatching.batch_statistics import mean_divisions, reduced_count, rescale_mean, splat_value
from hlopar.passes.microbatching.functions_form import write_functions
from hlopar.passes.microbatching.global_iota import count_globally
from hlopar.passes.microbatching.per_example_results import concatenated_dim, place_rows

__all__ = ["SplitError", "SplitMicrobatchesPass"]

MESH = "hlopar_microbatch"
AXIS = "mb"
# Per-microbatch values that carry no examples, written "batch" (they run per microbatch):
LOCAL = "local"  # a statistic of the microbatch (from its means over the batch): averaged when it leaves
LOCAL_SUM = "local-sum"  # linear in the microbatch's sums, statistics as coefficients: summed when it leaves
# Inside a loop: a carried value that is zero so far (zeros that sums are written or added into).
ZERO = "zero"
_SDY_SHARDING = "sdy.sharding"

# Ops that only need their result types changed when a dim is divided (besides elementwise ops).
_TYPE_ONLY_OPS = (
    ELEMENTWISE_OPS
    | frozenset(
        "stablehlo." + n
        for n in (
            "broadcast_in_dim reshape transpose dot_general dot convolution reduce select compare convert bitcast_convert "
            "concatenate gather scatter dynamic_update_slice while case if reverse sort map optimization_barrier "
            "rng_bit_generator batch_norm_inference cholesky triangular_solve fft reduce_precision return copy "
            "exponential_minus_one log_plus_one"
        ).split()
    )
    | {"stablehlo.return", "func.return"}
)
# Ops whose sum over a batch factor is a plain sum of the inputs' examples.
_SUM_OPS = frozenset(
    {"stablehlo.reduce", "stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution", "stablehlo.scatter"}
)
# Ops linear in a sum operand (with the other operands independent of the batch).
_STRUCTURAL_OPS = frozenset(
    "stablehlo." + n for n in ("reshape transpose broadcast_in_dim slice reverse copy negate").split()
)


class SplitError(Exception):
    """Why a step cannot be microbatched, at an op."""

    def __init__(self, op: ir.Operation | None, message: str):
        super().__init__(message)
        self.op = op


@dataclass
class SplitMicrobatchesPass(ModulePass):
    name = "hlopar-split-microbatches"
    summary = "rewrite a training step into the program for one of B microbatches (gradient accumulation)"

    microbatches: int = option(
        1,
        "number of microbatches B (divides every batch argument's leading dim)",
        check=lambda n: check_count(n, low=1),
    )
    batch_args: tuple[int, ...] | None = option(
        None, "arguments cut along dim 0, e.g. 19,20 (default: the arguments that are not training state)"
    )
    loss_result: int | None = option(None, "the result that is the loss (default: found)")
    rng: Literal["exact", "per-microbatch"] = option(
        "exact",
        "per-microbatch: let whole-shape random generators (stablehlo.rng, rng_bit_generator) draw per "
        "microbatch, other numbers than the whole batch's (default: refuse them)",
    )
    functions: bool = option(False, "write @microbatch_step, @apply_update and a @main calling them")
    report: str | None = report_option("write a JSON report of the split to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        main = find_main(module)
        if main is None:
            self.fail(module, "the module has no @main")
        if MICROBATCHES_ATTR in main.attributes:
            self.fail(main, "@main is already split into microbatches")
        try:
            with module.context, ir.Location.unknown():
                split = _Splitter(module, main, self, context).run()
                if self.functions:
                    write_functions(module)
        except SplitError as error:
            self.fail(error.op if error.op is not None else main, str(error))
        module.verify()
        if self.wants_report(context):
            self.emit_report(module, context, {"pass": self.name, "options": self.pipeline_text(), **split})


# --------------------------------------------------------------------------- analysis


@dataclass
class _KindPass:
    """What one walk over the top-level ops found."""

    op_kinds: list[str | None] = field(default_factory=list)
    value_kind: dict[int, str | None] = field(default_factory=dict)
    per_example: set[int] = field(default_factory=set)  # ops reading or carrying per-example values
    reductions: dict[int, int | None] = field(default_factory=dict)  # of those, sums over the batch: count
    statistics: list[tuple[int, int]] = field(default_factory=list)  # (op, value of the whole batch it uses)
    refusals: list[SplitError] = field(default_factory=list)  # inside loops and branches, in the order found


class _Splitter:
    def __init__(self, module, main, options: SplitMicrobatchesPass, context: PassContext):
        self.module, self.main, self.b, self.context = module, main, options.microbatches, context
        self.rng = options.rng
        self.graph = FuncGraph.from_func(main)
        self.batch_args = self._batch_args(options.batch_args)
        self.axis = self.b if self.b > 1 else self._analysis_axis()
        self.loss_result = options.loss_result
        self.ops = _walk(main)
        self.div: dict[ir.Value, tuple[int, ...]] = {}  # values whose dims are divided
        self.rules: list[OpRule | None] = []
        self.iotas: list[ir.Operation] = []  # iotas along the batch, to count globally
        self.per_example_results: dict[int, int] = {}  # results carrying the batch -> their batch dim

    def run(self) -> dict:
        self._propagate()
        if self.b > 1:  # one microbatch splits nothing: no op needs to be checked
            for op, rule in zip(self.ops, self.rules):
                self._check_op(op, rule)
        kinds, value_kind, error, means = self._kinds()
        loss = self._check_loss(value_kind)
        if error is not None:
            raise error
        resized = 0
        if self.b > 1:
            for i in means:
                node = self.graph.ops[i]
                rescale_mean(node.mlir_op, self.b, inverse=node.name == "stablehlo.multiply")
            if means:
                n = self.graph.values[self.graph.args[self.batch_args[0]]].shape[0]
                self.context.warn(
                    self.graph.ops[means[0]].mlir_op,
                    (
                        f"hlopar-split-microbatches: batch statistics are computed per microbatch of {n // self.b} "
                        f"examples (GPipe), not over the batch of {n}; running statistics are the mean over "
                        "microbatches"
                    ),
                )
            resized = self._resize()
        for op, kind in zip(self.graph.ops, kinds):
            if kind is not None:
                op.mlir_op.attributes[KIND_ATTR] = ir.StringAttr.get(BATCH if kind in (LOCAL, LOCAL_SUM) else kind)
        if self.b > 1:
            self._hand_off(kinds)
            self._hand_off_control_flow(kinds, value_kind)
            batch_kind = {KIND_ATTR: ir.StringAttr.get(BATCH)}
            for iota in self.iotas:
                count_globally(self.main, iota, batch_kind)
            place_rows(self.main, self.per_example_results, batch_kind, {KIND_ATTR: ir.StringAttr.get(SUM)})
        batch_args = list(self.batch_args)
        if read_index_arg(self.main) is not None:
            batch_args.append(read_index_arg(self.main))
        self.main.attributes[MICROBATCHES_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), self.b)
        self.main.attributes[BATCH_ARGS_ATTR] = ir.DenseI64ArrayAttr.get(batch_args)
        counts = {k: sum(1 for x in kinds if x == k) for k in (BATCH, SUM, STEP)}
        counts[BATCH] += sum(1 for x in kinds if x in (LOCAL, LOCAL_SUM))
        counts["independent"] = sum(1 for x in kinds if x is None)
        return {
            "microbatches": self.b,
            "batch_args": batch_args,
            "loss_result": loss,
            "resized_values": resized,
            "ops": counts,
            "means_per_microbatch": len(means),
            "iotas_counting_globally": len(self.iotas),
            "per_example_results": len(self.per_example_results),
        }

    def _hand_off(self, kinds: list[str | None]) -> None:
        """Per-microbatch values without examples that the ops run once read or `@main`
        returns leave the microbatch through an op of kind `sum`: a statistic divided by B, so
        that the sum over microbatches is its mean; a value linear in the microbatch's sums
        (a gradient through a statistic) as it is, summed."""
        per_microbatch = {self.graph.ops[i].mlir_op for i in self.per_microbatch}
        for node, kind in zip(self.graph.ops, kinds):
            if kind not in (LOCAL, LOCAL_SUM):
                continue
            for value in node.mlir_op.results:
                outside = [use for use in value.uses if _top_op(use.owner, self.main) not in per_microbatch]
                if not outside:
                    continue
                tensor = ir.RankedTensorType(value.type)
                with ir.InsertionPoint.after(node.mlir_op), node.mlir_op.location:
                    if kind == LOCAL and not isinstance(tensor.element_type, ir.FloatType):
                        raise SplitError(
                            node.mlir_op,
                            f"'{node.name}' computes a {tensor} from statistics of "
                            "each microbatch for the update or a result: microbatches "
                            "cannot average integers",
                        )
                    if kind == LOCAL:
                        share = stablehlo.ConstantOp(
                            ir.DenseElementsAttr.get_splat(tensor, ir.FloatAttr.get(tensor.element_type, 1.0 / self.b))
                        )
                        value = stablehlo.MulOp(value, share.result)
                        value.operation.attributes[KIND_ATTR] = ir.StringAttr.get(BATCH)
                        value = value.result
                    # The sum leaves through a reshape to its own type: not elementwise, so that
                    # stage construction keeps it with the per-microbatch fragments.
                    handed = stablehlo.ReshapeOp(tensor, value)
                handed.operation.attributes[KIND_ATTR] = ir.StringAttr.get(SUM)
                for use in outside:
                    use.owner.operands[use.operand_number] = handed.result

    def _hand_off_control_flow(self, kinds: list[str | None], value_kind: dict[int, str | None]) -> None:
        """A loop or branch run per microbatch has one kind (`batch` where it carries the
        batch) but results of several. Its sums (a scanned stack's stacked gradients) that the
        ops run once read or `@main` returns leave through a reshape of kind `sum`, as
        statistics do (`_hand_off`). Its results independent of the batch would be summed
        too: where the loop returns a carry unchanged they are read from its operand instead,
        else refused."""
        per_microbatch = {self.graph.ops[i].mlir_op for i in self.per_microbatch}
        for node, kind in zip(self.graph.ops, kinds):
            op = node.mlir_op
            if kind is None or not op.regions or node.name in _SUM_OPS:
                continue
            last = op
            for number, (vid, value) in enumerate(zip(node.results, op.results)):
                outside = [use for use in value.uses if _top_op(use.owner, self.main) not in per_microbatch]
                if not outside or value_kind[vid] == kind:
                    continue
                if value_kind[vid] == SUM:
                    with ir.InsertionPoint.after(last), op.location:
                        handed = stablehlo.ReshapeOp(value.type, value)
                    handed.operation.attributes[KIND_ATTR] = ir.StringAttr.get(SUM)
                    replacement, last = handed.result, handed.operation
                elif value_kind[vid] is None and _invariant(op, number):
                    replacement = op.operands[number]
                else:
                    raise SplitError(
                        op,
                        f"result {number} of '{op.name}' does not depend on the batch but is "
                        "computed by a loop or branch that runs per microbatch, and is read after "
                        "the sums over microbatches: hlopar cannot tell it from a sum",
                    )
                for use in outside:
                    use.owner.operands[use.operand_number] = replacement

    def _batch_args(self, given: Sequence[int] | None) -> tuple[int, ...]:
        graph = self.graph
        shapes = [graph.values[a].shape for a in graph.args]
        if given is None:
            try:
                given = batch_arguments(graph)
            except RolesError as error:
                raise SplitError(self.main, str(error)) from None
            if not given:
                raise SplitError(
                    self.main,
                    "no argument looks like a batch (every argument is training state, "
                    "a random key or a scalar); name them with batch-args=...",
                )
        names = FuncSignature.of(self.main)
        for i in given:
            if not 0 <= i < len(graph.args):
                raise SplitError(self.main, f"batch argument {i} does not exist: @main has {len(graph.args)} arguments")
            if not shapes[i] or shapes[i][0] is None:
                raise SplitError(
                    self.main, f"batch {names.arg(i)} ({graph.values[graph.args[i]].type}) has no static leading dim"
                )
            if shapes[i][0] % self.b:
                raise SplitError(
                    self.main,
                    f"batch {names.arg(i)} has leading dim {shapes[i][0]}, not divisible by {self.b} microbatches",
                )
        return tuple(sorted(set(given)))

    def _analysis_axis(self) -> int:
        """For B = 1 (mark, resize nothing): an axis size that divides the batch, to find
        which values carry it."""
        size = math.gcd(*(self.graph.values[self.graph.args[i]].shape[0] for i in self.batch_args))
        for p in range(2, size + 1):
            if size % p == 0:
                return p
        raise SplitError(self.main, "a batch of one example: nothing tells which values carry the batch")

    # -- Shardy propagation on a clone

    def _propagate(self) -> None:
        size = math.gcd(*(self.graph.values[self.graph.args[i]].shape[0] for i in self.batch_args))
        if _unshare_splats(self.main, size):
            self.graph, self.ops = FuncGraph.from_func(self.main), _walk(self.main)
        clone_module = self.module.clone()
        clone = find_main(clone_module)
        body = clone_module.regions[0].blocks[0]
        with ir.InsertionPoint(body.operations[0]):
            sdy.MeshOp(MESH, ir.Attribute.parse(f'#sdy.mesh<["{AXIS}"={self.axis}]>'))
        clone_ops = _walk(clone)
        for op in clone_ops:  # the input's own shardings are not about microbatches
            if op.name == "sdy.manual_computation":
                raise SplitError(self.ops[clone_ops.index(op)], "manual computations cannot be microbatched")
            if _SDY_SHARDING in op.attributes:
                del op.attributes[_SDY_SHARDING]
            if op.name == "sdy.sharding_constraint":
                rank = len(ir.RankedTensorType(op.results[0].type).shape)
                op.attributes["sharding"] = _sharding(rank, None, closed=False)
        arg_types = [a.type for a in clone.regions[0].blocks[0].arguments]
        attrs = []
        for i, t in enumerate(arg_types):
            rank = len(ir.RankedTensorType(t).shape) if isinstance(t, ir.RankedTensorType) else None
            entry = {}
            if rank is not None:
                entry[_SDY_SHARDING] = _sharding(
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
        clone_ops = _walk(clone)
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
            elif _SDY_SHARDING in twin.attributes:
                per_value = ShardingPerValue.parse(str(twin.attributes[_SDY_SHARDING])).shardings
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
        operands = [self.divided(v) for v in op.operands]
        results = [self.divided(v) for v in op.results]
        if not any(operands) and not any(results):
            return
        name = op.name
        if name in ("stablehlo.return", "func.return", "sdy.return"):
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
            if parent.name in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
                expected = [self.divided(v) for v in parent.results]
                if operands != expected:
                    raise SplitError(op, f"a value carried by '{parent.name}' changes its batch dims inside it")
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
        if rule is None or rule.is_custom:
            raise SplitError(
                op, f"'{name}' has no sharding rule: hlopar cannot tell whether it mixes the examples of the batch"
            )
        factors: dict[int, set[int]] = {}
        tensors = [(d, m, "operand", k) for k, (d, m) in enumerate(zip(operands, rule.operands))]
        tensors += [(d, m, "result", k) for k, (d, m) in enumerate(zip(results, rule.results))]
        for div, mapping, what, number in tensors:
            for dim, dim_factors in enumerate(mapping):
                shares = _allocate(div[dim] if div else 1, [rule.factor_sizes[f] for f in dim_factors])
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
        if name not in _SUM_OPS:
            return "is not a sum"
        if name == "stablehlo.reduce":
            if len(op.results) != 1:
                return "reduces several values together"
            if not _adds(op):
                return "its body is not an addition"
            if not _is_zero(op.operands[1]):
                return "its initial value is not zero"
        if name == "stablehlo.scatter":
            if len(op.results) != 1 or not _adds(op):
                return "it does not add its updates"
            if not _is_zero(op.operands[0]):
                return "it adds into a buffer that is not zero"
        if name == "stablehlo.convolution" and _int_attr(op, "batch_group_count") != 1:
            return "it groups the batch"
        return None

    # -- kinds of top-level values

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
            before_loss = _ancestors(
                self.graph, self.graph.values[self.graph.results[loss]].producer, first.per_example
            )
            means = [i for i in means if i not in before_loss]
        found = self._kind_pass(frozenset(means))
        if found.refusals:
            raise found.refusals[0]
        self._mark_per_microbatch(found)
        error = None
        if self.b == 1:
            self._one_microbatch(found)
        elif found.statistics:
            index, statistic = found.statistics[0]
            node = self.graph.ops[index]
            source = self.graph.values[statistic].producer
            where = _where(self.graph.ops[source].mlir_op) if source is not None else "an argument"
            error = SplitError(
                node.mlir_op,
                f"'{node.name}' uses a value computed from the whole batch (at {where}) "
                "per example: a batch statistic that is not a mean over the batch (means "
                "are taken per microbatch, as GPipe does), or the backward of a loss that "
                "is not a sum or mean over the batch, cannot be split into microbatches "
                "(with microbatches=1 the step runs as written)",
            )
        return found.op_kinds, found.value_kind, error, means

    def _kind_pass(self, means: frozenset[int]) -> _KindPass:
        """Kinds in program order; `means` (op indices) are per-microbatch statistics."""
        graph = self.graph
        found = _KindPass()
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
                if op.regions and node.name not in _SUM_OPS:
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
                and _linear(node.name, op, [SUM if s else None for s in summed])
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
                result = SUM if _linear(node.name, op, [kind[v] for v in node.operands]) else STEP
            for v in node.results:
                kind[v] = result
            found.op_kinds.append(result)
        return found

    def _mark_per_microbatch(self, found: _KindPass) -> None:
        """`self.per_microbatch`: the ops that run per microbatch, those that read or carry
        examples, the statistics and what is computed from them, and what they read."""
        starts = [i for i, k in enumerate(found.op_kinds) if k in (BATCH, LOCAL, LOCAL_SUM) or i in found.per_example]
        self.per_microbatch = _ancestors_of(self.graph, starts, set())

    def _one_microbatch(self, found: _KindPass) -> None:
        """B = 1 splits nothing: every statistic is the whole batch's, so the ops the
        per-microbatch part reads run there (as LOCAL), whatever they compute."""
        for i in self.per_microbatch:
            if found.op_kinds[i] == STEP:
                found.op_kinds[i] = LOCAL
                for v in self.graph.ops[i].results:
                    found.value_kind[v] = LOCAL

    # -- kinds inside loops and branches that read or carry the batch

    def _control_flow_kinds(
        self, op: ir.Operation, known: dict[ir.Value, str | None], found: _KindPass
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
            state = [ZERO if k is None and _is_zero(v) else k for k, v in zip(state, op.operands)]
            while True:
                for block in (cond, body):
                    for arg, k in zip(block.arguments, state):
                        known[arg] = k
                if self._block_kinds(cond, known, _KindPass())[0] not in (None, ZERO, BATCH):
                    self._refuse(
                        found,
                        op,
                        f"'{op.name}' runs a number of iterations chosen from sums over the "
                        "batch: each microbatch would run its own",
                    )
                joined = [_join(k, r) for k, r in zip(state, self._block_kinds(body, known, found))]
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
            state = [functools.reduce(_join, kinds) for kinds in zip(*branches)]
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

    def _block_kinds(self, block: ir.Block, known: dict[ir.Value, str | None], found: _KindPass) -> list[str | None]:
        """Kinds of the values a region's block computes; those it returns."""
        for inner in block.operations:
            inner = inner.operation
            if inner.name == "stablehlo.return":
                return [self._kind_in(v, known) for v in inner.operands]
            for result, k in zip(inner.results, self._inner_kinds(inner, known, found)):
                known[result] = k
        raise AssertionError("a region without stablehlo.return")

    def _inner_kinds(self, op: ir.Operation, known: dict[ir.Value, str | None], found: _KindPass) -> list[str | None]:
        """The kinds of an op's results inside a loop or branch that runs per microbatch."""
        if op.name in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
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
                    f"'{op.name}' uses a sum over the batch ({_origin(summed[0])}) per "
                    "example inside a loop or branch: a statistic of the batch used inside a "
                    "loop cannot be split into microbatches (with microbatches=1 the step runs "
                    "as written)",
                )
            return [BATCH if c else SUM for c in carries]  # a sum over the batch: checked by _check_op
        if all(k in (None, ZERO) for k in reads):  # independent of the batch; zeros may start a sum
            return [ZERO if _is_zero(r) else None for r in op.results]
        if {LOCAL, LOCAL_SUM} & set(reads):
            self._refuse(
                found,
                op,
                f"'{op.name}' computes a value without examples from statistics of the "
                "microbatch inside a loop or branch: not supported",
            )
        elif STEP not in reads and _linear(op.name, op, reads):
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
    def _refuse(found: _KindPass, op: ir.Operation, message: str) -> None:
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
            raise SplitError(self.main, "no loss found: @main does not look like a training step (give loss-result=N)")
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
        if kind[value] == STEP:
            culprit = self._first_nonlinear(value, kind)
            raise SplitError(
                culprit,
                f"the loss (result {loss}) is not a sum or a mean over the batch: "
                f"'{culprit.name}' is not linear in the sums over the batch it reads; between "
                "the batch reductions and the loss only add, subtract, negate, and multiplying "
                "or dividing by values independent of the batch may appear",
            )
        return loss

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
            new_type = _divided_type(op.results[0].type, results[0])
            op.attributes["value"] = ir.DenseElementsAttr.get_splat(new_type, attr.get_splat_value())
        elif name == "stablehlo.iota":
            if results[0][_int_attr(op, "iota_dimension")] > 1:
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
        elif name in ("stablehlo.reduce_window", "stablehlo.select_and_scatter"):
            self._check_window(op, operands[0])
        elif name == "stablehlo.rng":
            self._fix_rng_shape(op, results[0])
        elif name not in _TYPE_ONLY_OPS and name not in ("sdy.sharding_constraint", "sdy.reshard"):
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

    def _check_window(self, op, div) -> None:
        rank = len(div)
        for key, neutral in (("window_dimensions", 1), ("window_strides", 1), ("base_dilations", 1)):
            if key in op.attributes:
                values = list(ir.DenseI64ArrayAttr(op.attributes[key]))
                if any(values[d] != neutral for d in range(rank) if div[d] > 1):
                    raise SplitError(op, f"'{op.name}' has a window along the batch dim")
        if "padding" in op.attributes:
            padding = ir.DenseIntElementsAttr(op.attributes["padding"])
            flat = [int(x) for x in padding]
            if any(flat[2 * d] or flat[2 * d + 1] for d in range(rank) if div[d] > 1):
                raise SplitError(op, f"'{op.name}' pads the batch dim")

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


# --------------------------------------------------------------------------- helpers


def _ancestors(graph: FuncGraph, op: int | None, stop: set[int]) -> set[int]:
    """`op` and the top-level ops it is computed from, not looking past the ops in `stop`."""
    return _ancestors_of(graph, [op] if op is not None else [], stop)


def _ancestors_of(graph: FuncGraph, ops: Sequence[int], stop: set[int]) -> set[int]:
    """`ops` and the top-level ops they are computed from, not looking past the ops in `stop`."""
    found: set[int] = set()
    stack = list(ops)
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        if i not in stop:
            stack.extend(graph.predecessors(i))
    return found


def _top_op(op: ir.Operation, func: ir.Operation) -> ir.Operation:
    """The op of `func`'s body that `op` is or sits in."""
    while op.parent != func:
        op = op.parent
    return op


def _walk(func: ir.Operation) -> list[ir.Operation]:
    """Every op inside `func`, pre-order (the same order in a clone)."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    found.append(inner.operation)
                    visit(inner.operation)

    visit(func)
    return found


def _sharding(rank: int, batch_dim: int | None, *, closed: bool) -> ir.Attribute:
    dims = []
    for d in range(rank):
        if d == batch_dim:
            dims.append(f'{{"{AXIS}"}}')
        else:
            dims.append("{}" if closed else "{?}")
    return ir.Attribute.parse(f"#sdy.sharding<@{MESH}, [{', '.join(dims)}]>")


def _allocate(division: int, sizes: list[int]) -> list[int] | None:
    """How a dim's division spreads over its factors, major first (None: it cannot)."""
    shares, left = [], division
    for size in sizes:
        if left == 1:
            shares.append(1)
        elif size % left == 0:
            shares.append(left)
            left = 1
        elif left % size == 0:
            shares.append(size)
            left //= size
        else:
            return None
    return shares if left == 1 else None


def _adds(op: ir.Operation) -> bool:
    """Whether the op's body returns the sum of its two block arguments."""
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    if len(ops) != 2 or ops[0].name != "stablehlo.add" or len(block.arguments) != 2:
        return False
    return set(ops[0].operands) == set(block.arguments) and ops[1].operands[0] == ops[0].results[0]


def _is_zero(value: ir.Value) -> bool:
    """A splat zero constant, possibly broadcast, reshaped or converted."""
    return splat_value(value) == 0.0


def _int_attr(op: ir.Operation, name: str) -> int:
    return ir.IntegerAttr(op.attributes[name]).value if name in op.attributes else 1


def _divided_type(type_: ir.Type, div: tuple[int, ...]) -> ir.RankedTensorType:
    tensor = ir.RankedTensorType(type_)
    return ir.RankedTensorType.get([s // d for s, d in zip(tensor.shape, div)], tensor.element_type, tensor.encoding)


def _linear(name: str, op: ir.Operation, kinds: list[str | None]) -> bool:
    """Whether an op is linear in its sum operands (`kinds`: SUM, None or ZERO per operand;
    none STEP)."""
    sums = [k == SUM for k in kinds]
    zeros = [k == ZERO or _is_zero(v) for k, v in zip(kinds, op.operands)]
    if name in _STRUCTURAL_OPS or name == "stablehlo.convert":
        return sums[0] and all(sums)
    if name in ("stablehlo.add", "stablehlo.subtract", "stablehlo.concatenate"):
        return all(s or z for s, z in zip(sums, zeros))
    if name in ("stablehlo.multiply", "stablehlo.dot_general", "stablehlo.dot"):
        return sum(sums) == 1
    if name == "stablehlo.divide":
        return sums == [True, False]
    if name == "stablehlo.pad":
        return sums[0] and zeros[1]
    if name == "stablehlo.select":
        return not sums[0] and all(s or z for s, z in zip(sums[1:], zeros[1:]))
    if name == "stablehlo.reduce":
        n = len(op.results)
        return n == 1 and sums[0] and _adds(op) and zeros[1]
    if name == "stablehlo.dynamic_update_slice":  # a sum written into a sum (or zeros) at given indices
        return all(s or z for s, z in zip(sums[:2], zeros[:2])) and not any(sums[2:])
    if name in ("stablehlo.dynamic_slice", "stablehlo.gather"):
        return sums[0] and not any(sums[1:])
    return False


def _where(op: ir.Operation) -> str:
    location = source_location(op.location)
    return f"'{op.name}' ({location})" if location is not None else f"'{op.name}'"


def _unshare_splats(func: ir.Operation, size: int) -> bool:
    """Gives each use of a splat constant with a dim of the batch's `size` (a constant, or a
    broadcast of one) its own copy; whether there was any to copy. `cse` merges equal splats
    whatever they mean: with a batch of 8 and a sequence of 8, one `broadcast 0 : 8x8` may
    serve the tokens (batch x sequence) and a causal mask (sequence x sequence), and the
    batch cannot be split along the one and not the other."""
    copied = False
    for op in reversed(_walk(func)):
        if len(op.results) != 1 or not isinstance(op.results[0].type, ir.RankedTensorType):
            continue
        if size not in ir.RankedTensorType(op.results[0].type).shape or splat_value(op.results[0]) is None:
            continue
        for use in list(op.results[0].uses)[1:]:
            copy = op.clone(ip=ir.InsertionPoint.after(op))
            use.owner.operands[use.operand_number] = copy.results[0]
            copied = True
    return copied


def _invariant(op: ir.Operation, number: int) -> bool:
    """Whether a loop returns its carry `number` unchanged (its result is its operand)."""
    if op.name != "stablehlo.while":
        return False
    body = op.regions[1].blocks[0]
    return list(body.operations)[-1].operands[number] == body.arguments[number]


def _origin(value: ir.Value) -> str:
    """Where a value is made, for messages."""
    if isinstance(value, ir.OpResult):
        return f"at {_where(value.owner)}"
    return "a value the loop carries" if value.owner.owner.name == "stablehlo.while" else "an argument"


def _join(a: str | None, b: str | None) -> str | None:
    """The kind of a value that is `a` or `b` (a loop's carry over iterations, a branch's
    result): zeros join anything; a sum and a value independent of the batch join to STEP
    (their microbatches' values would not add up)."""
    if a == b or b == ZERO:
        return a
    if a == ZERO:
        return b
    return BATCH if BATCH in (a, b) else STEP
