"""A plan on this machine runs in the calling process, as `jax.jit` does
(`runtime/in_process.py`, issue 18 item 2; pipelined plans, issue 28): no worker, the
results `jax.Array`s on this process's devices laid out as the plan makes them, passed back
as they are; the numbers single-device JAX's; save and restore bit for bit, and a save
restores in either runtime. A plan that cannot run here goes to Ray under "auto" and is
refused, saying why, under "process".

Each step is compared with single-device JAX from the same inputs (`numerics`, the
tolerances of test_ray_runtime.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_step_close, assert_trees_equal
from zoo_steps import keyed_step

import hlopar
from hlopar.models import get_train_step
from hlopar.runtime.in_process import InProcessRuntime
from hlopar.runtime.ray_runtime import RayRuntime
from hlopar.runtime.remote_array import RemoteArray

ONE_HOST = hlopar.Cluster.local(1, 8, device_kind="cpu")
TWO_HOSTS = hlopar.Cluster.local(2, 4, device_kind="cpu")
RTOL = 1e-5
UPDATE_MAX_RTOL = 1e-4


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The zoo's tiny MLP step, its arguments, and its "shard" plan run in this process for
    two steps (a plan cache of the module's own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HLOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("hlopar-cache")))
        step = get_train_step("mlp", "tiny")
        params = step.init(jax.random.PRNGKey(0))
        args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
        parallel = hlopar.parallelize(step.step, cluster=ONE_HOST, method="shard", batch_argnums=(2,), verbose=False)
        yield step, args, parallel
        parallel.close()


def test_a_one_executable_plan_runs_here_as_jax_jit_does(mlp):
    step, args, parallel = mlp
    first = parallel(*args)
    assert isinstance(parallel.runtime, InProcessRuntime) and parallel.runtime.alive
    leaves = jax.tree_util.tree_leaves(first)
    assert not any(isinstance(x, RemoteArray) for x in leaves) and all(isinstance(x, jax.Array) for x in leaves)
    # On this process's 8 devices, each result laid out as the executable makes it.
    ex = parallel.runtime.executable
    assert [x.sharding for x in leaves] == list(ex.output_shardings)
    assert all(x.sharding.device_set == set(jax.devices()[:8]) for x in leaves)
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(step.jitted_step(*args))
    assert_step_close(leaves, step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)

    # The state leaves the step laid out as the next step reads it (issue 31 item 3), so
    # passed back it is used as it is: only the batch, on one device, is placed on the mesh.
    state = jax.tree_util.tree_leaves(first[:2])
    assert all(x.sharding.is_equivalent_to(ex.input_shardings[i], x.ndim) for i, x in enumerate(state))
    second = parallel(first[0], first[1], args[2])
    assert parallel.runtime.placed == len(jax.tree_util.tree_leaves(args[2]))
    assert_step_close(
        jax.tree_util.tree_leaves(second),
        step.jitted_step(first[0], first[1], args[2]),
        first[0],
        rtol=RTOL,
        update_max_rtol=UPDATE_MAX_RTOL,
    )
    assert parallel.runtime.step_id == 2


def test_a_sharded_state_is_not_laid_out_again_between_steps(tmp_path, monkeypatch):
    """The tiny GPT's "shard" plan shards its weights and Adam's moments; the update computes
    some of them in other layouts than the forward reads (the embedding's gradient split by
    columns where the table is read whole), and returns each as its argument is laid out
    (issue 31 item 3): from the second step on, only the batch is placed."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step = get_train_step("gpt", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    with hlopar.parallelize(step.step, cluster=ONE_HOST, method="shard", batch_argnums=(2,), verbose=False) as parallel:
        first = parallel(*args)
        ex = parallel.runtime.executable
        state = jax.tree_util.tree_leaves(first[:2])
        assert len(state) == len(ex.input_shardings) - len(jax.tree_util.tree_leaves(args[2]))
        assert all(x.sharding.is_equivalent_to(ex.input_shardings[i], x.ndim) for i, x in enumerate(state))
        assert sum(not x.sharding.is_fully_replicated for x in state) >= 8, "the plan shards little: proves little"
        second = parallel(first[0], first[1], args[2])
        assert parallel.runtime.placed == len(jax.tree_util.tree_leaves(args[2]))
        assert_step_close(
            jax.tree_util.tree_leaves(second),
            step.jitted_step(first[0], first[1], args[2]),
            first[0],
            rtol=RTOL,
            update_max_rtol=UPDATE_MAX_RTOL,
        )


