"""`hlopar-compile` end to end: the zoo's tiny MLP (the bundled example) and GPT, planned for
2 hosts x 4 devices over 4 or 2 microbatches, written as a bundle (the MLP also with backward
weight delaying); every fragment module compiles for its mesh's devices, the streams read
back, and the bundle's program run by the pipelined executor computes what the whole step
computes on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from microbatch_steps import compare, step_data

from hlopar.analysis.schedules import RUN, SEND, get_schedule
from hlopar.codegen.bundle import read_streams
from hlopar.codegen.pipeline_program import pipeline_program
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.module import parse_module
from hlopar.models import get_train_step
from hlopar.runtime.local_executor import PipelinedStep

ROOT = Path(__file__).resolve().parents[3]
COMPILE = Path(sys.executable).parent / "hlopar-compile"
CASES = {"mlp": ("mlp", 4, "eager-1f1b"), "gpt": ("gpt", 2, "1f1b"), "mlp-wd": ("mlp", 2, "eager-1f1b-wd")}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    made = {}

    def make(case: str) -> Path:
        if case not in made:
            model, microbatches, schedule = CASES[case]
            root = tmp_path_factory.mktemp(f"compile-{case}")
            if model == "mlp":
                source = ROOT / "examples" / "mlp_train_step.mlir"
            else:
                source = root / f"{model}.mlir"
                source.write_text(get_train_step(model, "tiny").lower())
            out = root / "bundle"
            done = subprocess.run(
                [
                    str(COMPILE),
                    str(source),
                    "--num-hosts",
                    "2",
                    "--devices-per-host",
                    "4",
                    "--microbatches",
                    str(microbatches),
                    "--schedule",
                    schedule,
                    "-o",
                    str(out),
                ],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "HLOPAR_DEBUG": ""},
            )
            assert done.returncode == 0, done.stderr
            assert "Traceback" not in done.stderr
            assert sorted(p.name for p in root.iterdir()) == sorted(
                ["bundle"] + ([source.name] if model != "mlp" else [])
            )
            made[case] = out
        return made[case]

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_bundle_files(case, bundles):
    out = bundles(case)
    _, microbatches, schedule = CASES[case]
    split = get_schedule(schedule).split_backward
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pass"] == "hlopar-auto-parallel" and "split=true" in plan["options"]
    assert {"split", "clustering", "stages", "cross_mesh"} <= set(plan)
    assert plan["split"]["batch_args"] and plan["stages"]["microbatches"] == microbatches
    pipeline = json.loads((out / "pipeline.json").read_text())
    meshes = [m["mesh"] for m in pipeline["meshes"]]
    assert len(meshes) >= 2 and len(plan["stages"]["stages"]) == len(meshes)
    assert sorted(p.name for p in (out / "meshes").iterdir()) == sorted(meshes)
    for fragment in pipeline["fragments"]:
        assert (out / fragment["file"]).is_file(), fragment
        assert fragment["file"] == f"meshes/{fragment['mesh']}/{fragment['name']}.mlir"
    assert pipeline["split_backward"] == split
    assert {f["role"] for f in pipeline["fragments"]} == {"forward", "backward", "update"} | (
        {"weight"} if split else set()
    )
    assert pipeline["transfers"] and all(t["planned"] and t["predicted_time"] > 0 for t in pipeline["transfers"])
    # The simulated timeline as a trace; its picture only with --timeline-png (matplotlib
    # costs a second or two a plan: test_cli_messages.py draws it).
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]
    assert not (out / "timeline.png").exists()

    # The streams: text and JSON per mesh, the JSON the same as the program's streams.
    streams = read_streams(out)
    program = pipeline_program(parse_module((out / "program.mlir").read_text()), split_backward=split)
    assert streams == program.streams(schedule)
    for stream in streams.streams:
        text = (out / "meshes" / stream.mesh / "stream.txt").read_text()
        assert text.startswith(
            f"# schedule {schedule}, {microbatches} microbatches\nmesh {stream.mesh} (stage {stream.stage})"
        )
        assert f"RUN F mb=0 [stage{stream.stage}_forward]" in text
        if split:
            assert f"RUN W mb=0 [stage{stream.stage}_weight]" in text and "FREE carry.0" in text
        runs = [f"{i.kind}{i.microbatch}" for i in stream if i.op == RUN]
        tasks = get_schedule(schedule).stage_tasks(len(streams.streams), stream.stage, microbatches)
        assert runs == [str(t) for t in tasks]
        sends = [i for i in stream if i.op == SEND]
        assert sends and all(i.transfers for i in sends if i.nbytes)

    simulation = json.loads((out / "simulation.json").read_text())
    assert simulation["schedule"] == schedule and simulation["microbatches"] == microbatches
    assert simulation["iteration_time_s"] > 0 and 0 <= simulation["bubble_fraction"] < 1
    assert set(simulation["peak_memory_bytes"]) == set(meshes)
    assert all(simulation["peak_memory_bytes"][m] > 0 for m in meshes)
    latencies = [s["latency"] for s in plan["stages"]["stages"]]
    for stage, latency in zip(simulation["stages"], latencies):
        assert stage["forward_s"] + stage["backward_s"] == pytest.approx(latency)
        assert 0 < stage["forward_flops"] < stage["backward_flops"]
        if split:  # W's share of the backward is its share of the FLOPs
            assert 0 < stage["weight_flops"] <= stage["backward_flops"]
            assert stage["weight_s"] / stage["backward_s"] == pytest.approx(
                stage["weight_flops"] / stage["backward_flops"]
            )
        else:
            assert stage["weight_s"] is None and stage["weight_flops"] == 0
    assert simulation["sends"] and all(s["seconds"] > 0 for s in simulation["sends"])
    # Every RUN takes its time, so the step takes at least the busiest mesh's compute.
    assert simulation["iteration_time_s"] >= microbatches * max(latencies) * (1 - 1e-9)


@pytest.mark.parametrize("case", list(CASES))
def test_fragment_modules_compile(case, bundles):
    out = bundles(case)
    pipeline = json.loads((out / "pipeline.json").read_text())
    devices = {m["mesh"]: [jax.devices()[d] for d in m["devices"]] for m in pipeline["meshes"]}
    assert sorted(d.id for ds in devices.values() for d in ds) == list(range(8))
    for fragment in pipeline["fragments"]:
        module = parse_module((out / fragment["file"]).read_text())
        executable = compile_spmd(module, devices[fragment["mesh"]])
        assert len(executable.input_shardings) == len(fragment["accumulate"]) + len(fragment["operands"])


@pytest.mark.parametrize("case", list(CASES))
def test_bundle_program_matches_one_device(case, bundles):
    out = bundles(case)
    model, _, schedule = CASES[case]
    step = PipelinedStep(parse_module((out / "program.mlir").read_text()), schedule)
    compare(model, step(step_data(model)[1]))
    # The activations and gradients went through their planned unit ops.
    sent = [line for line in step.last_log if " SEND " in line and "[t" in line]
    assert sent and all(
        step.program.transfer(line.rsplit("[", 1)[1].rstrip("]").split(", ")[0]).plan is not None for line in sent
    )
