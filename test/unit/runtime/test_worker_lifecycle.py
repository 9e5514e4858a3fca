"""Workers share the machine (issue 18, item 3): a worker asks Ray for its devices' GPUs and a
hundredth of a core, so several parallelized functions live in one process (more workers
than the test cluster's 4 CPUs, which whole-core workers could not hold); `close()`, a `with`
block and garbage collection give back what they held; a placement the cluster can never
hold fails at once, saying what was asked and what exists; one that could become free is
waited for, a bounded time.

Each step is compared with single-device JAX from the same inputs (`numerics`, the
tolerances of test_ray_runtime.py).
"""

from __future__ import annotations

import gc
import time

import jax
import pytest
import ray
from numerics import assert_step_close

import hlopar
from hlopar.models import get_train_step
from hlopar.runtime.mesh_processes import worker_layout
from hlopar.runtime.ray_placement import WORKER_CPUS, Placement, unplaceable
from hlopar.runtime.ray_runtime import WorkerError

RTOL = 1e-5
UPDATE_MAX_RTOL = 1e-4


def mlp():
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step, (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))


def check_step(parallel, step, args):
    """One step through `parallel`, checked against one device's step; its outputs."""
    out = parallel(*args)
    assert_step_close(
        jax.tree_util.tree_leaves(out), step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL
    )
    return out


def cpus_held(before: dict) -> float:
    return round(before["CPU"] - ray.available_resources().get("CPU", 0.0), 4)


def wait_until_held(before: dict, cpus: float, seconds: float = 10.0) -> None:
    """Ray's view of free resources lags a kill by a moment: polls for `cpus` held."""
    deadline = time.monotonic() + seconds
    while cpus_held(before) != round(cpus, 4):
        assert time.monotonic() < deadline, f"{cpus_held(before)} CPU held, expected {cpus}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- no Ray


def test_what_a_worker_asks_for():
    layout = worker_layout({"m0": (0, 1, 2, 3), "m1": (4, 5, 6, 7), "m2": (2, 3, 4, 5)}, devices_per_host=4)
    cpu = Placement(layout, local=True, device_kind="cpu")
    # m2 spans both hosts: a worker per host; each host holds 2 workers.
    assert cpu.bundles() == [{"CPU": 2 * WORKER_CPUS}, {"CPU": 2 * WORKER_CPUS}] and cpu.strategy == "PACK"
    gpu = Placement(layout, local=False, device_kind="gpu")
    assert gpu.bundles() == [{"CPU": 2 * WORKER_CPUS, "GPU": 6.0}, {"CPU": 2 * WORKER_CPUS, "GPU": 6.0}]
    assert gpu.worker_resources("m2@1") == {"CPU": WORKER_CPUS, "GPU": 2.0} and gpu.strategy == "STRICT_SPREAD"
    assert gpu.describe().startswith("host 0: {CPU: 0.02, GPU: 6} for m0 (4 gpu devices), m2@0 (2 gpu devices);")


