"""A call never costs the state it did not replace (issue 25, item 0).

A new argument signature (a last partial batch, a batch in another dtype) is planned while
the workers of the current one keep running with the state; a call refused at planning
changes nothing; the state passed back moves to the new signature's workers, and the
signatures seen stay compiled (`ParallelizedFunction`'s cache: a partial batch alternating
with the full one restarts no worker). Calls from several threads are serialized: one set
of workers, every result right. A raylet that dies raises `WorkerError` at once, and the
next call runs on a new cluster.

Each step is compared with single-device JAX's step from the reference chain's state (never
read from the parallel run before its last call: a value read is kept on the driver, which
would hide a lost state), to the tolerances of test_ray_runtime.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from numerics import assert_step_close

import hlopar
from hlopar.models import get_train_step
from hlopar.runtime import local_ray
from hlopar.runtime.in_process import InProcessRuntime
from hlopar.runtime.ray_placement import WORKER_CPUS
from hlopar.runtime.ray_runtime import RayRuntime

RTOL = 1e-5
UPDATE_MAX_RTOL = 1e-4
ONE_HOST = hlopar.Cluster.local(1, 2, device_kind="cpu")


def batch(rows: int, dtype=jnp.float32, seed: int = 1) -> dict:
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "x": jax.random.normal(kx, (rows, 8), jnp.float32).astype(dtype),
        "y": jax.random.normal(ky, (rows, 4), jnp.float32).astype(dtype),
    }


@pytest.fixture(scope="module")
def mlp():
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step, params, step.init_opt_state(params)


class Reference:
    """Single-device training alongside the parallel run, from its own state: `next(batch)`
    is one device's step (and the parameters before it) that the parallel run's next step
    must equal."""

    def __init__(self, step, params, state):
        self.step, self.params, self.state = step, params, state

    def next(self, rows_batch):
        before = self.params
        out = self.step.jitted_step(self.params, self.state, rows_batch)
        self.params, self.state = out[0], out[1]
        return out, before


def check(out, reference) -> None:
    expected, before = reference
    assert_step_close(jax.tree_util.tree_leaves(out), expected, before, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)


def worker_pids(parallel) -> dict:
    return parallel.runtime.worker_pids()


def held_by_workers(before: dict, cpus: float, seconds: float = 10.0) -> None:
    """Ray's view of free resources lags a kill by a moment: polls for `cpus` held."""
    deadline = time.monotonic() + seconds
    while (held := round(before["CPU"] - ray.available_resources().get("CPU", 0.0), 4)) != round(cpus, 4):
        assert time.monotonic() < deadline, f"{held} CPU held by workers, expected {cpus}: a set leaked"
        time.sleep(0.2)


def test_new_signatures_keep_the_state_on_ray(ray_cluster, mlp):
    """Full batch, a refused batch, two partial batches, the full batch again (its workers
    still up), a bf16 batch (the least recent signature's workers go, what they held read
    first), the full batch again: every step from the state the previous one left, equal to
    one device's."""
    step, params, state = mlp
    full, partial, odd = batch(16), batch(8, seed=2), batch(9, seed=3)
    half = batch(16, jnp.bfloat16, seed=4)
    parallel = hlopar.parallelize(
        step.step,
        cluster=ONE_HOST,
        method="shard",
        runtime="ray",
        num_microbatches=2,
        batch_argnums=(2,),
        verbose=False,
    )
    reference = Reference(step, params, state)
    try:
        first = parallel(params, state, full)
        expected = [reference.next(full)]
        runtime, pids = parallel.runtime, worker_pids(parallel)

        clock = time.monotonic()
        with pytest.raises(hlopar.PlanningError, match="microbatches"):
            parallel(first[0], first[1], odd)
        assert time.monotonic() - clock < 30
        assert parallel.runtime is runtime and runtime.alive and worker_pids(parallel) == pids

        second = parallel(first[0], first[1], full)  # the state stayed on the workers
        expected.append(reference.next(full))
        stats = parallel.last_stats
        assert set(stats.sent["m0"]) <= set(runtime.program.batch_args)
        assert len(stats.kept["m0"]) == len(jax.tree_util.tree_leaves((params, state)))

        third = parallel(second[0], second[1], partial)  # a new signature: the state moves
        expected.append(reference.next(partial))
        partial_runtime = parallel.runtime
        assert partial_runtime is not runtime and runtime.alive  # the full batch's workers stay
        fourth = parallel(third[0], third[1], partial)  # `third` stays on its workers, unread
        expected.append(reference.next(partial))

        fifth = parallel(fourth[0], fourth[1], full)  # back: its workers, not restarted
        expected.append(reference.next(full))
        assert parallel.runtime is runtime and worker_pids(parallel) == pids and partial_runtime.alive

        sixth = parallel(fifth[0], fifth[1], half)  # a third signature: the least recent one's workers go
        expected.append(reference.next(half))
        assert not partial_runtime.alive and runtime.alive
        seventh = parallel(sixth[0], sixth[1], full)
        expected.append(reference.next(full))
        assert parallel.runtime is runtime and worker_pids(parallel) == pids

        # Every step equal to one device's, `third` too: read before its workers stopped.
        for out, ref in zip((first, second, third, fourth, fifth, sixth, seventh), expected, strict=True):
            check(out, ref)
    finally:
        parallel.close()
    assert not runtime.alive and not partial_runtime.alive


