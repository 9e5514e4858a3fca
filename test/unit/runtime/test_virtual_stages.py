"""Several stages per mesh, planned and run: stage construction with a schedule of chunks
(interleaved-1f1b, zb-v) cuts the tiny GPT into 4 stages, 2 per mesh, and the program runs
on the local pipelined runtime, on Ray, and through `parallelize`, computing what the whole
step computes on one device.

The program stage construction writes is checked against the shape codegen reads: a 4-stage
plan on 4 one-device meshes whose meshes are then merged two by two in the text (`_merged`),
the hand-overs between two stages of one mesh left as `mpmd.transfer`s from the mesh to
itself.

The tiny U-Transformer (a skip connection from stage 0 to stage 2) runs the same two
schedules on 2 hosts x 4 devices (`Cluster.local(2, 4)`'s mesh), its per-stage shardings
planned: its skip stays on one mesh under interleaved-1f1b and crosses meshes under ZB-V's V."""

from __future__ import annotations

import functools

import jax
import pytest
from microbatch_steps import compare, run_pipeline, step_data
from numerics import assert_step_close

import hlopar
from hlopar.analysis.schedules import FREE, RECV, RUN, SEND, get_schedule
from hlopar.api import describe_plan
from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.ir.module import parse_module, print_module
from hlopar.models import get_train_step
from hlopar.runtime.local_executor import PipelinedStep

PLAN = (
    "hlopar-split-microbatches{microbatches=2},hlopar-cluster-operators{layers=4},"
    "hlopar-stage-construction{schedule=SCHEDULE num-hosts=1 devices-per-host=DEVICES stages=4 workers=1 "
    "plan-shardings=false}"
)
ONE_DEVICE = '<["x"=1, "y"=1]>'
TWO_HOSTS = (
    "hlopar-split-microbatches{microbatches=4},hlopar-cluster-operators{layers=4},"
    "hlopar-stage-construction{schedule=SCHEDULE num-hosts=2 devices-per-host=4 stages=4 workers=1}"
)


@functools.cache
def _planned(schedule: str, devices: int) -> str:
    plan = PLAN.replace("SCHEDULE", schedule).replace("DEVICES", str(devices))
    return print_module(run_pipeline(step_data("gpt")[0], plan))


def _merged(text: str, placement: tuple[int, ...]) -> str:
    """The plan's stage k (on mesh m<k>) moved to mesh m<placement[k]>."""
    gone = [k for k in range(len(placement)) if k not in placement]
    for k in gone:
        text = text.replace(f', <"m{k}" : {ONE_DEVICE}>', "").replace(f"  sdy.mesh @m{k} = {ONE_DEVICE}\n", "")
        text = text.replace(f", m{k} = array<i64: {k}>", "")
    for k, mesh in enumerate(placement):
        text = text.replace(f'"m{k}"', f'"m{mesh}"')
    return text


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_stage_construction_writes_the_merged_program(name):
    """On 2 devices, exactly 4 stages: 2 meshes of one device, 2 chunks each, the layers cut
    as the 4-stage 1F1B plan on 4 devices cuts them (one each), and the program the text
    of that plan with its meshes merged as the schedule places the stages."""
    four = _planned("1f1b", 4)
    assert all(f'"m{k}"' in four for k in range(4)), "the plan is not 4 stages on 4 meshes"
    assert _planned(name, 2) == _merged(four, get_schedule(name).placed(2, 2))


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_two_stages_per_mesh_match_one_device(name):
    schedule = get_schedule(name)
    module = parse_module(_planned(name, 2))
    program = pipeline_program(module, split_backward=schedule.split_backward)
    assert program.stages_of_mesh == (
        {"m0": (0, 2), "m1": (1, 3)} if name == "interleaved-1f1b" else {"m0": (0, 3), "m1": (1, 2)}
    )
    topology = program.topology
    handed_over = [(e.src, e.dst) for e in topology.edges if topology.meshes[e.src] == topology.meshes[e.dst]]
    assert handed_over == ([(1, 2)] if name == "zb-v" else [])  # the V's turn, on mesh m1
    step = PipelinedStep(program, name)
    compare("gpt", step(step_data("gpt")[1]))
    streams = step.streams
    for stream in streams.streams:
        # Each mesh ran its tasks in the schedule's order, each RUN its own stage's fragments.
        runs = [i for i in stream if i.op == RUN]
        expected = schedule.mesh_tasks(2, 2, int(stream.mesh[1:]), 2)
        assert [(i.kind, i.microbatch, stream.stages[t.chunk]) for i, t in zip(runs, expected)] == [
            (t.kind, t.microbatch, i.stage) for i, t in zip(runs, expected)
        ]
        assert all(e.startswith(f"stage{i.stage}_") for i in runs for e in i.executables)
        assert all(i.executables for i in runs if i.kind == "F")
        # SEND/RECV only between meshes, carrying something; every stash freed.
        assert all(i.transfers and i.peer != stream.mesh for i in stream if i.op in (SEND, RECV))
        assert sum(1 for i in stream if i.op == FREE and ":stash." in i.buffer) == 2 * len(stream.stages)
    ran = [line.split(" ", 1)[1] for line in step.last_log]
    assert len(ran) == sum(len(s) for s in streams.streams)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_u_transformer_on_two_hosts_matches_one_device(name):
    """The tiny U-Transformer in 4 stages, 2 per mesh of one host's 4 devices: losses,
    parameters and Adam's moments equal to one device's step to 1e-6 relative (float32 sums
    of 4 microbatches and of 4-way sharded reductions, in another order than the whole
    batch's: 3e-7 fails on one entry of Adam's first moment), each mesh running its tasks in
    the schedule's order."""
    schedule = get_schedule(name)
    module = run_pipeline(step_data("u_transformer")[0], TWO_HOSTS.replace("SCHEDULE", name))
    program = pipeline_program(module, split_backward=schedule.split_backward)
    placed = {"m0": (0, 2), "m1": (1, 3)} if name == "interleaved-1f1b" else {"m0": (0, 3), "m1": (1, 2)}
    assert program.stages_of_mesh == placed
    assert {mesh: len(devices) for mesh, devices in program.devices.items()} == {"m0": 4, "m1": 4}
    topology = program.topology
    skips = {(e.src, e.dst) for e in topology.edges} - {(k, k + 1) for k in range(3)}
    assert skips == {(0, 2)}  # the U's skip, between the 4 clustered layers
    local = {(e.src, e.dst) for e in topology.edges if topology.meshes[e.src] == topology.meshes[e.dst]}
    assert local == ({(0, 2)} if name == "interleaved-1f1b" else {(1, 2)})  # the skip; the V's turn
    step = PipelinedStep(program, name)
    compare("u_transformer", step(step_data("u_transformer")[1]), rtol=1e-6)
    for stream in step.streams.streams:
        runs = [(i.kind, i.microbatch, i.stage) for i in stream if i.op == RUN]
        expected = schedule.mesh_tasks(2, 2, int(stream.mesh[1:]), 4)
        assert runs == [(t.kind, t.microbatch, stream.stages[t.chunk]) for t in expected], stream.mesh


