"""`hlopar.parallelize` on Ray: the zoo's tiny models train through two Ray workers (2 hosts x
4 CPU devices, one worker per mesh, each with its own 4 CPU devices) and compute what
single-device JAX computes; a mesh spanning simulated hosts runs as one worker per host (a
multi-process jax runtime), pure sharding and pipelined; a killed worker makes the call
raise within 60 s and the next call works; a saved state restores.

Tolerances (`numerics`): parameter updates, Adam's moments and the loss to a relative RTOL,
updates whose gradient is rounding noise masked by the reference's first moment. After the
first step, an entry whose gradient is small next to its leaf's largest has an update that
rounding moves further: up to 2.2e-5 of the leaf's largest update (GPT, 1f1b and sharded over
both hosts), so updates get UPDATE_MAX_RTOL = 1e-4 of it (1e-7 for lr = 1e-3). Each step is
compared with one single-device step from the same inputs, and the loss curve with
single-device training from the start. A restore and a replay after it are compared exactly.

One Ray cluster for the module (Ray starts slowly on 2 cores); the costly cases are heavy.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
import ray
from numerics import assert_step_close, assert_trees_equal

import hlopar
from hlopar.models import get_train_step
from hlopar.runtime.remote_array import RemoteArray

CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")
FOUR_HOSTS = hlopar.Cluster.local(num_hosts=4, devices_per_host=2, device_kind="cpu")
RTOL = 1e-5
UPDATE_MAX_RTOL = 1e-4


def start(model: str):
    step = get_train_step(model, "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step, params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1))


def compare(actual, expected, params) -> None:
    """A step's outputs against one device's step from the same inputs (parameters `params`)."""
    assert_step_close(jax.tree_util.tree_leaves(actual), expected, params, rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL)


def only_batch_sent(parallel, state_leaves: int | None = None) -> None:
    """The state stayed on the workers: the driver sent the batch, and a copy of a state
    argument only to a worker other than the one that keeps it (a parameter read on two
    meshes)."""
    stats = parallel.last_stats
    kept = {i: mesh for mesh, args in stats.kept.items() for i in args}
    if state_leaves is not None:
        assert len(kept) == state_leaves
    batch_args = set(parallel.runtime.program.batch_args)
    for mesh, sent in stats.sent.items():
        for i in sent:
            assert i in batch_args or kept.get(i, mesh) != mesh, (mesh, i, stats.sent, stats.kept)


def train(model: str, steps: int, cluster=CLUSTER, **options) -> hlopar.api.ParallelizedFunction:
    """Trains `steps` steps through parallelize, checking each against single-device JAX."""
    step, params, state, batch = start(model)
    parallel = hlopar.parallelize(
        step.step, cluster=cluster, batch_argnums=(2,), runtime="ray", verbose=False, **options
    )
    p, s = params, state
    rp, rs = params, state
    try:
        for k in range(steps):
            out = parallel(p, s, batch)
            assert isinstance(out[2], RemoteArray)  # kept on the workers until read
            compare(out, step.jitted_step(p, s, batch), p)  # this step, from the same inputs
            rp, rs, rloss = step.jitted_step(rp, rs, batch)  # single-device training from the start
            np.testing.assert_allclose(float(out[2]), float(rloss), rtol=1e-5)
            p, s = out[0], out[1]
            if k:
                only_batch_sent(parallel, len(jax.tree_util.tree_leaves((params, state))))
    except BaseException:
        parallel.shutdown()
        raise
    return parallel


SCHEDULE_CASES = [
    pytest.param("mlp", "1f1b", id="mlp-1f1b"),
    pytest.param("mlp", "gpipe", id="mlp-gpipe"),
    pytest.param("mlp", "eager-1f1b", id="mlp-eager-1f1b"),
    pytest.param("mlp", "eager-1f1b-wd", id="mlp-eager-1f1b-wd"),
    pytest.param("mlp", "zb-h2", id="mlp-zb-h2"),  # ~5 s
    pytest.param(
        "gpt", "1f1b", id="gpt-1f1b", marks=pytest.mark.heavy
    ),  # pipelined GPTs run in the default suite in process
    pytest.param("gpt", "gpipe", id="gpt-gpipe", marks=pytest.mark.heavy),
    pytest.param("gpt", "eager-1f1b", id="gpt-eager-1f1b", marks=pytest.mark.heavy),
    pytest.param("gpt", "eager-1f1b-wd", id="gpt-eager-1f1b-wd", marks=pytest.mark.heavy),
    pytest.param("u_transformer", "1f1b", id="u_transformer-1f1b", marks=pytest.mark.heavy),
    pytest.param("u_transformer", "gpipe", id="u_transformer-gpipe", marks=pytest.mark.heavy),
    pytest.param("u_transformer", "eager-1f1b", id="u_transformer-eager-1f1b", marks=pytest.mark.heavy),
    pytest.param("gpt", "zb-h2", id="gpt-zb-h2", marks=pytest.mark.heavy),
    pytest.param("u_transformer", "interleaved-1f1b", id="u_transformer-interleaved-1f1b", marks=pytest.mark.heavy),
    pytest.param("u_transformer", "zb-v", id="u_transformer-zb-v", marks=pytest.mark.heavy),
]


@pytest.mark.parametrize("model, schedule", SCHEDULE_CASES)
def test_training_matches_one_device(ray_cluster, model, schedule):
    parallel = train(model, 3, num_microbatches=2, schedule=schedule)
    try:
        program = parallel.runtime.program  # 2 meshes of 4 (the U-Transformer: 4, of 1, 1, 2 and 4)
        meshes = len(program.meshes)
        assert meshes >= 2, "the plan does not pipeline: the test would prove less"
        assert sum(len(d) for d in program.devices.values()) == 8
        info = parallel.runtime.setup_info
        pids = {i["pid"] for i in info.values()}
        assert len(pids) == meshes and os.getpid() not in pids
        # each worker its own CPU devices, those of its mesh
        assert all(len(i["devices"]) == len(program.devices[n]) and i["platform"] == "cpu" for n, i in info.items())
        workers = parallel.last_stats.workers
        assert len(workers) == meshes and all(
            w["sent_bytes"] > 0 for w in workers.values()
        )  # activations and gradients crossed
    finally:
        parallel.shutdown()


COLLECTIVE_SCHEDULES = ("1f1b", "gpipe", "eager-1f1b", "eager-1f1b-wd", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v")
COLLECTIVE_CASES = [
    pytest.param("mlp", "1f1b", CLUSTER, id="mlp-1f1b"),
    pytest.param("mlp", "1f1b", FOUR_HOSTS, id="mlp-1f1b-mesh-across-hosts"),
    pytest.param("gpt", "eager-1f1b", CLUSTER, id="gpt-eager-1f1b"),
    *(
        pytest.param(model, schedule, CLUSTER, id=f"{model}-{schedule}", marks=pytest.mark.heavy)
        for model in ("gpt", "u_transformer")
        for schedule in COLLECTIVE_SCHEDULES
        if (model, schedule) != ("gpt", "eager-1f1b")
    ),
]


@pytest.mark.parametrize("model, schedule, cluster", COLLECTIVE_CASES)
def test_collective_transport_matches_one_device(ray_cluster, model, schedule, cluster):
    """transport="collective": every worker in one jax runtime (gloo between the processes),
    each unit op of a transfer (streamed, or a sum moved once) a collective of its devices' processes."""
    parallel = train(model, 3, cluster=cluster, num_microbatches=2, schedule=schedule, transport="collective")
    try:
        program = parallel.runtime.program  # 2 meshes (the U-Transformer: 4, or 2 of 2 stages each)
        assert len(program.meshes) >= 2, "the plan does not pipeline: the test would prove less"
        info = parallel.runtime.setup_info
        assert {i["transport"] for i in info.values()} == {"collective"}
        assert len({i["pid"] for i in info.values()}) == len(info) and os.getpid() not in {
            i["pid"] for i in info.values()
        }
        workers = parallel.last_stats.workers
        assert sum(w["collectives"] for w in workers.values()) > 0  # boxes went by collectives
        assert all(w["pull_s"] == 0 for w in workers.values())  # sums too: nothing through the object store
        assert all(w["sent_bytes"] > 0 for n, w in workers.items() if "@" not in n or n.endswith("@0"))
    finally:
        parallel.shutdown()


