"""Several stages per mesh, run: the tiny GPT cut into 4 stages, placed 2 per mesh as
interleaved 1F1B and ZB-V place them, computes on the local pipelined runtime what the
whole step computes on one device.

Stage construction does not place several stages per mesh yet (docs/stage_construction.md,
"Virtual stages"), so the program is a 4-stage plan on 4 one-device meshes whose meshes
are then merged two by two (`_merged`): what the stage DP would write, the hand-overs
between two stages of one mesh left as `mpmd.transfer`s from the mesh to itself."""

from __future__ import annotations

import functools

import pytest
from microbatch_steps import compare, run_pipeline, step_data

from hlopar.analysis.schedules import FREE, RECV, RUN, SEND, get_schedule
from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.ir.module import parse_module, print_module
from hlopar.runtime.local_executor import PipelinedStep

PLAN = (
    "hlopar-split-microbatches{microbatches=2},hlopar-cluster-operators{layers=4},"
    "hlopar-stage-construction{schedule=1f1b num-hosts=1 devices-per-host=4 stages=4 workers=1 plan-shardings=false}"
)
ONE_DEVICE = '<["x"=1, "y"=1]>'


@functools.cache
def _four_stages() -> str:
    return print_module(run_pipeline(step_data("gpt")[0], PLAN))


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
def test_two_stages_per_mesh_match_one_device(name):
    schedule = get_schedule(name)
    text = _four_stages()
    assert all(f'"m{k}"' in text for k in range(4)), "the plan is not 4 stages on 4 meshes"
    module = parse_module(_merged(text, schedule.placed(2, 2)))
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


@pytest.mark.heavy  # a Ray start (~30 s)
def test_two_stages_per_mesh_on_ray(ray_cluster):
    """The same interleaved program on Ray workers (one per mesh): SEND/RECV between workers,
    hand-overs inside one."""
    from hlopar.runtime.ray_placement import placement_of
    from hlopar.runtime.ray_runtime import RayRuntime

    schedule = get_schedule("interleaved-1f1b")
    program = pipeline_program(parse_module(_merged(_four_stages(), schedule.placed(2, 2))))
    runtime = RayRuntime(program, schedule.name, placement_of(program, 4, local=True, device_kind="cpu"))
    runtime.start()
    try:
        step, _ = runtime.run(step_data("gpt")[1])
        results = range(len(program.results))
        compare("gpt", runtime.fetch_finish(runtime.fetch_start(runtime.generation, step, results), "results"))
    finally:
        runtime.shutdown()