def test_what_can_never_be_placed():
    two_gpus, one_gpu = {"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}
    assert unplaceable([{"CPU": 0.01}] * 3, "PACK", [{"CPU": 2.0}]) is None
    assert unplaceable([{"CPU": 0.01}], "PACK", []) == "the Ray cluster has no alive node"
    assert unplaceable([{"GPU": 4.0}], "PACK", [two_gpus, two_gpus]) == "no node can hold host 0's workers ({GPU: 4})"
    assert unplaceable([{"GPU": 2.0}] * 2, "PACK", [two_gpus]) == "they need 4 GPU in all, the Ray cluster has 2"
    assert (
        unplaceable([{"CPU": 0.01}] * 2, "STRICT_SPREAD", [two_gpus])
        == "2 hosts need 2 distinct nodes, the Ray cluster has 1"
    )
    # A greedy choice (host 0 on the first node that fits) would fail; a matching does not.
    assert unplaceable([{"GPU": 1.0}, {"GPU": 2.0}], "STRICT_SPREAD", [two_gpus, one_gpu]) is None
    assert (
        unplaceable([{"GPU": 2.0}, {"GPU": 2.0}], "STRICT_SPREAD", [{"GPU": 4.0}, one_gpu, one_gpu])
        == "no 2 distinct nodes can hold one host's workers each"
    )
    assert unplaceable([{"GPU": 2.0}, {"GPU": 2.0}], "PACK", [{"GPU": 4.0}, one_gpu]) is None


# --------------------------------------------------------------------------- on Ray


def test_functions_share_the_machine_and_close_gives_back(ray_cluster):
    """Three functions (5 workers on a cluster of 4 CPUs) run, one closes, the others run on."""
    step, args = mlp()
    before = ray.available_resources()
    pipelined = hlopar.parallelize(
        step.step,
        cluster=hlopar.Cluster.local(2, 4),
        num_microbatches=2,
        schedule="1f1b",
        batch_argnums=(2,),
        runtime="ray",
        verbose=False,
    )
    one_mesh = hlopar.parallelize(
        step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", runtime="ray", verbose=False
    )
    across = hlopar.parallelize(
        step.step, cluster=hlopar.Cluster.local(2, 4), method="shard", runtime="ray", verbose=False
    )
    functions = (pipelined, one_mesh, across)
    try:
        outputs = [check_step(f, step, args) for f in functions]
        workers = [len(f.runtime.actors) for f in functions]
        assert workers == [2, 1, 2] and len(pipelined.runtime.program.meshes) == 2
        wait_until_held(before, 5 * WORKER_CPUS)
        one_mesh.close()
        assert not one_mesh.runtime.alive and one_mesh.runtime.group is None
        wait_until_held(before, 4 * WORKER_CPUS)
        for f, out in ((pipelined, outputs[0]), (across, outputs[2])):
            check_step(f, step, (out[0], out[1], args[2]))  # the second step, from the first's state
        check_step(one_mesh, step, args)  # a closed function starts its workers again
    finally:
        for f in functions:
            f.close()
    wait_until_held(before, 0.0)


def test_a_with_block_and_garbage_collection_give_back(ray_cluster):
    step, args = mlp()
    before = ray.available_resources()
    with hlopar.parallelize(
        step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", runtime="ray", verbose=False
    ) as f:
        check_step(f, step, args)
        wait_until_held(before, WORKER_CPUS)
        runtime = f.runtime
    assert not runtime.alive
    wait_until_held(before, 0.0)

    f = hlopar.parallelize(step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", runtime="ray", verbose=False)
    check_step(f, step, args)
    runtime = f.runtime
    wait_until_held(before, WORKER_CPUS)
    del f
    gc.collect()
    assert not runtime.alive
    wait_until_held(before, 0.0)


@pytest.mark.parametrize(
    "kind, hosts, message",
    [
        (
            "gpu",
            1,
            r"Ray can never place the workers: they need 8 GPU in all, the Ray cluster has 0\. "
            r"Asked: host 0: \{CPU: 0\.01, GPU: 8\} for m0 \(8 gpu devices\) \(STRICT_SPREAD: 1 distinct nodes, "
            r"one per host\); the cluster has 1 node\(s\): \{CPU: 4, GPU: 0\}",
        ),
        (
            "cpu",
            2,
            r"Ray can never place the workers: 2 hosts need 2 distinct nodes, the Ray cluster has 1\. "
            r"Asked: host 0: \{CPU: 0\.01\} for m0@0 \(4 cpu devices\); host 1: \{CPU: 0\.01\} for m0@1 "
            r"\(4 cpu devices\) \(STRICT_SPREAD: 2 distinct nodes, one per host\); the cluster has 1 node",
        ),
    ],
)
def test_an_impossible_cluster_is_refused_at_once(ray_cluster, kind, hosts, message):
    step, args = mlp()
    cluster = hlopar.Cluster(
        address=ray_cluster.address, num_hosts=hosts, devices_per_host=8 // hosts, device_kind=kind
    )
    f = hlopar.parallelize(step.step, cluster=cluster, method="shard", verbose=False)
    f.plan(*args)  # planned and cached: the call below times lowering, the cache and placement
    clock = time.monotonic()
    with pytest.raises(WorkerError, match=message):
        f(*args)
    assert time.monotonic() - clock < 10
    assert not f.runtime.alive


def test_what_could_become_free_is_waited_for_a_bounded_time(ray_cluster):
    step, args = mlp()
    hog = ray.util.placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
    ray.get(hog.ready(), timeout=30)
    f = hlopar.parallelize(
        step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", runtime="ray", timeout=3, verbose=False
    )
    try:
        f.plan(*args)
        clock = time.monotonic()
        with pytest.raises(
            WorkerError,
            match=r"Ray could not place the workers in 3 s: asked host 0: \{CPU: 0\.01\} "
            r"for m0 \(8 cpu devices\) \(PACK: on any nodes\); the cluster has "
            r"\{CPU: 4\}, of which \{CPU: 0\} is free .*close\(\)",
        ):
            f(*args)
        assert 3 <= time.monotonic() - clock < 10
    finally:
        ray.util.remove_placement_group(hog)
        f.close()
