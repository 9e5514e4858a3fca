"""`hlopar.Cluster` and `parallelize`'s arguments are checked when given, against the planner's
bounds (`analysis.limits`): a clear `ValueError` naming the argument, the limit and why, never
a run that plans for minutes or a cluster of other sizes than asked."""

from __future__ import annotations

import pytest

from hlopar import Cluster, parallelize


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Cluster.local(0, 4), "Cluster num_hosts: expected a positive integer, got 0"),
        (lambda: Cluster.local(0), "Cluster num_hosts: expected a positive integer, got 0"),
        (lambda: Cluster.local(2, 0), "Cluster devices_per_host: expected a positive integer, got 0"),
        (lambda: Cluster.local(2, 10**20), "Cluster devices_per_host: 100000000000000000000 is more than 1,024"),
        (lambda: Cluster(num_hosts=4096, devices_per_host=8), "Cluster num_hosts: 4096 is more than 1,024"),
        (
            lambda: Cluster(num_hosts=64, devices_per_host=8),
            "Cluster: a cluster of 64 x 8 devices has 769 logical meshes",
        ),
        (lambda: Cluster.local(2, 4, device_kind="tpu"), "Cluster device_kind must be 'cpu', 'gpu' or None"),
        (lambda: Cluster.local(2, 4, preset="tpu"), "Cluster preset: unknown preset 'tpu'"),
    ],
)
def test_bad_clusters_are_refused(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert message in str(error.value)


def test_clusters_within_bounds():
    assert Cluster.local(2, 4).num_hosts == 2
    assert Cluster(address="auto").num_hosts is None  # sizes of a Ray cluster: read when resolved


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"num_microbatches": 0}, ValueError, "num_microbatches: expected a positive integer, got 0"),
        ({"num_microbatches": 2**40}, ValueError, "num_microbatches: 1099511627776 is more than 2,147,483,647"),
        ({"timeout": -1}, ValueError, "timeout: expected a number > 0, got -1"),
        ({"timeout": float("nan")}, ValueError, "timeout: expected a finite number, got nan"),
        ({"donate_argnums": (0, 1.5)}, ValueError, "donate_argnums: expected an integer, got 1.5"),
        ({"cluster": "local"}, TypeError, "cluster must be a hlopar.Cluster or None, got str"),
    ],
)
def test_bad_parallelize_arguments_are_refused(arguments, error, message):
    with pytest.raises(error) as raised:
        parallelize(lambda x: x, **arguments)
    assert message in str(raised.value)
