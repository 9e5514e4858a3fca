"""hlopar-reroll-stage-loops: a stage runs its range of a scanned layer stack as a loop again.

Planning wants a scanned stack unrolled (`hlopar-unstack-layer-scans`: each layer's ops are
ops of their own, so clustering and stage construction can cut between layers). Running it
unrolled costs compile time and executable size in proportion to the layers a stage holds.
So after the MPMD program is written, this pass looks inside each fragment for the copies
of one loop's body that the unstack pass tagged (`hlopar.layer_iteration`, docs/ir.md) and
turns each run of at least `min-trips` consecutive, identical iterations back into one
`stablehlo.while` over that range ("unroll to plan, re-roll to run"):

- identical: the same ops in the same order, with the same attributes (shardings included),
  types and regions; the iterations of a run differ only in what they read;
- what an iteration reads is, across the run, either made by the same op of the same
  iteration (the loop body's own wiring), or by an op of the previous iteration (a carry,
  its first value read from before the run), or the same value for every iteration (an
  invariant, carried unchanged), or a value of its own per iteration made outside the run
  (a layer's parameter piece, a residual the forward stashed): those are packed into one
  stack in iteration order, sliced by the loop's counter;
- what an iteration makes that is read outside the run (its residuals, its gradients, the
  carry that leaves the stage) is written into a stacked buffer by `dynamic_update_slice`
  and read back, per iteration, by a slice after the loop.

Anything else (an iteration reading a value two iterations back, a region capturing a value
from outside, an op outside the run that both reads the run and is read by it) keeps the
run unrolled, and the report says why. The update fragments (the optimizer, elementwise per
piece) stay unrolled.

With `hold-ranges` (the default), the stage also holds the layers it loops over as one range
(`hold_ranges`, before the rolling): the pieces a..b-1 of each stacked argument and result of
`@main` (`hlopar.layer_pieces`) become one value of rows a:b, which fragments read by slices,
so a loop's per-iteration inputs are the rows of one value and it reads them by its counter
instead of packing copies (`rows_of_one`); after the rolling, a fragment returns a loop's
stacked stash or gradients as one value (`return_stacks`). Without it the fragments'
arguments and results are unchanged and the loops pack their pieces each run.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Literal

from jaxlib.mlir import ir

from hlopar.analysis.limits import check_count
from hlopar.analysis.stage_loops import HeldRange, LoopRange, disjoint_ranges
from hlopar.dialect.mpmd import fragment_mesh, fragment_role
from hlopar.passes.base import ModulePass, PassContext, option, report_option
from hlopar.passes.stage_loops.held_ranges import hold_ranges, return_stacks
from hlopar.passes.stage_loops.rolling import reroll_block
from hlopar.passes.stage_loops.widening import widen_joins

__all__ = [
    "RerollStageLoopsPass",
    "fragments",
    "stage_loop_lines",
]


@dataclass
class RerollStageLoopsPass(ModulePass):
    name = "hlopar-reroll-stage-loops"
    summary = (
        "inside each fragment, run the iterations of an unrolled layer scan that the fragment holds as one "
        "stablehlo.while over their range again"
    )

    reroll: Literal["auto", "never"] = option(
        "auto", "auto: re-roll each run of at least min-trips identical iterations; never: keep every stage unrolled"
    )
    min_trips: int = option(
        2,
        "re-roll runs of at least this many iterations (one iteration is cheaper unrolled)",
        check=lambda n: check_count(n, low=1),
    )
    report: str | None = report_option("write a JSON report of the rolled and unrolled ranges to this path")

    hold_ranges: bool = option(
        True,
        "hold the pieces of the layers a stage loops over as one range of rows: one @main argument and "
        "result per stacked parameter or state, one value for the stash and the gradients between its "
        "fragments, read by the loop's counter (false: the loop packs the pieces each run)",
    )

    def run(self, module: ir.Operation, context: PassContext) -> None:
        ranges: list[LoopRange] = []
        held: list[HeldRange] = []
        with module.context, ir.Location.unknown():
            if self.reroll == "auto" and self.hold_ranges and fragments(module):
                spans = self._spans(module)
                held = hold_ranges(fragments(module)[0].parent, spans)
            for number in range(len(fragments(module))):
                fragment = fragments(module)[number]  # the list changes as fragments are rebuilt
                if fragment_role(fragment) == "update":  # the optimizer: elementwise per piece, not a loop body
                    continue
                block = fragment.regions[0].blocks[0]
                made = reroll_block(block, _origin(fragment), min_trips=self.min_trips, rewrite=self.reroll == "auto")
                for r in made:
                    if not r.rolled and r.trips >= self.min_trips and self.reroll == "auto":
                        context.warn(
                            fragment,
                            f"{self.name}: layers {r.layers[0]}..{r.layers[-1]} of loop {r.loop} "
                            f"stay unrolled in {r.fragment}: {r.reason}",
                        )
                ranges += made
                if any(r.rolled for r in made):
                    if self.hold_ranges:
                        fragment = return_stacks(fragment)
                    _erase_unread(fragment.regions[0].blocks[0])
            if held:
                for fragment in fragments(module):
                    if fragment_role(fragment) == "update":
                        widen_joins(fragment)
        if self.wants_report(context):
            self.emit_report(
                module,
                context,
                {
                    "pass": self.name,
                    "reroll": self.reroll,
                    "ranges": [asdict(r) for r in ranges],
                    "held": [asdict(h) for h in held],
                },
                end="",
            )

    def _spans(self, module: ir.Operation) -> dict[str, list[tuple[int, int]]]:
        """Per mesh, the disjoint layer ranges `[a, b)` that its fragments have runs of at
        least min-trips identical iterations over (the longest first)."""
        found: dict[str, set[tuple[int, int]]] = {}
        for fragment in fragments(module):
            if fragment_role(fragment) == "update":
                continue
            mesh = fragment_mesh(fragment)
            for r in reroll_block(fragment.regions[0].blocks[0], "", min_trips=self.min_trips, rewrite=False):
                layers = sorted(r.layers)
                if r.trips >= self.min_trips and layers[0] >= 0 and layers == list(range(layers[0], layers[-1] + 1)):
                    found.setdefault(mesh, set()).add((layers[0], layers[-1] + 1))
        return {mesh: disjoint_ranges(candidates) for mesh, candidates in found.items()}


_UNREAD = frozenset({"stablehlo.slice", "stablehlo.reshape", "stablehlo.concatenate", "sdy.sharding_constraint"})


def _erase_unread(block: ir.Block) -> None:
    """The slices and reshapes no one reads any more (a rolled loop reads a range by its counter)."""
    for op in reversed(list(block.operations)):
        op = op.operation
        if op.name in _UNREAD and not any(list(r.uses) for r in op.results):
            op.erase()


def stage_loop_lines(report: dict | None) -> list[str]:
    """The plan summary's lines on which fragments loop over which layers and which stay
    unrolled, and why (from this pass's report)."""
    if not report:
        return []
    rolled, unrolled = [], []
    for r in report["ranges"]:
        layers = r["layers"]
        span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]}"
        if r["rolled"]:
            rolled.append(f"{r['fragment']} loop {r['loop']} over {span}")
        else:
            unrolled.append(f"{r['fragment']} loop {r['loop']} {span} ({r['reason']})")
    lines = []
    if rolled:
        lines.append(f"  run as loops (hlopar-reroll-stage-loops): {'; '.join(rolled)}")
    held = [
        f"{h['mesh']} layers {h['first']}..{h['first'] + h['rows'] - 1} ({h['arguments']} argument(s), "
        f"{h['results']} result(s))"
        for h in report.get("held", ())
    ]
    if held:
        lines.append(f"  held as one range of rows per stacked leaf: {'; '.join(held)}")
    if unrolled:
        lines.append(f"  left unrolled: {'; '.join(unrolled)}")
    return lines


def fragments(module: ir.Operation) -> list[ir.Operation]:
    """Every `mpmd.fragment` of the module, in program order."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "mpmd.fragment":
            found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module.walk(visit)
    return found


def _origin(fragment: ir.Operation) -> str:
    text = str(fragment.attributes["origin"])
    match = re.search(r'"([^"]+)"(\(\d+\))?', text)
    return (match.group(1) + (match.group(2) or "")) if match else fragment_role(fragment)
