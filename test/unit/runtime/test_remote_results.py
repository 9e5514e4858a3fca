"""Results stay on the workers (`runtime/remote_array.py`): a step returns `RemoteArray`s in
`fn`'s pytree, the driver receives the bytes of what it reads and nothing else, a result
passed back moves nothing, an unreferenced or donated one is dropped on the workers, and a
result reads like the jax array it holds (numpy, jax functions, `jax.jit`, printing); typed
keys come back with the step as jax's own key arrays, and scalars (a loss) with it too,
so that reading them asks the workers nothing.

What reaches the driver is counted at its one door: every `ray.get` the driver makes,
each returned object pickled with protocol 5, whose out-of-band buffers are the bytes of
its arrays."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from zoo_steps import keyed_step

import hlopar
from hlopar.runtime.remote_array import RemoteArray

ONE_HOST = hlopar.Cluster.local(num_hosts=1, devices_per_host=2, device_kind="cpu")
LR, MOMENTUM = 1e-3, 0.9


class DriverBytes:
    """Counts what the driver's `ray.get` calls return: array bytes and all bytes."""

    def __init__(self, monkeypatch):
        self.arrays = self.total = 0
        get = ray.get

        def counting_get(*args, **kwargs):
            value = get(*args, **kwargs)
            buffers = []
            self.total += len(pickle.dumps(value, protocol=5, buffer_callback=buffers.append))
            self.arrays += sum(b.raw().nbytes for b in buffers)
            self.total += sum(b.raw().nbytes for b in buffers)
            return value

        monkeypatch.setattr(ray, "get", counting_get)

    def take(self) -> tuple[int, int]:
        out = (self.arrays, self.total)
        self.arrays = self.total = 0
        return out


def momentum_step(w, velocity, x, y):
    """Least squares by SGD with momentum: a state of two (n, k) float32 arrays."""
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    velocity = MOMENTUM * velocity + grad
    return w - LR * velocity, velocity, loss


def kept_on_workers(parallel) -> set[tuple[int, int]]:
    """The (step, result) pairs the workers keep."""
    runtime = parallel.runtime
    return {
        key
        for actor in runtime.actors.values()
        for key in ray.get(actor.__ray_call__.remote(lambda worker: sorted(worker.kept)))
    }


def test_a_100_mb_state_trains_with_only_the_loss_reaching_the_driver(ray_cluster, monkeypatch):
    n, k, rows = 5120, 2560, 8  # w and velocity: 5120 x 2560 float32, 50 MiB each: 100 MiB of state
    w = jax.random.normal(jax.random.PRNGKey(0), (n, k), jnp.float32) * 0.01
    velocity = jnp.zeros((n, k), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, n), jnp.float32)
    y = jax.random.normal(jax.random.PRNGKey(2), (rows, k), jnp.float32)
    assert w.nbytes + velocity.nbytes == 100 * 2**20
    parallel = hlopar.parallelize(
        momentum_step, cluster=ONE_HOST, method="shard", runtime="ray", batch_argnums=(2, 3), verbose=False
    )
    reference = jax.jit(momentum_step)
    try:
        state = parallel(w, velocity, x, y)[:2]  # the first call sends the state, once
        counted = DriverBytes(monkeypatch)
        losses = []
        for _ in range(3):
            *state, loss = parallel(*state, x, y)
            assert isinstance(loss, RemoteArray) and all(isinstance(s, RemoteArray) for s in state)
            assert state[0].shape == (n, k) and state[0].dtype == np.float32  # known without reading
            arrays, total = counted.take()
            assert arrays == loss.nbytes == 4 and total < 4096, (arrays, total)  # the step: the loss alone
            losses.append(float(loss))
            assert counted.take() == (0, 0)  # read without asking the workers
            stats = parallel.last_stats
            assert stats.sent == {"m0": (2, 3)} and stats.kept == {"m0": (0, 1)}  # only the batch went out
        # What the workers keep: the live state and loss, and the last step's released results
        # (dropped at the start of the next step), never a growing history.
        runtime_step = parallel.runtime.step_id
        assert kept_on_workers(parallel) <= {(s, r) for s in (runtime_step - 1, runtime_step) for r in range(3)}

        # The numbers are single-device JAX's (the state read at the end, once).
        rw, rv, _ = reference(w, velocity, x, y)
        for expected in losses:
            rw, rv, rloss = reference(rw, rv, x, y)
            np.testing.assert_allclose(expected, float(rloss), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(state[0]), np.asarray(rw), rtol=1e-5, atol=1e-7)
        assert counted.take()[0] == state[0].nbytes
    finally:
        parallel.shutdown()


