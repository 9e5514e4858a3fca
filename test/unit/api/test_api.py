"""What `hlopar.parallelize` does before any worker starts: the cluster description, planning
with its on-disk cache, the plain data each worker gets, placement (one worker per mesh and
host), the progress display. No Ray here."""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reordered_steps import reordered_step_text

import hlopar
from hlopar.api import Cluster, _key_data, describe_plan, plan_step
from hlopar.models import get_train_step
from hlopar.passes import planning
from hlopar.progress import Breakdown, Progress
from hlopar.runtime.ray_placement import placement_of
from hlopar.runtime.ray_worker import worker_programs
from hlopar.runtime.remote_array import jax_value

CLUSTER = Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu").resolved()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


def mlp_text() -> str:
    step = get_train_step("mlp", "tiny")
    return jax.jit(step.step, keep_unused=True).lower(*step.abstract_args()).as_text()


def test_local_cluster_defaults():
    cluster = Cluster.local()
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.device_kind) == (1, len(jax.devices()), "cpu")
    assert cluster.is_local and cluster.resolved().preset == "cpu"
    assert Cluster.local(num_hosts=2).devices_per_host == len(jax.devices()) // 2
    assert hlopar.Cluster is Cluster
    # A GPU cluster plans with a preset the cost model and the cross-mesh planner both know.
    from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS
    from hlopar.analysis.resharding import host_model_for

    gpu = Cluster.local(num_hosts=2, devices_per_host=4, device_kind="gpu").resolved()
    assert gpu.preset in CLUSTER_PRESETS and host_model_for(gpu.preset).devices_per_host == 8


def test_plans_are_cached_on_disk(cache):
    text = mlp_text()
    first = plan_step(text, CLUSTER, num_microbatches=2, schedule="1f1b", batch_args=[19, 20])
    assert not first.cached and first.bundle.parent == cache / "plans"
    assert (first.bundle / "pipeline.json").is_file() and (first.bundle / "meshes").is_dir()
    again = plan_step(text, CLUSTER, num_microbatches=2, schedule="1f1b", batch_args=[19, 20])
    assert again.cached and again.bundle == first.bundle
    assert again.program.summary() == first.program.summary()
    # Another schedule or cluster is another plan.
    other = plan_step(text, CLUSTER, num_microbatches=2, schedule="gpipe", batch_args=[19, 20])
    assert not other.cached and other.bundle != first.bundle
    assert "m0: stage 0" in describe_plan(first) and "(cached)" in describe_plan(again)
    # The compiled memory check's peaks, per mesh, read back from the cached plan too.
    memory = [line for line in describe_plan(again).splitlines() if "memory (compiled" in line]
    assert len(memory) == 1 and all(f"{m} " in memory[0] for m in again.program.meshes), describe_plan(again)


def _sgd(w, x, y):
    loss, grads = jax.value_and_grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)
    return w - 0.1 * grads, loss


def _sgd_text() -> str:
    return jax.jit(_sgd).lower(jnp.ones((16, 16)), jnp.ones((8, 16)), jnp.ones((8, 16))).as_text()


def test_default_microbatches_divide_the_batch(cache):
    planned = plan_step(mlp_text(), CLUSTER, schedule="1f1b", cache=False)
    assert planned.program.microbatches == 4  # batch 8, at most max(4, 2 x 2 hosts)
    assert len(planned.program.meshes) == 2  # pipelined: the count stays
    assert planned.program.batch_args == (19, 20)


