"""How one unit task is carried out, given its sender (§3.1 of the cross-mesh paper).

- `broadcast` (the paper's): one chain from the sender through every receiver, grouped by
  host so that each receiving host is entered once, the box cut into K chunks and pipelined;
  it costs about t + (A-1)·t/K for A receiving hosts, t being one cross-host copy. K is
  given, or chosen per op to minimize the modeled time (latency per chunk against pipeline
  fill).
- `send-recv`: the sender sends the whole box to every receiver, one after the other (A·B·t).
- `alpa-local-allgather` (Alpa §6): one part per receiver, then an all-gather among the
  receivers (A·t plus the all-gather, which crosses hosts when the receivers do). Like Alpa,
  it needs a dimension of the box that the number of receivers divides; otherwise it falls
  back to send-recv (the uneven-partition slowdown of §5.1.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from hlopar.analysis.resharding.host_model import HostModel
from hlopar.analysis.resharding.simulator import op_cost
from hlopar.analysis.resharding.unit_tasks import UnitTask
from hlopar.dialect.transfers import UnitOp, box_elements

__all__ = ["STRATEGIES", "OpBuilder", "Strategy", "chain_order"]

Strategy = Literal["broadcast", "send-recv", "alpa-local-allgather"]
STRATEGIES: tuple[str, ...] = ("broadcast", "send-recv", "alpa-local-allgather")

MAX_CHUNKS = 4096


def chain_order(model: HostModel, sender: int, receivers: tuple[int, ...]) -> tuple[int, ...]:
    """Receivers grouped by host: the sender's own host first, then hosts and devices by id."""
    home = model.host_of(sender)
    return tuple(sorted(receivers, key=lambda d: (model.host_of(d) != home, model.host_of(d), d)))


def _chunk_candidates(limit: int) -> list[int]:
    """1, 2, 3, ... then geometric steps of ~12% up to `limit`."""
    values, k = [], 1
    while k <= limit:
        values.append(k)
        k = max(k + 1, int(k * 1.125))
    if values[-1] != limit:
        values.append(limit)
    return values


@dataclass
class OpBuilder:
    """Builds the `UnitOp` of a task for a given sender; caches the chunk choice per chain shape."""

    model: HostModel
    strategy: Strategy = "broadcast"
    chunks: int = 0  # 0: choose per op
    _best_chunks: dict[tuple, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r} (one of {', '.join(STRATEGIES)})")
        if self.chunks < 0:
            raise ValueError(f"chunks must be non-negative, got {self.chunks}")

    def build(self, task: UnitTask, sender: int) -> UnitOp:
        if sender not in task.senders:
            raise ValueError(f"device {sender} does not hold the box of task {task.index}")
        receivers = chain_order(self.model, sender, task.receivers)
        if self.strategy == "broadcast":
            op = UnitOp(task.index, "broadcast", sender, receivers, task.box, task.nbytes)
            return self._with_chunks(op, box_elements(task.box))
        if self.strategy == "alpa-local-allgather" and len(receivers) > 1:
            split = next((i for i, (lo, hi) in enumerate(task.box) if (hi - lo) % len(receivers) == 0), None)
            if split is not None:
                return UnitOp(
                    task.index, "scatter_allgather", sender, receivers, task.box, task.nbytes, split_dim=split
                )
        return UnitOp(task.index, "send_recv", sender, receivers, task.box, task.nbytes)

    def _with_chunks(self, op: UnitOp, elements: int) -> UnitOp:
        limit = max(1, min(elements, MAX_CHUNKS))
        if self.chunks:
            return replace(op, chunks=min(self.chunks, limit))
        hosts: dict[int, int] = {}
        shape = tuple(hosts.setdefault(self.model.host_of(d), len(hosts)) for d in (op.sender,) + op.receivers)
        key = (op.nbytes, limit, shape)
        if key not in self._best_chunks:
            self._best_chunks[key] = min(
                _chunk_candidates(limit), key=lambda k: op_cost(replace(op, chunks=k), self.model).duration
            )
        return replace(op, chunks=self._best_chunks[key])
