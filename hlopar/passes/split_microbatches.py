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

Ops with a region are loops or branches only where they are (`while`, `case`, `if`); a
windowed reduction (pooling, a cumulative sum: `reduce_window`; max pooling's gradient:
`select_and_scatter`) is checked by its rule like any op, its window along the batch dims
first (`_check_window`: size, stride, dilation and padding 1, 1, 1, 0 there). Gathers and
scatters that index the batch dim by the example's own position (`x[jnp.arange(B), i]`) are
rewritten as batched ones before the propagation (`microbatching.batch_positions`).

Refused with B > 1 (the pass fails, located; each message says what would need the
split): a batch dim not divisible by B; an op that moves data along the batch (slicing or
padding part of it, concatenating, sorting, reversing along it, a non-splat constant of
batch shape, a window along it); a reduction over the batch that is not a sum (max, a reduce of several
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
with a dim of the batch size get one copy per use first (`unshare_splats`): `cse` merges
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

## Normalizers of the batch only

A float scalar computed from the batch arguments alone (no parameter, no state) and read per
example, as the backward of `sum(loss * weights) / sum(weights)` reads `1 / sum(weights)`, is
factored out of the microbatches where what is computed from it per example is linear in it
(`microbatching.batch_scales`): the microbatches read 1 in its place, and each sum over the
batch made from it is multiplied by it after the sums. The loss, the quotient of the two sums,
is then accepted as a sum over the batch normalized by a value of the batch only. Any other
statistic used per example is refused as above, saying why it is not such a normalizer.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from hlopar.analysis.auto_sharding.rules import OpRule
from hlopar.analysis.limits import check_count
from hlopar.analysis.step_io import RolesError, batch_arguments
from hlopar.dialect.attributes import BATCH, BATCH_ARGS_ATTR, KIND_ATTR, MICROBATCHES_ATTR, STEP, SUM
from hlopar.dialect.split import read_index_arg
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import find_main
from hlopar.ir.signature import FuncSignature
from hlopar.passes.base import ModulePass, PassContext, option, report_option
from hlopar.passes.microbatching.batch_checks import BatchChecks
from hlopar.passes.microbatching.batch_statistics import rescale_mean
from hlopar.passes.microbatching.common import (
    CONTROL_FLOW_OPS,
    LOCAL,
    LOCAL_SUM,
    SplitError,
    invariant,
    top_op,
    walk_ops,
)
from hlopar.passes.microbatching.functions_form import write_functions
from hlopar.passes.microbatching.global_iota import count_globally
from hlopar.passes.microbatching.kinds import KindAnalysis
from hlopar.passes.microbatching.per_example_results import place_rows
from hlopar.passes.microbatching.resize import Resizer
from hlopar.passes.plan_options import RNG_MODES

__all__ = ["SplitError", "SplitMicrobatchesPass"]


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
    rng: Literal[RNG_MODES] = option(
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


class _Splitter(BatchChecks, KindAnalysis, Resizer):
    """The split of one `@main`: checks, kinds, resizing (mixins, one job each), then the
    hand-off of values between the per-microbatch part and the rest."""

    def __init__(self, module, main, options: SplitMicrobatchesPass, context: PassContext):
        self.module, self.main, self.b, self.context = module, main, options.microbatches, context
        self.rng = options.rng
        self.graph = FuncGraph.from_func(main)
        self.batch_args = self._batch_args(options.batch_args)
        self.axis = self.b if self.b > 1 else self._analysis_axis() if self.batch_args else None
        self.loss_result = options.loss_result
        self.ops = walk_ops(main)
        self.div: dict[ir.Value, tuple[int, ...]] = {}  # values whose dims are divided
        self.rules: list[OpRule | None] = []
        self.iotas: list[ir.Operation] = []  # iotas along the batch, to count globally
        self.per_example_results: dict[int, int] = {}  # results carrying the batch -> their batch dim
        self.scales = 0  # normalizers of the whole batch factored out of the microbatches
        self.scale_refusal = "none is"  # why the statistics used per example are not such normalizers

    def run(self) -> dict:
        if not self.batch_args:
            return self._unsplit()
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
            "scales_factored": self.scales,
        }

    def _unsplit(self) -> dict:
        """One microbatch of a program that reads no batch (every argument state, as a
        non-training program's may look): marked as one microbatch with no batch arguments,
        every op run once."""
        self.main.attributes[MICROBATCHES_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 1)
        self.main.attributes[BATCH_ARGS_ATTR] = ir.DenseI64ArrayAttr.get([])
        return {"microbatches": 1, "batch_args": [], "loss_result": None, "ops": {"independent": len(self.graph.ops)}}

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
                outside = [use for use in value.uses if top_op(use.owner, self.main) not in per_microbatch]
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
            if kind is None or node.name not in CONTROL_FLOW_OPS:
                continue
            last = op
            for number, (vid, value) in enumerate(zip(node.results, op.results)):
                outside = [use for use in value.uses if top_op(use.owner, self.main) not in per_microbatch]
                if not outside or value_kind[vid] == kind:
                    continue
                if value_kind[vid] == SUM:
                    with ir.InsertionPoint.after(last), op.location:
                        handed = stablehlo.ReshapeOp(value.type, value)
                    handed.operation.attributes[KIND_ATTR] = ir.StringAttr.get(SUM)
                    replacement, last = handed.result, handed.operation
                elif value_kind[vid] is None and invariant(op, number):
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
            if not given and self.b == 1:
                return ()  # one microbatch of a program without a batch: nothing to split or mark
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
