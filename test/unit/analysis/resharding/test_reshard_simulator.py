"""The host-model simulator and the lower bound on hand-computed cases.

The model: hosts of 2 devices, 1 GB/s NICs, 10 GB/s between devices of a host, no
latency (so every number below is bytes over bandwidth), unless a test says otherwise.
"""

from __future__ import annotations

import pytest

from hlopar.analysis.resharding import HostModel, lower_bound, op_cost, simulate
from hlopar.analysis.resharding.simulator import list_schedule
from hlopar.analysis.resharding.unit_tasks import UnitTask
from hlopar.dialect.transfers import UnitOp

MODEL = HostModel(
    devices_per_host=2,
    inter_host_bandwidth=1e9,
    intra_host_bandwidth=1e10,
    inter_host_latency=0.0,
    intra_host_latency=0.0,
)
GB = 10**9
BOX = ((0, 1),)


def op(kind, sender, receivers, nbytes=GB, chunks=1, split_dim=None, task=0):
    return UnitOp(
        task, kind, sender, tuple(receivers), BOX if split_dim is None else ((0, 4),), nbytes, chunks, split_dim
    )


def test_broadcast_into_one_host():
    # 0 -> 2 across hosts (1 s), 2 -> 3 inside host 1 (0.1 s): one chunk takes both in turn.
    cost = op_cost(op("broadcast", 0, (2, 3)), MODEL)
    assert cost.duration == pytest.approx(1.1)
    assert cost.resources == {("send", 0), ("recv", 1)}
    # Ten chunks: the first crosses both hops (0.11 s), the other nine follow at the pace of
    # the slowest hop (0.1 s each): t + t/K of intra-host tail.
    assert op_cost(op("broadcast", 0, (2, 3), chunks=10), MODEL).duration == pytest.approx(1.01)


def test_broadcast_chain_across_hosts_costs_t_plus_A_minus_1_over_K():
    # §3.1: T = t/K (K + A - 1) for A receiving hosts; here A = 2, K = 10, plus two 0.01 s intra hops.
    cost = op_cost(op("broadcast", 0, (2, 3, 4, 5), chunks=10), MODEL)
    assert cost.duration == pytest.approx(0.1 * (10 + 1) + 0.02)
    assert cost.resources == {("send", 0), ("recv", 1), ("send", 1), ("recv", 2)}


def test_a_chain_entering_a_host_twice_shares_its_nic():
    # 0 -> 2 (host 1) -> 4 (host 2) -> 3 (host 1 again): host 1 receives two chunks per step.
    cost = op_cost(op("broadcast", 0, (2, 4, 3), chunks=10), MODEL)
    assert cost.duration == pytest.approx(0.3 + 9 * 0.2)


def test_send_recv_sends_the_whole_box_to_each_receiver():
    cost = op_cost(op("send_recv", 0, (2, 3, 4)), MODEL)
    assert cost.duration == pytest.approx(3.0)  # T^sr = A·B·t
    assert cost.resources == {("send", 0), ("recv", 1), ("recv", 2)}


def test_scatter_allgather_inside_and_across_hosts():
    # Two receivers on one host: two halves cross (1 s), then one ring step of a half inside (0.05 s).
    inside = op_cost(op("scatter_allgather", 0, (2, 3), split_dim=0), MODEL)
    assert inside.duration == pytest.approx(1.05)
    assert inside.resources == {("send", 0), ("recv", 1)}
    # Receivers on two hosts: the ring crosses hosts both ways, a step costs a half over the NIC.
    across = op_cost(op("scatter_allgather", 0, (2, 4), split_dim=0), MODEL)
    assert across.duration == pytest.approx(1.5)
    assert across.resources == {("send", 0), ("recv", 1), ("recv", 2), ("send", 1), ("send", 2)}


def test_an_op_that_stays_on_its_host_holds_the_host():
    cost = op_cost(op("send_recv", 0, (1,)), MODEL)
    assert cost.duration == pytest.approx(0.1)
    assert cost.resources == {("intra", 0)}