def test_a_one_stage_plan_runs_one_microbatch_unless_one_needs_more_stages(cache, monkeypatch):
    """A plan that is one stage at hlopar's own count (4 here) and at one microbatch runs with
    one: microbatches would only add launches. One that needs more stages at one microbatch
    (as where one microbatch's activations do not fit) keeps the count."""
    logged: list[str] = []
    planned = plan_step(_sgd_text(), CLUSTER, schedule="1f1b", cache=False, log=logged.append)
    assert planned.program.microbatches == 1 and len(planned.program.meshes) == 1
    assert planned.plan["split"]["microbatches"] == 1
    assert any("one stage: planned with one microbatch, not the 4" in m for m in logged), logged
    assert planned.program.batch_args == (1, 2)

    run_passes = planning.run_passes

    def two_stages_at_one(step, cluster, **options):
        planned = run_passes(step, cluster, **options)
        if step.options.microbatches == 1:
            planned.reports["stages"]["stages"] *= 2
        return planned

    monkeypatch.setattr(planning, "run_passes", two_stages_at_one)
    planned = plan_step(_sgd_text(), CLUSTER, schedule="1f1b", cache=False)
    assert planned.program.microbatches == 4 and len(planned.program.meshes) == 1
    # A count the user gives is theirs.
    monkeypatch.setattr(planning, "run_passes", run_passes)
    assert plan_step(_sgd_text(), CLUSTER, num_microbatches=2, schedule="1f1b", cache=False).program.microbatches == 2


def test_bad_options_are_refused():
    step = get_train_step("mlp", "tiny").step
    with pytest.raises(ValueError, match="method must be one of"):
        hlopar.parallelize(step, method="magic")
    with pytest.raises(ValueError, match="schedule must be one of"):
        hlopar.parallelize(step, schedule="zigzag")
    with pytest.raises(ValueError, match="transport must be one of auto, object-store, collective"):
        hlopar.parallelize(step, transport="nccl")
    with pytest.raises(ValueError, match="runtime='process' has none"):
        hlopar.parallelize(step, transport="collective", runtime="process")
    assert hlopar.parallelize(step, transport="collective").runtime_kind == "ray"  # between workers


