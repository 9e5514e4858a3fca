"""`plan_transfer`: unit tasks, a strategy per task, load balancing and order, predicted time.

This is the whole planning of one cross-mesh transfer as a pure function: the pass adapts
IR to it, the benchmark and the tests call it directly.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hlopar.analysis.resharding.host_model import HostModel
from hlopar.analysis.resharding.scheduling import ALGORITHMS, Option, SearchBudget, ensemble, run_algorithm
from hlopar.analysis.resharding.simulator import lower_bound, op_cost, simulate
from hlopar.analysis.resharding.strategies import STRATEGIES, OpBuilder, Strategy
from hlopar.analysis.resharding.unit_tasks import MeshLayout, UnitTask, unit_tasks
from hlopar.dialect.transfers import UnitOp

__all__ = ["PlannedOp", "TransferPlan", "plan_transfer"]


@dataclass(frozen=True)
class PlannedOp:
    """A unit op with its slot in the global order and its predicted times."""

    op: UnitOp
    slot: int
    start: float
    end: float


@dataclass(frozen=True)
class TransferPlan:
    """One planned transfer: its unit tasks, the op of each in slot order, and the prediction."""

    shape: tuple[int, ...]
    dtype_bytes: int
    src: MeshLayout
    dst: MeshLayout
    tasks: tuple[UnitTask, ...]
    ops: tuple[PlannedOp, ...]  # in slot order
    strategy: str
    algorithm: str  # as asked
    chosen_algorithm: str  # the ensemble's winner, else `algorithm`
    predicted_time: float
    lower_bound: float
    planning_seconds: float

    def report(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the pass's `report` writes one per transfer)."""
        return {
            "shape": list(self.shape),
            "dtype_bytes": self.dtype_bytes,
            "strategy": self.strategy,
            "algorithm": self.algorithm,
            "chosen_algorithm": self.chosen_algorithm,
            "unit_tasks": len(self.tasks),
            "predicted_time_s": self.predicted_time,
            "lower_bound_s": self.lower_bound,
            "ratio_to_lower_bound": self.predicted_time / self.lower_bound if self.lower_bound > 0 else None,
            "planning_s": self.planning_seconds,
            "ops": [
                {
                    "slot": p.slot,
                    "kind": p.op.kind,
                    "start": [lo for lo, _ in p.op.box],
                    "limit": [hi for _, hi in p.op.box],
                    "sender": p.op.sender,
                    "receivers": list(p.op.receivers),
                    "chunks": p.op.chunks,
                    "bytes": p.op.nbytes,
                    "start_s": p.start,
                    "end_s": p.end,
                }
                for p in self.ops
            ],
        }


def plan_transfer(
    shape: Sequence[int],
    dtype_bytes: int,
    src: MeshLayout,
    dst: MeshLayout,
    model: HostModel,
    *,
    strategy: Strategy = "broadcast",
    algorithm: str = "ensemble",
    chunks: int = 0,
    budget: SearchBudget = SearchBudget(),
) -> TransferPlan:
    """Plans moving a tensor from `src` to `dst` (disjoint meshes) on the cluster `model`.

    `chunks=0` picks the broadcast chunk count per op from the model; `algorithm` is one of
    `ALGORITHMS`. Raises `ValueError` for overlapping meshes or unknown names.
    """
    began = time.perf_counter()
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")
    shape = tuple(int(s) for s in shape)
    tasks = unit_tasks(shape, src, dst, dtype_bytes)
    builder = OpBuilder(model, strategy, chunks)
    choices = [_options(task, builder, model) for task in tasks]
    problem = [[option for _, option in options] for options in choices]
    chosen = algorithm
    if algorithm == "ensemble":
        chosen, schedule = ensemble(problem, budget)
    else:
        schedule = run_algorithm(algorithm, problem, budget)
    ops = [choices[t][k][0] for t, k in schedule]
    if algorithm != "naive":  # the naive plan keeps the lowest-indexed sender (§3.2)
        ops = _spread_senders(ops, tasks, model, builder)
    ops, timeline = _settle_order(ops, model)
    planned = tuple(
        PlannedOp(op, slot, start, end)
        for slot, (op, start, end) in enumerate(zip(ops, timeline.starts, timeline.ends))
    )
    return TransferPlan(
        shape,
        dtype_bytes,
        src,
        dst,
        tasks,
        planned,
        strategy,
        algorithm,
        chosen,
        timeline.makespan,
        lower_bound(tasks, model),
        time.perf_counter() - began,
    )


def _options(task: UnitTask, builder: OpBuilder, model: HostModel) -> list[tuple[UnitOp, Option]]:
    """One option per sender host, sent from its lowest-indexed holder; lowest host first."""
    first_on_host: dict[int, int] = {}
    for device in sorted(task.senders):
        first_on_host.setdefault(model.host_of(device), device)
    options = []
    for host, device in sorted(first_on_host.items()):
        op = builder.build(task, device)
        cost = op_cost(op, model)
        port = ("send", host) if ("send", host) in cost.resources else ("intra", host)
        options.append((op, Option(cost.duration, cost.resources, host, port)))
    return options


def _spread_senders(ops: list[UnitOp], tasks: Sequence[UnitTask], model: HostModel, builder: OpBuilder) -> list[UnitOp]:
    """Within its chosen host, each op is sent by the holder that has sent the least so far.

    The host model cannot tell devices of one host apart, but a real host has one link per
    device; spreading keeps them evenly used. Costs stay the same.
    """
    sent: Counter[int] = Counter()
    spread = []
    for op in ops:
        host = model.host_of(op.sender)
        holders = [d for d in tasks[op.task].senders if model.host_of(d) == host]
        device = min(holders, key=lambda d: (sent[d], d))
        sent[device] += 1
        spread.append(op if device == op.sender else replace(builder.build(tasks[op.task], device), chunks=op.chunks))
    return spread


def _settle_order(ops: list[UnitOp], model: HostModel):
    """Re-sorts by predicted start until the order is the start order (never slower)."""
    timeline = simulate(ops, model)
    for _ in range(len(ops) + 1):
        order = sorted(range(len(ops)), key=lambda i: (timeline.starts[i], i))
        if order == list(range(len(ops))):
            break
        ops = [ops[i] for i in order]
        timeline = simulate(ops, model)
    return ops, timeline
