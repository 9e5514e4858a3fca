"""A step whose state is donated (`donate_argnums`) runs its update in place, pipelined.

The zoo's tiny GPT through `hlopar.parallelize` on 2 hosts x 4 CPU devices, two stages
(method="pipeline"), 2 microbatches, parameters and Adam state donated: every state operand
of each update fragment is donated to its new value (`codegen.pipeline_program`), each of
two steps equals one device's step from the same state to 1e-5 (the second: 3e-5 of a
leaf's largest update), the caller's donated arrays are deleted as `jax.jit` deletes them
(reading one raises), and on the workers the previous step's state, passed back, is consumed
by the update that replaces it (deleted during the step, not kept until the next call drops
it). The loss, not donated, stays readable. In this process (`runtime="auto"` on a local
cluster), the same plan consumes the caller's arrays of the previous step in its updates.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import ray
from numerics import assert_adam_step_close

import hlopar
from hlopar.models import get_train_step

CLUSTER = hlopar.Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu")

# 1F1B by default; the others (the update of one stage runs while the other stage still
# computes, with weight-gradient fragments in the stream for eager-1f1b-wd) are heavy.
SCHEDULES = [
    pytest.param("1f1b", "process"),
    pytest.param("1f1b", "ray"),
    pytest.param("gpipe", "ray", marks=pytest.mark.heavy),
    pytest.param("eager-1f1b-wd", "process", marks=pytest.mark.heavy),
]


def deleted_on_workers(parallel, step: int) -> dict[int, bool]:
    """Per result position of `step` the workers still keep: whether its array is deleted."""
    found = {}
    for actor in parallel.runtime.actors.values():
        found.update(
            ray.get(
                actor.__ray_call__.remote(
                    lambda worker: {r: value.is_deleted() for (s, r), value in worker.kept.items() if s == step}
                )
            )
        )
    return found


@pytest.mark.parametrize("schedule,runtime", SCHEDULES)
def test_donated_state_is_updated_in_place_and_equals_one_device(request, schedule, runtime):
    if runtime == "ray":
        request.getfixturevalue("ray_cluster")
    ts = get_train_step("gpt", "tiny")
    params = ts.init(jax.random.key(0))
    opt_state = ts.init_opt_state(params)
    batch = ts.make_batch(jax.random.key(1))
    reference = jax.jit(ts.step)
    want_first = reference(params, opt_state, batch)
    before = jax.tree_util.tree_map(np.asarray, params)
    num_state = len(jax.tree_util.tree_leaves((params, opt_state)))
    parallel = hlopar.parallelize(
        ts.step,
        cluster=CLUSTER,
        method="pipeline",
        num_microbatches=2,
        schedule=schedule,
        donate_argnums=(0, 1),
        runtime=runtime,
        verbose=False,
    )
    try:
        first = parallel(params, opt_state, batch)
        program = parallel.planned.program
        assert len(program.meshes) == 2
        updates = [f for f in program.fragments if f.role == "update"]
        donated = {f.operands[p] for f in updates for p in f.donated}
        assert donated == set(range(num_state))  # every leaf of the state, each by the update reading it
        assert all(r is not None for f in updates for r in f.donated.values())  # each into its new value
        for leaf in jax.tree_util.tree_leaves((params, opt_state)):
            assert leaf.is_deleted()
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(jax.tree_util.tree_leaves(params)[0])
        assert_adam_step_close(first, want_first, before, lambda tree: tree[0], rtol=1e-5)
        first_state = jax.tree_util.tree_map(np.asarray, first[:2])  # read before they are donated
        want_second = reference(*first_state, batch)  # one device's step from the same state

        second = parallel(first[0], first[1], batch)
        if runtime == "ray":
            kept = deleted_on_workers(parallel, 1)  # step 1's results: the state consumed by step 2's updates
        else:  # in this process, step 1's results are the caller's arrays, consumed by step 2's updates
            kept = {r: x.is_deleted() for r, x in enumerate(jax.tree_util.tree_leaves(first))}
        assert sorted(kept) == list(range(num_state + 1))
        assert all(kept[r] for r in range(num_state)) and not kept[num_state]  # the loss is not donated
        with pytest.raises(RuntimeError, match="has been deleted"):
            np.asarray(jax.tree_util.tree_leaves(first[0])[0])
        assert float(first[2]) == pytest.approx(float(want_first[2]), rel=1e-6)
        # From nonzero moments an entry whose gradients changed sign has a first moment that
        # cancels, which two microbatches' sums round differently from one device's: 3e-5 of
        # the leaf's largest update there (as test_scan_pipelines), 1e-5 of each entry.
        assert_adam_step_close(second, want_second, first_state[0], lambda tree: tree[0], rtol=1e-5, max_rtol=3e-5)
    finally:
        parallel.close()
