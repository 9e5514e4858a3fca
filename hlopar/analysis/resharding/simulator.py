"""Completion time of a planned transfer under the host model, and a lower bound for it.

The simulator follows the paper's formulation (§3.2, Eq. 1–3): a unit op occupies, for its
whole duration, the send side of every NIC it sends through and the receive side of every
NIC it receives through (full duplex: sending and receiving are separate resources); ops
that share such a resource do not overlap. Given the global order of the ops (their slots),
each op starts as soon as every earlier op on one of its resources has finished, so the
plan's per-host orders are those of the global order. Intra-host links are fast and only
add to an op's duration; an op that never leaves a host holds that host's `intra` resource.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from hlopar.analysis.resharding.host_model import HostModel
from hlopar.analysis.resharding.unit_tasks import UnitTask
from hlopar.dialect.transfers import UnitOp

__all__ = ["OpCost", "Timeline", "list_schedule", "lower_bound", "op_cost", "simulate"]

Resource = Hashable


@dataclass(frozen=True)
class OpCost:
    duration: float
    resources: frozenset[Resource]


def _nic_ports(model: HostModel, hops: Iterable[tuple[int, int]]) -> list[Resource]:
    """The NIC sides the cross-host hops go through, once per hop."""
    ports: list[Resource] = []
    for a, b in hops:
        if not model.same_host(a, b):
            ports += [("send", model.host_of(a)), ("recv", model.host_of(b))]
    return ports


def _resources(model: HostModel, hops: Iterable[tuple[int, int]], host: int) -> frozenset[Resource]:
    """What an op holds: its NIC sides, or its host's `intra` resource if it never leaves it."""
    ports = frozenset(_nic_ports(model, hops))
    return ports or frozenset({("intra", host)})


def _step_time(model: HostModel, hops: Sequence[tuple[int, int]], nbytes: float) -> float:
    """Time for every hop to move `nbytes` at once: the slowest hop, or a NIC several hops share."""
    worst = max((model.hop_time(a, b, nbytes) for a, b in hops), default=0.0)
    busiest = max(Counter(_nic_ports(model, hops)).values(), default=0)
    if busiest > 1:
        worst = max(worst, model.inter_host_latency + busiest * nbytes / model.inter_host_bandwidth)
    return worst


def op_cost(op: UnitOp, model: HostModel) -> OpCost:
    """Duration and occupied resources of one unit op."""
    host = model.host_of(op.sender)
    if op.kind == "broadcast":
        path = (op.sender,) + op.receivers
        hops = list(zip(path, path[1:]))
        chunk = op.nbytes / op.chunks
        fill = sum(model.hop_time(a, b, chunk) for a, b in hops)
        duration = fill + (op.chunks - 1) * _step_time(model, hops, chunk)
        return OpCost(duration, _resources(model, hops, host))
    if op.kind == "send_recv":
        hops = [(op.sender, r) for r in op.receivers]
        return OpCost(sum(model.hop_time(a, b, op.nbytes) for a, b in hops), _resources(model, hops, host))
    if op.kind == "scatter_allgather":
        parts = len(op.receivers)
        part = op.nbytes / parts
        scatter = [(op.sender, r) for r in op.receivers]
        duration = sum(model.hop_time(a, b, part) for a, b in scatter)
        ring: list[tuple[int, int]] = []
        if parts > 1:
            ring = list(zip(op.receivers, op.receivers[1:] + op.receivers[:1]))
            duration += (parts - 1) * _step_time(model, ring, part)
        return OpCost(duration, _resources(model, scatter + ring, host))
    raise AssertionError(op.kind)


@dataclass(frozen=True)
class Timeline:
    """Start and end time of each op, in the order given, and the completion time of all."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.ends, default=0.0)


def list_schedule(items: Sequence[tuple[float, frozenset[Resource]]]) -> Timeline:
    """Each (duration, resources) in order starts when all its resources are free."""
    ready: dict[Resource, float] = defaultdict(float)
    starts, ends = [], []
    for duration, resources in items:
        start = max((ready[r] for r in resources), default=0.0)
        end = start + duration
        for r in resources:
            ready[r] = end
        starts.append(start)
        ends.append(end)
    return Timeline(tuple(starts), tuple(ends))


def simulate(ops: Sequence[UnitOp], model: HostModel) -> Timeline:
    """The timeline of ops executed in the given (slot) order."""
    return list_schedule([(c.duration, c.resources) for c in (op_cost(op, model) for op in ops)])


def lower_bound(tasks: Sequence[UnitTask], model: HostModel) -> float:
    """Seconds no plan can beat: the most bytes some host must receive, or some set of source
    hosts must send, over the NIC bandwidth, or some device must receive over its fastest
    link; plus one latency (nothing arrives before the first message does).

    A receiving host that holds no copy of a box must receive it through its NIC. A box that
    some receiving host lacks must leave the hosts holding it at least once, so any set S of
    source hosts sends at least the boxes held only inside S, and one host of S at least
    1/|S| of that (the fractional makespan of the sender assignment).
    """
    host = model.host_of
    recv_bytes: Counter[int] = Counter()
    device_bytes: Counter[int] = Counter()
    must_leave: Counter[frozenset[int]] = Counter()
    for task in tasks:
        holders = frozenset(host(d) for d in task.senders)
        lacking = {host(d) for d in task.receivers} - holders
        for h in lacking:
            recv_bytes[h] += task.nbytes
        if lacking:
            must_leave[holders] += task.nbytes
        for d in task.receivers:
            device_bytes[d] += task.nbytes
    if not device_bytes:
        return 0.0
    inter = model.inter_host_bandwidth
    bound = max(recv_bytes.values(), default=0) / inter
    bound = max(bound, max(device_bytes.values()) / max(model.intra_host_bandwidth, inter))
    bound = max(bound, _send_bound(must_leave) / inter)
    latency = model.inter_host_latency if must_leave else min(model.intra_host_latency, model.inter_host_latency)
    return bound + latency


def _send_bound(must_leave: Counter[frozenset[int]]) -> float:
    """max over host sets S of (bytes whose holders all lie in S) / |S|."""
    if not must_leave:
        return 0.0
    hosts = sorted(set().union(*must_leave))
    if len(hosts) <= 12:
        candidates: Iterable[Iterable[int]] = (
            combo for k in range(1, len(hosts) + 1) for combo in itertools.combinations(hosts, k)
        )
    else:  # too many subsets: the unions of holder sets, and all hosts
        candidates = list(must_leave) + [hosts]
    best = 0.0
    for combo in candidates:
        subset = frozenset(combo)
        demand = sum(size for holders, size in must_leave.items() if holders <= subset)
        best = max(best, demand / len(subset))
    return best