def test_new_signatures_in_process(mlp, tmp_path):
    """The same in this process: a jax error at lowering leaves the compiled step, a partial
    or bf16 batch compiles its own, and a signature seen before is not compiled again. `save`
    saves the last call's results, also after `compile` for another signature."""
    step, params, state = mlp
    full, partial, half = batch(16), batch(8, seed=2), batch(16, jnp.bfloat16, seed=4)
    parallel = hlopar.parallelize(
        step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", batch_argnums=(2,), verbose=False
    )
    reference = Reference(step, params, state)
    with parallel:
        first = parallel(params, state, full)
        check(first, reference.next(full))
        runtime = parallel.runtime
        assert isinstance(runtime, InProcessRuntime)
        executable = runtime.executable
        with pytest.raises(TypeError):  # x of 9 features: jax refuses the matrix product
            parallel(first[0], first[1], {"x": jnp.ones((16, 9)), "y": full["y"]})
        assert parallel.runtime is runtime and runtime.executable is executable
        out = first
        for data in (full, partial, full, half, partial, full):
            out = parallel(out[0], out[1], data)
            check(out, reference.next(data))
        assert parallel.runtime is runtime and runtime.executable is executable
        parallel.compile(out[0], out[1], partial)  # another signature, not called
        parallel.save(tmp_path / "last")
        parallel(out[0], out[1], full)
        restored = parallel.restore(tmp_path / "last")
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(out)
        for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(out), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_calls_from_several_threads_are_serialized(ray_cluster, mlp):
    """Two threads make the first call at once: one set of workers; then six threads call the
    warm function together: every result is the reference's, none waits on another's reply."""
    step, params, state = mlp
    full = batch(16)
    expected = step.jitted_step(params, state, full)
    held_by_workers(ray.cluster_resources(), 0.0)  # earlier tests' workers gone
    before = ray.available_resources()
    parallel = hlopar.parallelize(
        step.step,
        cluster=ONE_HOST,
        method="shard",
        runtime="ray",
        num_microbatches=2,
        batch_argnums=(2,),
        verbose=False,
        timeout=60,
    )
    results, errors = {}, []

    def call(k: int, times: int, gate: threading.Barrier) -> None:
        try:
            gate.wait()
            for _ in range(times):
                out = parallel(params, state, full)
                results.setdefault(k, []).append(jax.device_get(out))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    try:
        for threads, times in ((2, 1), (6, 3)):
            gate = threading.Barrier(threads)
            workers = [threading.Thread(target=call, args=(k, times, gate)) for k in range(threads)]
            clock = time.monotonic()
            for w in workers:
                w.start()
            for w in workers:
                w.join(120)
            assert not any(w.is_alive() for w in workers) and time.monotonic() - clock < 120
            assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
            assert isinstance(parallel.runtime, RayRuntime) and len(parallel.runtime.actors) == 1
            held_by_workers(before, WORKER_CPUS)
            for outs in results.values():
                for out in outs:
                    assert_step_close(
                        jax.tree_util.tree_leaves(out), expected, params, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL
                    )
            results.clear()
    finally:
        parallel.close()


def raylet_of(local) -> int:
    """The raylet of the local cluster `local` (a child of its `ray start` process)."""
    for entry in Path("/proc").iterdir():
        try:
            stat, command = (entry / "stat").read_text(), (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == local.process.pid and command.endswith(b"/raylet"):
            return int(entry.name)
    raise AssertionError(f"no raylet under {local.process.pid}")


@pytest.mark.parametrize("recover", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_a_dead_raylet_raises(ray_cluster, mlp, recover):
    """Last in the module: it kills the module's cluster (or the one the previous case
    started). The raylet dies during a step: the step raises `WorkerError` within seconds, and
    the driver is disconnected (Ray's C++ code would end the process 60 s later); with
    `recover`, the next call starts a new cluster and new workers."""
    step, params, state = mlp
    full = batch(16)
    expected = step.jitted_step(params, state, full)
    parallel = hlopar.parallelize(
        step.step,
        cluster=ONE_HOST,
        method="shard",
        runtime="ray",
        num_microbatches=2,
        batch_argnums=(2,),
        verbose=False,
        timeout=60,
    )
    try:
        first = parallel(params, state, full)
        ray.get(parallel.runtime.actors["m0"].debug_delay.remote(30.0))
        killer = threading.Timer(1.0, os.kill, (raylet_of(local_ray.current()), signal.SIGKILL))
        killer.start()
        clock = time.monotonic()
        with pytest.raises(
            hlopar.WorkerError,
            match=r"step 2: the local Ray cluster of this process ended .*the "
            r"next call starts a new cluster",
        ):
            parallel(first[0], first[1], full)
        assert time.monotonic() - clock < 15
        killer.join()
        local_ray.disconnected()
        assert not ray.is_initialized()
        np.testing.assert_allclose(float(first[2]), float(expected[2]), rtol=RTOL)  # it came with its step
        with pytest.raises(RuntimeError, match="cannot be read: its workers were stopped"):
            np.asarray(jax.tree_util.tree_leaves(first[0])[0])
        if recover:
            again = parallel(params, state, full)
            assert local_ray.lost() is None
            check(again, (expected, params))
    finally:
        parallel.close()
        if local_ray.current() is not ray_cluster:
            local_ray.current().stop()