def test_latency_counts_per_hop_and_per_chunk():
    model = HostModel(
        devices_per_host=2,
        inter_host_bandwidth=1e9,
        intra_host_bandwidth=1e10,
        inter_host_latency=1e-3,
        intra_host_latency=0.0,
    )
    assert op_cost(op("broadcast", 0, (2,), chunks=4), model).duration == pytest.approx(1.0 + 4e-3)


def test_list_schedule_waits_for_shared_resources_only():
    a = (1.0, frozenset({("send", 0), ("recv", 1)}))
    b = (1.0, frozenset({("send", 0), ("recv", 2)}))
    c = (2.0, frozenset({("send", 3), ("recv", 1)}))
    d = (0.5, frozenset({("send", 4), ("recv", 5)}))
    timeline = list_schedule([a, b, c, d])
    assert timeline.starts == (0.0, 1.0, 1.0, 0.0)
    assert timeline.ends == (1.0, 2.0, 3.0, 0.5)
    assert timeline.makespan == 3.0


def test_simulate_orders_by_slot():
    first = op("broadcast", 0, (2,), task=0)
    second = op("broadcast", 1, (4,), task=1)  # same sending host: waits
    third = op("broadcast", 6, (3,), task=2)  # host 3 -> host 1: waits for `first` only
    timeline = simulate([first, second, third], MODEL)
    assert timeline.starts == pytest.approx((0.0, 1.0, 1.0))
    assert timeline.makespan == pytest.approx(2.0)


def task(index, senders, receivers, nbytes):
    return UnitTask(index, BOX, tuple(senders), tuple(receivers), nbytes)


def test_lower_bound_receiving_side():
    # Hosts 2 and 3 each need 2 GB they do not have: 2 s, however many senders.
    tasks = [task(0, (0, 2, 4), (4, 5), GB), task(1, (0, 2), (4, 5), GB), task(2, (0, 2), (6, 7), 2 * GB)]
    assert lower_bound(tasks, MODEL) == pytest.approx(2.0)


def test_lower_bound_sending_side_over_sets_of_hosts():
    # Host 0 (devices 0, 1) alone holds 3 GB that hosts 2..5 need: 3 s.
    tasks = [task(0, (0,), (4,), GB), task(1, (1,), (6,), GB), task(2, (0, 1), (8,), GB), task(3, (0, 2), (10,), GB)]
    assert lower_bound(tasks, MODEL) == pytest.approx(3.0)
    # Hosts {0, 1} hold 6 GB between them, no host alone more than 1 GB, no receiver more
    # than 1 GB: one of the two sends at least 3 GB.
    tasks = [task(0, (0,), (4,), GB)] + [task(i, (0, 2), (4 + 2 * i,), GB) for i in range(1, 6)]
    assert lower_bound(tasks, MODEL) == pytest.approx(3.0)


def test_lower_bound_for_a_box_the_receiving_host_already_has():
    # Device 1 shares host 0 with the holder: no NIC traffic, the device link bounds it.
    assert lower_bound([task(0, (0,), (1,), GB)], MODEL) == pytest.approx(0.1)


def test_lower_bound_adds_one_latency():
    model = HostModel(
        devices_per_host=2,
        inter_host_bandwidth=1e9,
        intra_host_bandwidth=1e10,
        inter_host_latency=1e-3,
        intra_host_latency=1e-5,
    )
    assert lower_bound([task(0, (0,), (2,), GB)], model) == pytest.approx(1.001)
    assert lower_bound([], model) == 0.0


def test_unit_ops_check_themselves():
    with pytest.raises(ValueError, match="must be distinct devices"):
        op("broadcast", 0, (0, 2))
    with pytest.raises(ValueError, match="no receivers"):
        op("broadcast", 0, ())
    with pytest.raises(ValueError, match="do not divide"):
        op("scatter_allgather", 0, (2, 3, 4), split_dim=0)