def test_save_and_restore_here_and_on_ray(mlp, tmp_path, ray_cluster):
    """A save made here restores here bit for bit; the plan's Ray worker reads the same files
    (the same plan on `runtime="ray"`), and its save restores here."""
    step, args, parallel = mlp
    out = parallel(*args)
    parallel.save(tmp_path / "here")
    restored = parallel.restore(tmp_path / "here")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(restored))
    assert_trees_equal(restored, out)
    assert_trees_equal(parallel(*restored[:2], args[2]), parallel(*out[:2], args[2]))

    on_ray = hlopar.parallelize(
        step.step, cluster=ONE_HOST, method="shard", batch_argnums=(2,), runtime="ray", verbose=False
    )
    _restores_on_ray_and_back(parallel, on_ray, args, out, tmp_path, ["m0"])


def _restores_on_ray_and_back(parallel, on_ray, args, out, tmp_path, workers: list[str]) -> None:
    """`on_ray` (the same plan on Ray workers, named `workers`) restores the save made here in
    `tmp_path / "here"` to `out`, steps from it, and its save restores here."""
    try:
        on_ray.compile(*args)
        assert isinstance(on_ray.runtime, RayRuntime) and sorted(on_ray.runtime.actors) == workers
        from_here = on_ray.restore(tmp_path / "here")
        assert_trees_equal(jax.device_get(from_here), out)
        after = on_ray(*from_here[:2], args[2])
        on_ray.save(tmp_path / "ray")
        assert_trees_equal(parallel.restore(tmp_path / "ray"), jax.device_get(after))
    finally:
        on_ray.close()


def test_typed_keys_and_donation(tmp_path):
    w = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
    x = jnp.ones((8, 4), jnp.float32)
    key = jax.random.key(3)
    expected = jax.jit(keyed_step)(w, key, x)
    parallel = hlopar.parallelize(
        keyed_step,
        cluster=ONE_HOST,
        method="shard",
        batch_argnums=(2,),
        donate_argnums=(0,),
        runtime="process",
        verbose=False,
    )
    try:
        new, new_key, loss = parallel(w, key, x)
        assert isinstance(parallel.runtime, InProcessRuntime)
        assert w.is_deleted()  # donated, as jax.jit deletes it
        assert new_key.dtype == key.dtype and new_key.shape == ()  # jax's own key array
        np.testing.assert_array_equal(jax.random.key_data(new_key), jax.random.key_data(expected[1]))
        np.testing.assert_allclose(new["w"], expected[0]["w"], rtol=1e-6)
        np.testing.assert_allclose(float(loss), float(expected[2]), rtol=1e-6)
        again = jax.jit(keyed_step)(np.asarray(new["w"]), new_key, x)
        second = parallel(new["w"], new_key, x)
        assert new["w"].is_deleted()
        np.testing.assert_allclose(second[0]["w"], again[0]["w"], rtol=1e-6)
        np.testing.assert_array_equal(jax.random.key_data(second[1]), jax.random.key_data(again[1]))
        parallel.save(tmp_path / "saved")
        restored = parallel.restore(tmp_path / "saved")
        np.testing.assert_array_equal(jax.random.key_data(restored[1]), jax.random.key_data(second[1]))
        np.testing.assert_array_equal(restored[0]["w"], second[0]["w"])
    finally:
        parallel.close()


@pytest.fixture(scope="module")
def pipelined(mlp, tmp_path_factory):
    """The tiny MLP's "pipeline" plan on two simulated hosts (two meshes, two microbatches,
    1F1B), run in this process (a plan cache of the module's own)."""
    step, args, _ = mlp
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HLOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("hlopar-cache")))
        options = dict(
            cluster=TWO_HOSTS, method="pipeline", num_microbatches=2, schedule="1f1b", batch_argnums=(2,), verbose=False
        )
        parallel = hlopar.parallelize(step.step, **options)
        yield parallel, options
        parallel.close()