def test_results_read_like_the_jax_arrays_they_hold(ray_cluster, monkeypatch, tmp_path):
    w = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
    x = jnp.ones((8, 4), jnp.float32)
    key = jax.random.key(3)
    parallel = hlopar.parallelize(
        keyed_step, cluster=ONE_HOST, method="shard", runtime="ray", batch_argnums=(2,), verbose=False
    )
    try:
        out = parallel(w, key, x)
        expected = jax.jit(keyed_step)(w, key, x)
        # fn's pytree, every leaf a RemoteArray but the key (a jax key array), nothing read yet.
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
        new, new_key, loss = out
        assert isinstance(new["w"], RemoteArray) and isinstance(loss, RemoteArray)
        assert parallel.runtime.fetched_bytes == 8 + 4  # the key and the loss came with the step
        assert (new["w"].shape, new["w"].dtype, new["w"].ndim, new["w"].size) == ((4, 3), np.float32, 2, 12)
        assert isinstance(new_key, jax.Array) and new_key.dtype == key.dtype and new_key.shape == ()

        # Reading: each value fetched once, alone (the loss is already here).
        counted = DriverBytes(monkeypatch)
        value = float(loss)
        assert counted.take()[0] == 0
        np.testing.assert_allclose(value, float(expected[2]), rtol=1e-6)
        held = jax.device_put(np.float32(value))
        assert repr(loss) == repr(held) and str(loss) == str(held) and f"{loss:.4f}" == f"{value:.4f}"
        assert float(loss * 2) == 2 * value and bool(loss > 0) and int(loss) == int(value)
        assert counted.take()[0] == 0
        np.testing.assert_allclose(np.asarray(new["w"]), expected[0]["w"], rtol=1e-6)
        np.testing.assert_array_equal(jax.device_get(new)["w"], np.asarray(new["w"]))
        assert counted.take()[0] == 48

        # The key is jax's own (eager jax.random takes it); jax functions and jax.jit take
        # results as the arrays they hold.
        np.testing.assert_array_equal(jax.random.key_data(new_key), jax.random.key_data(expected[1]))
        np.testing.assert_array_equal(
            jax.random.key_data(jax.random.split(new_key)), jax.random.key_data(jax.random.split(expected[1]))
        )
        np.testing.assert_allclose(jnp.sum(new["w"]), jnp.sum(expected[0]["w"]), rtol=1e-6)
        again = jax.jit(keyed_step)(new["w"], new_key, x)

        # Passed back, the state moves nothing (the key's 8 bytes go and come back, with the
        # loss's 4); the step equals single-device JAX's from the same values.
        counted.take()
        second = parallel(new["w"], new_key, x)
        assert parallel.last_stats.kept == {"m0": (0,)} and parallel.last_stats.sent == {"m0": (1, 2)}
        assert counted.take()[0] == 8 + 4
        np.testing.assert_allclose(second[0]["w"], again[0]["w"], rtol=1e-6)
        np.testing.assert_allclose(second[2], again[2], rtol=1e-6)

        # A save holds the key too; restored, the state is kept on the workers again.
        parallel.save(tmp_path / "saved")
        restored = parallel.restore(tmp_path / "saved")
        assert isinstance(restored[0]["w"], RemoteArray) and isinstance(restored[1], jax.Array)
        np.testing.assert_array_equal(jax.random.key_data(restored[1]), jax.random.key_data(second[1]))
        np.testing.assert_array_equal(restored[0]["w"], second[0]["w"])
    finally:
        parallel.shutdown()


def sgd_step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * grad, loss


def test_donated_and_lost_results(ray_cluster):
    """A donated result is deleted, as jax deletes donated arrays: reading it or passing it
    again raises, naming it; the workers drop it at the next step. After the workers stop,
    a result read before (or a scalar, which came with its step) is sent again, one never
    read cannot be had."""
    w = jnp.ones((4, 3), jnp.float32)
    x = jnp.ones((8, 4), jnp.float32)
    parallel = hlopar.parallelize(
        sgd_step,
        cluster=ONE_HOST,
        method="shard",
        runtime="ray",
        donate_argnums=(0,),
        batch_argnums=(1,),
        verbose=False,
    )
    reference = jax.jit(sgd_step)
    try:
        first, _ = parallel(w, x)
        assert w.is_deleted()  # a jax array donated: deleted, as jax.jit does
        expected = reference(reference(np.ones((4, 3), np.float32), x)[0], x)
        second, _ = parallel(first, x)
        assert first.is_deleted() and not second.is_deleted()
        with pytest.raises(RuntimeError, match=r"sgd_step's result \[0\] \(call 1\) has been deleted"):
            np.asarray(first)
        with pytest.raises(RuntimeError, match=r"sgd_step's argument \[0\]: .*has been deleted"):
            parallel(first, x)
        np.testing.assert_allclose(np.asarray(second), expected[0], rtol=1e-6)
        third, unread = parallel(second, x)
        assert (1, 0) not in kept_on_workers(parallel)  # `first`, donated at call 2, dropped at call 3
        read = np.asarray(third)  # read before the workers stop: kept on the driver

        parallel.shutdown()
        np.testing.assert_allclose(float(unread), float(reference(expected[0], x)[1]), rtol=1e-6)  # came with call 3
        # `third` was read before: the next call (fresh workers) sends it.
        fourth, loss = parallel(third, x)
        assert parallel.last_stats.sent == {"m0": (0, 1)}
        np.testing.assert_allclose(float(loss), float(reference(read, x)[1]), rtol=1e-6)
        parallel.shutdown()
        with pytest.raises(
            RuntimeError,
            match=r"sgd_step's result \[0\] \(call 4\) cannot be read: its workers "
            "were stopped",
        ):
            np.asarray(fourth)
        with pytest.raises(
            RuntimeError,
            match=r"sgd_step's argument \[0\]: .*\(call 4\) cannot be read: its "
            "workers were stopped",
        ):
            parallel(fourth, x)
    finally:
        parallel.shutdown()