def local_gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.skipif(local_gpus() < 2, reason="needs at least 2 local GPUs (jax with CUDA)")
@pytest.mark.parametrize("transport", ["collective", "object-store"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_training_on_gpus_matches_one_device(ray_cluster, model, transport):
    """The same on GPUs: 2 simulated hosts, each worker its GPUs (CUDA_VISIBLE_DEVICES), the
    collective transport (NCCL, the GPU default) or the object store through host memory.
    FP32 matmuls at full precision on both sides, so TF32 does not hide a wrong result
    behind a loose tolerance. Never run (no machine with 2 GPUs); see docs/runtime.md."""
    gpus = local_gpus()
    cluster = hlopar.Cluster.local(num_hosts=2, devices_per_host=gpus // 2, device_kind="gpu")
    with jax.default_matmul_precision("highest"):
        parallel = train(model, 3, cluster=cluster, num_microbatches=2, schedule="eager-1f1b", transport=transport)
    try:
        assert {i["platform"] for i in parallel.runtime.setup_info.values()} == {"gpu"}
        assert {i["transport"] for i in parallel.runtime.setup_info.values()} == {
            "collective" if transport == "collective" else "ray-object-store"
        }
    finally:
        parallel.shutdown()


def assert_spanning_workers(parallel, mesh: str, hosts: int, devices: int) -> None:
    """`mesh` runs as one worker per host, each its own process with its own devices."""
    info = {n: i for n, i in parallel.runtime.setup_info.items() if i["mesh"] == mesh}
    assert sorted(info) == sorted(f"{mesh}@{i['host']}" for i in info.values()) and len(info) == hosts
    assert len({i["pid"] for i in info.values()}) == hosts and os.getpid() not in {i["pid"] for i in info.values()}
    assert all(len(i["devices"]) == devices for i in info.values())


@pytest.mark.parametrize("model, steps", [("mlp", 3), ("gpt", 2)])
def test_pure_sharding_spans_both_hosts(ray_cluster, model, steps):
    """One 2x4 mesh over both simulated hosts: two workers of 4 CPU devices, one jax runtime
    (the GPT plan shards over the host axis, so XLA's collectives cross the processes; in the
    default suite as the one cross-process collective plan, with 2 steps to keep it short)."""
    parallel = train(model, steps, method="shard", num_microbatches=2, schedule="1f1b")
    try:
        assert list(parallel.runtime.program.meshes) == ["m0"]
        assert_spanning_workers(parallel, "m0", 2, 4)
    finally:
        parallel.shutdown()


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt", marks=pytest.mark.heavy)])
def test_pipeline_with_a_mesh_across_hosts(ray_cluster, model):
    """4 hosts x 2 devices: the planner puts a stage on 3 hosts (MLP: 1x6 and 1x2 meshes, GPT:
    3x2 sharded and 1x2); unit ops go between the workers owning their devices."""
    parallel = train(model, 3, cluster=FOUR_HOSTS, num_microbatches=2, schedule="1f1b")
    try:
        program = parallel.runtime.program
        assert len(program.meshes) == 2, "the plan does not pipeline: the test would prove less"
        wide = max(program.meshes, key=lambda m: len(program.devices[m]))
        assert len(program.devices[wide]) == 6, "no mesh spans hosts: the test would prove less"
        assert_spanning_workers(parallel, wide, 3, 2)
        workers = parallel.last_stats.workers
        assert sum(w["sent_bytes"] for n, w in workers.items() if n.startswith(f"{wide}@")) > 0
        assert sum(w["sent_bytes"] for n, w in workers.items() if not n.startswith(f"{wide}@")) > 0
    finally:
        parallel.shutdown()


KILL_CASES = [
    pytest.param({}, "m0", "m1", id="two-meshes"),
    pytest.param({"method": "shard"}, "m0@1", "m0@0", id="mesh-across-hosts"),
    pytest.param({"transport": "collective"}, "m0", "m1", id="collective-transport"),
]


@pytest.mark.parametrize("options, victim, sleeper", KILL_CASES)
def test_a_killed_worker_raises_and_the_next_call_restarts(ray_cluster, tmp_path, options, victim, sleeper):
    """Kills `victim` while `sleeper` sleeps in its step; with a mesh across hosts, one
    process of the mesh's jax runtime dies and every worker of it is restarted."""
    step, params, state, batch = start("mlp")
    parallel = hlopar.parallelize(
        step.step,
        cluster=CLUSTER,
        num_microbatches=2,
        schedule="1f1b",
        batch_argnums=(2,),
        runtime="ray",
        verbose=False,
        **options,
    )
    try:
        first = parallel(params, state, batch)
        second = parallel(first[0], first[1], batch)
        parallel.save(tmp_path / "state")  # after the second step: a stale save would hold `first`
        jax.device_get(second)  # read: kept on the driver, so it survives the workers
        runtime = parallel.runtime
        pids = runtime.worker_pids()
        ray.get(runtime.actors[sleeper].debug_delay.remote(30.0))  # still asleep when the victim dies
        killer = threading.Timer(1.0, os.kill, (pids[victim], signal.SIGKILL))
        killer.start()
        clock = time.monotonic()
        with pytest.raises(hlopar.WorkerError, match="worker of mesh m0( \\(host 1\\))? died"):
            parallel(second[0], second[1], batch)
        assert time.monotonic() - clock < 60
        killer.join()
        assert not runtime.alive

        # What the dead workers held and was never read is gone (the loss, a scalar, came
        # with its step).
        with pytest.raises(RuntimeError, match="cannot be read: its workers were stopped"):
            np.asarray(jax.tree_util.tree_leaves(first[0])[0])
        np.testing.assert_allclose(float(first[2]), float(step.jitted_step(params, state, batch)[2]), rtol=RTOL)
        # The next call starts fresh workers (they no longer hold the state: what was read is sent again).
        third = parallel(second[0], second[1], batch)
        assert set(runtime.worker_pids().values()).isdisjoint(pids.values())
        compare(third, step.jitted_step(second[0], second[1], batch), second[0])

        # Restoring the save gives, bit for bit, the state after the second step, kept on the
        # workers; the step replayed from it gives what the step from `second` gave.
        restored = parallel.restore(tmp_path / "state")
        assert_trees_equal(restored, second)
        again = parallel(restored[0], restored[1], batch)
        only_batch_sent(parallel)
        assert_trees_equal(again, third)

        # A worker that stalls (alive, silent) is given up on at the deadline.
        runtime.timeout = 3.0
        ray.get(runtime.actors[victim].debug_delay.remote(30.0))
        clock = time.monotonic()
        with pytest.raises(hlopar.WorkerError, match="did not answer within 3 s"):
            parallel(again[0], again[1], batch)
        assert time.monotonic() - clock < 20 and not runtime.alive
    finally:
        parallel.shutdown()