def test_a_pipelined_plan_runs_every_mesh_here(mlp, pipelined):
    """Two meshes and two microbatches: every mesh's stream of the schedule played here,
    each result on its own mesh's devices as its fragment makes it, no worker."""
    step, args, _ = mlp
    parallel, _ = pipelined
    first = parallel(*args)
    runtime = parallel.runtime
    assert isinstance(runtime, InProcessRuntime) and runtime.executable is None
    program = parallel.planned.program
    assert len(program.meshes) == 2 and program.microbatches == 2
    assert sorted(runtime.fragments) == sorted(f.name for f in program.fragments)
    leaves = jax.tree_util.tree_leaves(first)
    assert all(isinstance(x, jax.Array) for x in leaves)
    devices = jax.devices()
    for x, v in zip(leaves, program.results):
        mesh = program.values[v].mesh
        assert x.sharding.device_set == {devices[d] for d in program.devices[mesh]}
        assert x.sharding == runtime.made[v]
    assert_step_close(leaves, step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)
    # The reference reads them from the host: the state lives on two meshes' devices, which
    # one jax.jit computation does not take together (as jax's own arrays of two device sets).
    state = jax.device_get(first[:2])
    with pytest.raises(ValueError, match="incompatible devices"):
        step.jitted_step(first[0], first[1], args[2])
    second = parallel(first[0], first[1], args[2])  # passed back as they are
    assert_step_close(
        jax.tree_util.tree_leaves(second),
        step.jitted_step(*state, args[2]),
        state[0],
        rtol=RTOL,
        update_max_rtol=UPDATE_MAX_RTOL,
    )
    assert runtime.step_id == 2


def test_transfers_here_are_one_copy_each(mlp, pipelined, monkeypatch):
    """In this process a planned cross-mesh transfer is one device-to-device copy to where its
    reader reads it, not its unit ops one device at a time through the host (what the local
    executor does to prove plans; 8 ms a transfer here): the same values, none of those calls."""
    from hlopar.runtime import local_transport

    step, args, _ = mlp
    parallel, _ = pipelined
    planned = parallel(*args)  # planned and started
    assert any(t.plan is not None for t in parallel.planned.program.transfers)
    calls = []
    real = local_transport.run_planned_transfer
    monkeypatch.setattr(local_transport, "run_planned_transfer", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = parallel(*args)
    assert calls == []
    for x, y in zip(jax.tree_util.tree_leaves(planned), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_pipelined_save_restores_here_and_on_ray(mlp, pipelined, tmp_path, ray_cluster):
    """A save of the pipelined plan made here has the Ray workers' parts (one per mesh) and
    restores here bit for bit; the same plan on Ray workers restores it, and its save
    restores here."""
    step, args, _ = mlp
    parallel, options = pipelined
    out = parallel(*args)
    parallel.save(tmp_path / "here")
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["m0.npz", "m1.npz", "manifest.json"]
    restored = parallel.restore(tmp_path / "here")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(restored))
    assert_trees_equal(restored, out)
    assert [x.sharding for x in jax.tree_util.tree_leaves(restored)] == [
        x.sharding for x in jax.tree_util.tree_leaves(out)
    ]
    on_ray = hlopar.parallelize(step.step, runtime="ray", **options)
    _restores_on_ray_and_back(parallel, on_ray, args, out, tmp_path, ["m0", "m1"])


def test_what_cannot_run_here():
    w, x = jnp.ones((4, 3), jnp.float32), jnp.ones((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="runtime must be one of auto, ray, process, got 'thread'"):
        hlopar.parallelize(keyed_step, runtime="thread")
    more_devices = hlopar.parallelize(
        keyed_step,
        cluster=hlopar.Cluster.local(2, 8),
        method="shard",
        batch_argnums=(2,),
        runtime="process",
        verbose=False,
    )
    with pytest.raises(
        ValueError,
        match=r"keyed_step cannot run in this process \(runtime='process'\): this process's jax sees 8 cpu "
        r"device\(s\), the plan's meshes need 16",
    ):
        more_devices.compile(w, jax.random.key(0), x)
