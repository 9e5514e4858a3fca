"""The split step, planned into a pipeline on 2 hosts x 4 CPU devices and run under each
schedule's instruction streams, computes what the whole step computes on one device; with
backward weight delaying, each backward runs as its B and W fragments."""

from __future__ import annotations

import functools

import pytest
from microbatch_steps import RTOL, compare, run_pipeline, step_data

from hlopar.analysis.schedules import ACCUMULATE, FREE, RUN, get_schedule
from hlopar.codegen.pipeline_program import BACKWARD, FORWARD, WEIGHT, pipeline_program
from hlopar.runtime.local_executor import PipelinedStep

SCHEDULES = ["gpipe", "1f1b", "eager-1f1b", "eager-1f1b-wd", "zb-h1", "zb-h2"]
PLAN = "hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b num-hosts=2 devices-per-host=4 workers=1}"
# The U-Transformer's steps agree to 1e-6 relative (as under the schedules of several stages
# per mesh, test_virtual_stages.py); the others to microbatch_steps' RTOL.
MODEL_RTOL = {"u_transformer": 1e-6}


@functools.cache
def planned(model: str, microbatches: int):
    text = step_data(model)[0]
    return run_pipeline(text, f"hlopar-split-microbatches{{microbatches={microbatches}}},{PLAN}")


@functools.cache
def pipelined(model: str, microbatches: int, split: bool = False) -> PipelinedStep:
    """The planned step; `split`: its backwards as B and W fragments (for weight delaying)."""
    return PipelinedStep(pipeline_program(planned(model, microbatches), split_backward=split))


def cases(fast):
    for model in ("mlp", "gpt", "u_transformer"):
        for microbatches in (2, 4):
            marks = () if (model, microbatches) in fast else (pytest.mark.heavy,)
            yield pytest.param(model, microbatches, marks=marks, id=f"{model}-B{microbatches}")


@pytest.mark.parametrize("model, microbatches", list(cases({("mlp", 2), ("mlp", 4), ("gpt", 2)})))
def test_pipelined_step_matches_one_device(model, microbatches):
    step = pipelined(model, microbatches)
    arguments = step_data(model)[1]
    assert len(step.meshes) >= 2, "the plan does not pipeline: the test would prove less"
    assert sum(len(d) for d in step.mesh_devices.values()) == 8
    assert any(f.accumulate for f in step.fragments if f.role == "backward")
    for schedule in SCHEDULES:
        if get_schedule(schedule).split_backward:
            step = pipelined(model, microbatches, split=True)
            # The weight gradients are summed in W; B sums nothing here.
            assert {f.role for f in step.fragments if f.accumulate and f.role != FORWARD} == {WEIGHT}
        compare(model, step(arguments, schedule), rtol=MODEL_RTOL.get(model, RTOL))
        # Each mesh ran its stage's tasks in the schedule's order.
        runs = {}
        for line in step.last_log:
            ident, _, what = line.partition(" ")
            if what.startswith(RUN):
                runs.setdefault(ident.rpartition(":")[0], []).append(what.split()[1] + what.split()[2][3:])
        for mesh, stage in step.stage_of_mesh.items():
            expected = get_schedule(schedule).stage_tasks(len(step.meshes), stage, microbatches)
            assert runs[mesh] == [str(t) for t in expected], (schedule, mesh)


def test_weight_delaying_needs_split_backwards():
    with pytest.raises(ValueError, match="splits backwards into input and weight gradients"):
        pipeline_program(planned("mlp", 2)).streams("eager-1f1b-wd")


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_weight_delaying_streams_run_b_then_w(model):
    """Every (microbatch, stage) runs B and W once, W after its B; B names the stage's B
    fragments and W its W fragments; what B hands to W lives until W ran."""
    microbatches = 4
    program = pipeline_program(planned(model, microbatches), split_backward=True)
    streams = program.streams("eager-1f1b-wd")
    by_id = streams.by_id()
    assert program.split_backward and any(program.topology.carry_bytes)
    for stream in streams.streams:
        stage = stream.stage
        names = {
            role: tuple(f.name for f in program.fragments if f.stage == stage and f.role == role)
            for role in (BACKWARD, WEIGHT)
        }
        assert names[WEIGHT], "every stage has weight gradients"
        position = {inst.id: k for k, inst in enumerate(stream)}
        runs = {(i.kind, i.microbatch): i for i in stream if i.op == RUN}
        assert len(runs) == sum(i.op == RUN for i in stream) == 3 * microbatches
        for m in range(microbatches):
            b, w = runs["B", m], runs["W", m]
            assert b.executables == names[BACKWARD] and w.executables == names[WEIGHT]
            assert b.id in w.deps and position[b.id] < position[w.id]
            assert (f"carry.{m}", program.topology.carry_bytes[stage]) in b.allocates
            (free,) = [i for i in stream if i.op == FREE and i.buffer == f"carry.{m}"]
            assert [by_id[d] for d in free.deps] == [w]
            (acc,) = [i for i in stream if i.op == ACCUMULATE and i.microbatch == m]
            assert acc.deps == (w.id,)
    # The values B hands over are results of B and operands of W, on the same mesh (some W
    # need nothing from their B; at least one does).
    handed_bytes = 0
    for f in program.fragments:
        if f.role == WEIGHT:
            handed = [
                v
                for v in f.operands
                if program.values[v].producer is not None
                and program.fragments[program.values[v].producer].role == BACKWARD
            ]
            assert all(program.values[v].mesh == f.mesh for v in handed)
            assert sum(program.values[v].nbytes for v in handed) == program.topology.carry_bytes[f.stage]
            handed_bytes += sum(program.values[v].nbytes for v in handed)
    assert handed_bytes > 0


def test_planned_transfers_run_their_unit_ops():
    """After hlopar-cross-mesh-resharding, each SEND carries out the unit ops of the
    hlopar.cross_mesh_transfer ops it names (the sequential runner's transfer execution)."""
    text = step_data("mlp")[0]
    module = run_pipeline(
        text, f"hlopar-split-microbatches{{microbatches=2}},{PLAN},hlopar-cross-mesh-resharding{{devices-per-host=4}}"
    )
    step = PipelinedStep(module)
    transfers = step.program.transfers
    assert transfers and all(t.plan is not None and t.plan.ops for t in transfers)
    streamed = {t.name for t in transfers if t.streamed}
    assert streamed and streamed != {t.name for t in transfers}  # some move per microbatch, some once
    split = None  # one step read with its backwards split serves every split schedule
    for schedule in SCHEDULES:
        if get_schedule(schedule).split_backward:
            step = split = split or PipelinedStep(module, schedule)
            assert step.program.split_backward
        compare("mlp", step(step_data("mlp")[1], schedule))
        carried = {
            name.strip()
            for line in step.last_log
            if " SEND " in line
            for name in line.rsplit("[", 1)[1].rstrip("]").split(",")
        }
        assert carried == streamed
