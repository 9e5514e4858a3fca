"""Local CPU devices: the environment that makes them, and a thread pool that cannot starve them."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from hlopar.runtime.host_devices import host_device_environment


def test_a_fresh_environment_gets_the_devices_and_twice_as_many_pool_threads():
    environment = host_device_environment(8, environ={})
    assert environment["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert int(environment["NPROC"]) == max(os.cpu_count() or 1, 16)


def test_what_the_user_set_is_kept():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4", "NPROC": "3"}
    assert host_device_environment(8, environ=environ) == {}
    environment = host_device_environment(2, environ={"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert environment["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_xla_cpu_pool_has_room_beyond_one_thread_per_device():
    """The tests' client (conftest) has 8 devices; XLA's pool must hold more than 8 threads,
    or a device running two collectives at once can starve another (see host_devices)."""
    devices = jax.devices("cpu")
    assert len(devices) == 8
    jax.block_until_ready(jax.jit(lambda v: v.sum())(jnp.ones(8)))
    names = Counter(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    assert names["tf_XLAEigen"] >= 2 * len(devices)