@pytest.mark.heavy  # a Ray start (~30 s)
def test_two_stages_per_mesh_on_ray(ray_cluster):
    """The same interleaved program on Ray workers (one per mesh): SEND/RECV between workers,
    hand-overs inside one."""
    from hlopar.runtime.ray_placement import placement_of
    from hlopar.runtime.ray_runtime import RayRuntime

    schedule = get_schedule("interleaved-1f1b")
    program = pipeline_program(parse_module(_planned(schedule.name, 2)))
    runtime = RayRuntime(program, schedule.name, placement_of(program, 4, local=True, device_kind="cpu"))
    runtime.start()
    try:
        step, _ = runtime.run(step_data("gpt")[1])
        results = range(len(program.results))
        compare("gpt", runtime.fetch_finish(runtime.fetch_start(runtime.generation, step, results), "results"))
    finally:
        runtime.shutdown()


@pytest.mark.parametrize(
    "name, hosts, placed",
    [("interleaved-1f1b", 1, {"m0": (0, 2), "m1": (1, 3)}), ("zb-v", 2, {"m0": (0, 3), "m1": (1, 2)})],
)
def test_parallelize_plans_virtual_stages_equal_to_one_device(tmp_path, monkeypatch, name, hosts, placed):
    """`parallelize` with the schedule named, as a user calls it (the layers and the cut the
    planner's): the tiny GPT in 4 stages on 2 meshes of half the devices, stage k on the
    schedule's mesh, run in this process; parameters, optimizer state and loss equal to the
    single-device step (the tolerances of test_schedule_auto.py)."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step = get_train_step("gpt", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    cluster = hlopar.Cluster.local(hosts, 4, device_kind="cpu")
    parallel = hlopar.parallelize(step.step, cluster=cluster, schedule=name, num_microbatches=4, verbose=False)
    try:
        outputs = parallel(*args)
        planned = parallel.planned
        assert planned.schedule.name == planned.plan["stages"]["schedule"] == name
        assert planned.program.stages_of_mesh == placed
        assert [len(planned.program.devices[mesh]) for mesh in placed] == [2 * hosts, 2 * hosts]
        assert describe_plan(planned).startswith(f"plan: 4 stage(s) on 2 meshes, 4 microbatch(es), schedule {name}")
        assert_step_close(jax.tree_util.tree_leaves(outputs), step.jitted_step(*args), params, rtol=1e-5)
    finally:
        parallel.close()
