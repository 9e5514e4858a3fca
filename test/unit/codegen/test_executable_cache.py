"""`codegen/executable_cache.py` without Ray: what is shipped, loaded and compiled.

The step has two scalar `power` fusions, as an Adam update has: the fragment whose
re-serialized bytes failed on a worker ("NOT_FOUND: Function convert_power_fusion not
found", `tools/repro_reserialize.py`). Each executable is checked against `jax.jit` of the
same step, exactly (the same XLA program on the same CPU).
"""

from __future__ import annotations

import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlopar.codegen import executable_cache
from hlopar.codegen.executable_cache import COMPILED, LOADED, REUSED, ExecutableCache, executable_key


def step(x, count):
    decay = count.astype(jnp.float32)
    return x / (1 - 0.9**decay) + 0.999**decay


ARGUMENTS = (np.linspace(-1, 1, 128, dtype=np.float32).reshape(8, 16), np.int32(3))


@pytest.fixture(scope="module")
def text():
    return jax.jit(step).lower(*ARGUMENTS).as_text()


@pytest.fixture(scope="module")
def expected():
    return np.asarray(jax.jit(step)(*ARGUMENTS))


def hows(cache: ExecutableCache) -> list[str]:
    return [event.how for event in cache.events]


def test_a_loaded_executable_is_shipped_as_the_bytes_it_was_loaded_from(tmp_path, text, expected):
    """A plan cache's executable loaded in the driver, then shipped to a worker: the worker
    gets the disk's bytes (XLA:CPU's serialization of a loaded executable lacks its
    kernels) and runs them, twice."""
    devices = jax.devices()[:1]
    planning = ExecutableCache(tmp_path)
    planning.executable(text, devices, "update")
    key = executable_key(text, devices)
    on_disk = (tmp_path / key).read_bytes()
    driver = ExecutableCache(tmp_path)  # a new signature's plan, or a new process
    driver.executable(text, devices, "update")
    assert hows(driver) == [LOADED]
    shipped = driver.shipment([text], devices)
    assert shipped == {key: on_disk}
    worker = ExecutableCache(shipped=shipped)
    run = worker.executable(text, devices, "update")
    assert hows(worker) == [LOADED]
    for _ in range(2):
        np.testing.assert_array_equal(run(*ARGUMENTS)[0], expected)


def test_a_compiled_executable_is_serialized_once(tmp_path, text, monkeypatch):
    """Written to disk and shipped: one serialization."""
    calls = []
    real = executable_cache.serialize_spmd
    monkeypatch.setattr(executable_cache, "serialize_spmd", lambda spmd: calls.append(1) or real(spmd))
    devices = jax.devices()[:1]
    cache = ExecutableCache(tmp_path)
    cache.executable(text, devices, "update")
    cache.executable(text, devices, "update")
    assert hows(cache) == [COMPILED, REUSED]
    key = executable_key(text, devices)
    assert cache.shipment([text, text], devices) == {key: (tmp_path / key).read_bytes()}
    assert len(calls) == 1


def test_bytes_that_do_not_load_are_compiled(text, expected):
    """Torn bytes (or bytes another XLA made) under the right key: compiled, and why said."""
    devices = jax.devices()[:1]
    worker = ExecutableCache(shipped={executable_key(text, devices): b"not an executable"})
    run = worker.executable(text, devices, "update")
    assert hows(worker) == [COMPILED]
    assert worker.events[0].refused
    np.testing.assert_array_equal(run(*ARGUMENTS)[0], expected)


def test_another_hosts_worker_compiles(text, expected, monkeypatch):
    """XLA:CPU compiles for its host: a worker elsewhere finds nothing under its key."""
    devices = jax.devices()[:1]
    driver = ExecutableCache()
    driver.executable(text, devices, "update")
    shipped = driver.shipment([text], devices)
    assert len(shipped) == 1
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    worker = ExecutableCache(shipped=shipped)
    run = worker.executable(text, devices, "update")
    assert hows(worker) == [COMPILED] and not worker.events[0].refused
    np.testing.assert_array_equal(run(*ARGUMENTS)[0], expected)


def test_loading_off(tmp_path, text, monkeypatch):
    """`HLOPAR_LOAD_EXECUTABLES=0`: nothing written, shipped or read."""
    monkeypatch.setenv("HLOPAR_LOAD_EXECUTABLES", "0")
    devices = jax.devices()[:1]
    cache = ExecutableCache(tmp_path)
    cache.executable(text, devices, "update")
    assert cache.shipment([text], devices) == {}
    assert list(tmp_path.iterdir()) == []