def test_worker_programs_and_placement(cache):
    planned = plan_step(mlp_text(), CLUSTER, num_microbatches=2, schedule="1f1b")
    program = planned.program
    programs = worker_programs(program, program.streams("1f1b"))
    assert set(programs) == set(program.meshes)
    # Every result comes from exactly one worker; every fragment is compiled by its mesh's.
    results = sorted(r for wp in programs.values() for r in wp.results)
    assert results == list(range(len(program.results)))
    for mesh, wp in programs.items():
        assert set(wp.texts) == {f.name for f in program.fragments if f.mesh == mesh}
        assert all(f.module is None for f in wp.program.fragments)  # plain data only
        assert {i.id.rpartition(":")[0] for i in wp.stream.instructions} == {mesh}
    assert set(program.batch_args) <= {i for wp in programs.values() for i in wp.arguments}

    # One worker per (mesh, host): a mesh inside a host is one worker, named as the mesh...
    placement = placement_of(program, 4, local=False, device_kind="cpu")
    assert {n: (s.mesh, s.host) for n, s in placement.workers.slots.items()} == {
        m: (m, program.devices[m][0] // 4) for m in program.meshes
    }
    # ...a mesh over two hosts (2 devices each) is two, each owning its host's devices.
    workers = placement_of(program, 2, local=False, device_kind="cpu").workers
    for mesh in program.meshes:
        slots = workers.of_mesh(mesh)
        assert [s.name for s in slots] == [f"{mesh}@{d // 2}" for d in program.devices[mesh][::2]]
        assert [s.process for s in slots] == [0, 1] and all(len(s.devices) == 2 for s in slots)
        assert sorted(d for s in slots for d in s.devices) == sorted(program.devices[mesh])
        assert all(workers.owner(mesh, d) == s.name for s in slots for d in s.devices)


@pytest.mark.parametrize("tty", [False, True])
def test_progress_shows_the_phases(tty):
    class Stream(io.StringIO):
        def isatty(self):
            return tty

    stream = Stream()
    progress = Progress(stream=stream)
    progress.phase("lowering")
    progress.message("lowered in 0.1 s")
    progress.phase("planning")
    progress.done()
    text = stream.getvalue()
    assert "hlopar: lowered in 0.1 s\n" in text
    if tty:  # one line, redrawn in place, cleared at the end
        assert "1/4 lowering" in text and "2/4 planning" in text and text.endswith("\r\x1b[K")
    else:
        assert text == "hlopar: lowering...\nhlopar: lowered in 0.1 s\nhlopar: planning...\n"
    silent = Stream()
    quiet = Progress(enabled=False, stream=silent)
    quiet.phase("lowering")
    quiet.message("x")
    quiet.done()
    assert silent.getvalue() == ""


def test_the_first_calls_breakdown_says_where_each_second_went():
    breakdown = Breakdown()
    breakdown.add("lowering", 1.0)
    breakdown.add("planning", 2.5, {"stage-construction": 2.0, "codegen": 0.5, "cross-mesh-resharding": 0.01})
    breakdown.add("starting the runtime", 3.0, {"worker processes": 2.5})
    breakdown.add("planning", 0.5)
    breakdown.compilations = {"a": {"compiled": 1, "loaded": 1, "reused": 0}, "b": {"compiled": 1, "loaded": 0}}
    assert breakdown.total == 7.0 and breakdown.seconds()["planning"] == 3.0
    assert breakdown.most_compilations() == 1
    assert breakdown.line() == (
        "first call 7.0 s: lowering 1.0; planning 2.5 (stage-construction 2.0, codegen 0.5); "
        "starting the runtime 3.0 (worker processes 2.5); planning 0.5; 2 executable(s): "
        "2 XLA compilation(s), 1 load(s), at most 1 compilation(s) of one"
    )


# --------------------------------------------------------------------------- the user's terms


def _sorts_the_batch(w, x, z):
    loss = jnp.mean(jnp.sort(x @ w, axis=0)[:2])  # a line the error must point at
    return loss, w


def _two_batches(w, x, z):
    return jnp.mean(x @ w) + jnp.mean(z @ w), w


def test_planning_errors_point_at_the_users_code_and_arguments():
    """A refusal names the user's source line (JAX's locations), the argument by its name
    and `parallelize`'s own argument that settles it, never a pass option."""
    cluster = Cluster.local(num_hosts=1, devices_per_host=2)
    args = (jnp.ones((4, 4)), jnp.ones((8, 4)), jnp.ones((6, 4)))
    sort_line = inspect.getsourcelines(_sorts_the_batch)[1] + 1
    with pytest.raises(hlopar.PlanningError) as refused:
        hlopar.parallelize(_sorts_the_batch, cluster=cluster, num_microbatches=2, cache=False, verbose=False).compile(
            *args
        )
    message = str(refused.value)
    assert message.startswith(f"hlopar cannot parallelize _sorts_the_batch ({__file__}:{sort_line - 1}):\n")
    assert f"\n{__file__}:{sort_line}:" in message and "'stablehlo.sort' moves data along the batch" in message

    with pytest.raises(hlopar.PlanningError) as ambiguous:
        hlopar.parallelize(_two_batches, cluster=cluster, num_microbatches=2, cache=False, verbose=False).compile(*args)
    message = str(ambiguous.value)
    assert "leading dim 6: argument 2 (z); leading dim 8: argument 1 (x)" in message
    assert "batch_argnums=..." in message and "batch-args" not in message and "\n-:" not in message


def test_typed_keys_cross_to_the_workers_as_their_words():
    key = jax.random.key(7)
    words = _key_data(key)
    assert words.dtype == jnp.uint32 and words.shape == (2,)
    back = jax_value(np.asarray(words), key.dtype)
    assert back.dtype == key.dtype and bool(jnp.all(jax.random.key_data(back) == words))
    np.testing.assert_array_equal(jax_value(np.arange(3), np.dtype("int64")), np.arange(3))


def test_the_plan_does_not_depend_on_the_order_of_arguments_and_results(cache):
    """The property test of `test_training_roles` (same roles whatever the order), carried to
    the plan: the step with its arguments and results reordered plans to the same stages,
    meshes, devices, predicted latency and split."""

    def summary(planned):
        stages = [{k: v for k, v in stage.items() if k != "latency"} for stage in planned.plan["stages"]["stages"]]
        latency = [stage["latency"] for stage in planned.plan["stages"]["stages"]]
        return stages, latency, planned.plan["split"]["ops"], planned.program.microbatches, planned.plan["warnings"]

    plans = [
        summary(
            plan_step(
                reordered_step_text(list(order), list(result_order)),
                CLUSTER,
                num_microbatches=2,
                schedule="1f1b",
                cache=False,
            )
        )
        for order, result_order in ((range(10), range(10)), (range(9, -1, -1), (3, 7, 1, 9, 0, 2, 4, 5, 6, 8)))
    ]
    (stages, latency, ops, microbatches, warned), (stages2, latency2, ops2, microbatches2, warned2) = plans
    assert stages == stages2 and ops == ops2 and microbatches == microbatches2 == 2 and warned == warned2 == []
    assert ops["step"] > 0 and ops["batch"] > 0  # the optimizer runs once, the model per microbatch
    np.testing.assert_allclose(latency, latency2, rtol=1e-12)


def _rbg_dropout(w, x, key):
    h = x @ w
    keep = jax.random.bernoulli(key, 0.5, h.shape)  # `rbg` keys draw with rng_bit_generator
    return jnp.mean(jnp.where(keep, h, 0.0) ** 2), w


def test_whole_shape_generators_need_the_users_consent(cache):
    """A generator whose bits depend on the whole batch's shape cannot give a microbatch its
    rows: refused, naming random numbers and `rng`; with rng="per-microbatch" planned, and
    the pass's warning reaches the user as an HloparWarning at their source line."""
    cluster = Cluster.local(num_hosts=1, devices_per_host=2)
    args = (jnp.ones((4, 4)), jnp.ones((8, 4)), jax.random.key(0, impl="rbg"))
    line = inspect.getsourcelines(_rbg_dropout)[1] + 2
    with pytest.raises(hlopar.PlanningError, match=r'random[\s\S]*rng="per-microbatch"'):
        hlopar.parallelize(_rbg_dropout, cluster=cluster, num_microbatches=2, verbose=False).plan(*args)
    with pytest.warns(hlopar.HloparWarning) as warned:
        planned, _ = hlopar.parallelize(
            _rbg_dropout, cluster=cluster, num_microbatches=2, rng="per-microbatch", verbose=False
        ).plan(*args)
    assert planned.program.microbatches == 2
    messages = [str(w.message) for w in warned]
    assert len(messages) == 1 and messages[0].startswith(f"{__file__}:{line}:") and "per microbatch" in messages[0]
    with pytest.raises(ValueError, match="rng must be one of"):
        hlopar.parallelize(_rbg_dropout, rng="sometimes")


def _worst_example(ws, x, y):
    def loss_fn(ws):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.max((h - y) ** 2)  # a maximum over the batch: not a sum of microbatches'

    loss, grads = jax.value_and_grad(loss_fn)(ws)
    return ws - 0.1 * grads, loss


def test_hlopars_own_microbatch_count_falls_back_to_one_where_the_split_is_refused(cache):
    """A split the user did not ask for is not worth a refusal: with `num_microbatches`
    left to hlopar (and a schedule given: the policy's count of 4 split first), a step the
    split refuses (here a loss that is the maximum over the batch) is planned with one
    microbatch, and a warning says why at the user's line. A number the user gave is refused
    as before."""
    cluster = Cluster.local(num_hosts=1, devices_per_host=2)
    args = (jnp.ones((3, 4, 4)), jnp.ones((8, 4)), jnp.ones((8, 4)))
    with pytest.warns(hlopar.HloparWarning) as warned:
        planned, _ = hlopar.parallelize(_worst_example, cluster=cluster, schedule="1f1b", verbose=False).plan(*args)
    assert planned.program.microbatches == 1
    messages = [str(w.message) for w in warned]
    assert len(messages) == 1 and messages[0].startswith(f"{__file__}:")
    assert "can only sum" in messages[0] and "planned with one microbatch (num_microbatches=1)" in messages[0]
    with pytest.raises(hlopar.PlanningError, match="can only sum"):
        hlopar.parallelize(_worst_example, cluster=cluster, num_microbatches=2, verbose=False).plan(*args)


def test_a_faster_count_the_split_refuses_leaves_the_whole_batch_with_a_warning(cache, monkeypatch):
    """With schedule=auto the batch is planned whole first; where another count is priced
    faster (made so here) and the split refuses it, the whole batch's plan stays and a
    warning says why at the user's line, naming the count hlopar would have chosen."""
    from hlopar.passes import planning

    run_passes = planning.run_passes

    def two_priced_faster(step, cluster, **options):
        planned = run_passes(step, cluster, **options)
        if options.get("other_microbatches"):
            choice = planned.reports["stages"]["schedule_choice"]
            choice["better_microbatches"] = {**choice["chosen"], "microbatches": 2}
        return planned

    monkeypatch.setattr(planning, "run_passes", two_priced_faster)
    cluster = Cluster.local(num_hosts=1, devices_per_host=2)
    args = (jnp.ones((3, 4, 4)), jnp.ones((8, 4)), jnp.ones((8, 4)))
    with pytest.warns(hlopar.HloparWarning) as warned:
        planned, _ = hlopar.parallelize(_worst_example, cluster=cluster, verbose=False, cache=False).plan(*args)
    assert planned.program.microbatches == 1
    messages = [str(w.message) for w in warned]
    assert len(messages) == 1 and messages[0].startswith(f"{__file__}:")
    assert "can only sum" in messages[0]
    assert "not split into the 2 microbatches hlopar would have chosen" in messages[0]


def test_the_number_of_stages_is_an_option(cache):
    """`stages=S`: exactly S stages (Alpa's manual stage count), where the planner alone cuts
    this step otherwise; keyed in the plan cache; refused with method "shard" (one stage)."""
    chosen = plan_step(mlp_text(), CLUSTER, schedule="1f1b", num_microbatches=2)
    assert len(chosen.program.meshes) == 2  # 1 and 3 below are the option's
    for stages in (1, 2, 3):
        step = get_train_step("mlp", "tiny")
        fn = hlopar.parallelize(step.step, cluster=CLUSTER, stages=stages, schedule="1f1b", num_microbatches=2)
        planned, _ = fn.plan(*step.abstract_args())
        assert len(planned.program.meshes) == len(planned.plan["stages"]["stages"]) == stages
        assert fn.options.cache_key()["stages"] == stages
    step = get_train_step("mlp", "tiny")
    fn = hlopar.parallelize(step.step, cluster=CLUSTER, stages=4, schedule="1f1b", num_microbatches=2)
    with pytest.raises(hlopar.PlanningError, match="4 stages: between 1 and 3 here \\(3 layers, 8 devices\\)"):
        fn.plan(*step.abstract_args())
    with pytest.raises(ValueError, match="stages=2 needs method 'auto' or 'pipeline'"):
        hlopar.parallelize(get_train_step("mlp", "tiny").step, method="shard", stages=2)
    with pytest.raises(ValueError, match="stages"):
        hlopar.parallelize(get_train_step("mlp", "tiny").step, stages=0)


def test_hosts_may_stay_idle_where_that_is_faster(cache):
    """`idle_hosts=True` with a calibration whose links across hosts are 250x slower than
    inside one (test/lit's slow_links.json): the tiny MLP is pipelined on host 0's devices
    alone, host 1 idle, and its step equals one device's; without the option every device is
    used. Keyed in the plan cache; refused with method "shard" (one mesh of every device)."""
    from numerics import assert_step_close

    slow = Path(__file__).parents[2] / "lit" / "stage-construction" / "Inputs" / "slow_links.json"
    cluster = hlopar.Cluster.local(2, 4, device_kind="cpu", preset=str(slow))
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    everywhere = hlopar.parallelize(step.step, cluster=cluster, num_microbatches=2, verbose=False)
    used = {d for devices in everywhere.plan(*args)[0].program.devices.values() for d in devices}
    assert used == set(range(8))
    fn = hlopar.parallelize(step.step, cluster=cluster, num_microbatches=2, idle_hosts=True, verbose=False)
    planned, _ = fn.plan(*args)
    assert planned.plan["stages"]["cluster"]["hosts_used"] == 1
    assert {d for devices in planned.program.devices.values() for d in devices} <= set(range(4))
    assert fn.options.cache_key()["idle_hosts"] is True and "idle_hosts" not in everywhere.options.cache_key()
    out = fn(*args)
    assert_step_close(jax.tree_util.tree_leaves(out), step.jitted_step(*args), params, rtol=1e-5, update_max_rtol=1e-4)
    with pytest.raises(ValueError, match="idle_hosts needs method 'auto' or 'pipeline'"):
        hlopar.parallelize(step.step, method="shard", idle_hosts=True)
