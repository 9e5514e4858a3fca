"""Each executable of a plan is compiled once over a whole first call (issue 28 item 1,
`codegen/executable_cache.py`): the memory check's compilation is the one the runtime runs,
in this process and on the local Ray workers, and a plan read from the plan cache by a new
function compiles nothing. Compilations are counted at hlopar's one call of XLA's compiler
(`codegen.spmd.compile_spmd`) in this process, and by the workers' own report of what they
compiled and loaded (`MeshWorker.setup`)."""

from __future__ import annotations

import jax
import pytest
from numerics import assert_step_close

import hlopar
from hlopar.codegen import executables as executables_module
from hlopar.models import get_train_step

RTOL = 1e-5  # as test_in_process.py and test_ray_runtime.py
UPDATE_MAX_RTOL = 1e-4


@pytest.fixture
def compilations(monkeypatch):
    """Module texts compiled by XLA in this process, in order."""
    from hlopar.ir.module import print_module

    compiled = []
    real = executables_module.compile_spmd

    def counted(module, devices, host_callbacks=()):
        compiled.append(print_module(module))
        return real(module, devices, host_callbacks)

    monkeypatch.setattr(executables_module, "compile_spmd", counted)
    return compiled


@pytest.fixture(scope="module")
def mlp():
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step, (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))


def test_in_process_compiles_the_plan_once_and_a_cached_plan_not_at_all(mlp, compilations, tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step, args = mlp
    cluster = hlopar.Cluster.local(1, 8, device_kind="cpu")
    with hlopar.parallelize(step.step, cluster=cluster, method="shard", batch_argnums=(2,), verbose=False) as first:
        out = first(*args)
        assert type(first.runtime).__name__ == "InProcessRuntime"
        # One executable (the plan as one program), compiled once: by the memory check,
        # then run as it is.
        assert len(compilations) == 1
        memory = first.planned.plan["memory"]["fragments"]
        assert [f["role"] for f in memory] == ["whole"] and memory[0]["compiled"] is not None
        counts = first.first_call.compilations
        assert counts == {memory[0]["fragment"]: {"compiled": 1, "loaded": 0, "reused": 1}}
        assert first.first_call.most_compilations() == 1
        # No picture nobody asked for (matplotlib, on every plan before).
        assert not (first.planned.bundle / "timeline.png").exists()
        assert (first.planned.bundle / "timeline.json").exists()
        assert_step_close(
            jax.tree_util.tree_leaves(out), step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL
        )
    # A new function (a new process would do the same): the plan from the plan cache, its
    # executable from the cache's disk; nothing compiled.
    with hlopar.parallelize(step.step, cluster=cluster, method="shard", batch_argnums=(2,), verbose=False) as second:
        again = second(*args)
        assert second.planned.cached and len(compilations) == 1
        assert list(second.first_call.compilations.values()) == [{"compiled": 0, "loaded": 1, "reused": 0}]
        assert [float(x) for x in jax.tree_util.tree_leaves(again)[-1:]] == [
            float(x) for x in jax.tree_util.tree_leaves(out)[-1:]
        ]


def test_ray_workers_load_what_planning_compiled(mlp, compilations, ray_cluster):
    """Two meshes on two local workers: each fragment compiled once, by the memory check;
    each worker loads its mesh's from the bytes the driver shipped. The same plan read from
    the plan cache by a new function compiles nothing, here or on its workers."""
    step, args = mlp
    cluster = hlopar.Cluster.local(2, 4, device_kind="cpu")
    options = dict(
        cluster=cluster, method="pipeline", num_microbatches=2, batch_argnums=(2,), runtime="ray", verbose=False
    )
    with hlopar.parallelize(step.step, **options) as first:
        out = first(*args)
        program = first.planned.program
        assert len(program.meshes) == 2
        assert sorted(compilations) == sorted(f.text for f in program.fragments)
        counts = first.first_call.compilations
        assert set(counts) == {f.name for f in program.fragments}
        assert all(c["compiled"] == 1 and c["loaded"] == 1 for c in counts.values()), counts
        assert_step_close(
            jax.tree_util.tree_leaves(out), step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL
        )
    compilations.clear()
    with hlopar.parallelize(step.step, **options) as second:
        second(*args)
        assert second.planned.cached and compilations == []
        counts = second.first_call.compilations
        assert all(c == {"compiled": 0, "loaded": 1, "reused": 0} for c in counts.values()), counts


def test_a_pipeline_in_process_runs_what_planning_compiled(mlp, compilations, tmp_path, monkeypatch):
    """Two meshes, two microbatches, in this process (a local cluster, `runtime="auto"`):
    each fragment compiled once, by the memory check, and run as it is; the same plan read
    from the plan cache by a new function loads each fragment and compiles nothing."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step, args = mlp
    cluster = hlopar.Cluster.local(2, 4, device_kind="cpu")
    options = dict(cluster=cluster, method="pipeline", num_microbatches=2, batch_argnums=(2,), verbose=False)
    with hlopar.parallelize(step.step, **options) as first:
        out = first(*args)
        assert type(first.runtime).__name__ == "InProcessRuntime"
        program = first.planned.program
        assert len(program.meshes) == 2 and program.microbatches == 2
        assert sorted(compilations) == sorted(f.text for f in program.fragments)
        counts = first.first_call.compilations
        assert counts == {f.name: {"compiled": 1, "loaded": 0, "reused": 1} for f in program.fragments}
        assert_step_close(
            jax.tree_util.tree_leaves(out), step.jitted_step(*args), args[0], rtol=RTOL, update_max_rtol=UPDATE_MAX_RTOL
        )
    compilations.clear()
    with hlopar.parallelize(step.step, **options) as second:
        again = second(*args)
        assert second.planned.cached and compilations == []
        counts = second.first_call.compilations
        assert counts == {f.name: {"compiled": 0, "loaded": 1, "reused": 0} for f in program.fragments}
        for x, y in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(out)):
            assert (x == y).all()  # the same executables on the same inputs
