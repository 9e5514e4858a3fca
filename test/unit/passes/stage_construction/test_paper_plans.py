"""Plans look like the Alpa paper's (§8.1, §8.6): Wide-ResNet, whose layers are heterogeneous
(activations shrink while weights grow), gets uneven stages: different numbers of layers,
or different logical mesh shapes, per stage. Planning only, from abstract shapes, through
the command line (`tools/export_model.py`, `hlopar-opt`) as a user would run it.

WRN-4B is the paper's model for 16 GPUs (Table 8): on 2 p3.16xlarge hosts × 8 V100s,
clustered into 16 layers, it becomes 2 stages of 10 and 6 layers, the first planned on a
2x4 logical mesh and the second on 4x2 with weight-update sharding (the paper, on its
cluster and cost model: 3 stages on 4, 4 and 8 GPUs). The default `layers=auto` picks 2
layers for WRN-50, too coarse to show a slicing; 16 is the number of bottleneck blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from program_checks import HLOPAR_OPT, fragments

from hlopar.ir.module import parse_module

ROOT = Path(__file__).resolve().parents[4]


def plan(tmp_path: Path, model: str, config: str, clustering: str, stages: str) -> tuple[dict, list]:
    source = tmp_path / f"{model}-{config}.mlir"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "export_model.py"), model, config, "-o", str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = tmp_path / "stages.json"
    program = tmp_path / "program.mlir"
    pipeline = (
        f"builtin.module(hlopar-import,hlopar-cluster-operators{{{clustering}}},"
        f"hlopar-stage-construction{{schedule=1f1b {stages} report={report}}})"
    )
    proc = subprocess.run(
        [str(HLOPAR_OPT), str(source), "-p", pipeline, "-o", str(program)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(report.read_text()), fragments(parse_module(program.read_text()))


@pytest.mark.heavy
@pytest.mark.parametrize(
    "config, clustering, stages",
    [
        pytest.param("4B", "layers=16", "num-hosts=2 devices-per-host=8 preset=v100-p3.16xlarge", id="4B-2x8-v100"),
        pytest.param("250M", "layers=16", "num-hosts=2 devices-per-host=4", id="250M-2x4-cpu"),
    ],
)
def test_wide_resnet_gets_uneven_stages(tmp_path, config, clustering, stages):
    report, found = plan(tmp_path, "wide_resnet", config, clustering, stages)
    plan_text = [(s["layers"], s["submesh"], s["logical_shape"], s["intra_op"]) for s in report["stages"]]
    assert len(report["stages"]) >= 2, plan_text
    # The stages tile the layers, in order.
    assert report["stages"][0]["layers"][0] == 0 and report["stages"][-1]["layers"][1] == report["num_layers"] - 1
    for a, b in zip(report["stages"], report["stages"][1:]):
        assert b["layers"][0] == a["layers"][1] + 1
    counts = {s["layers"][1] - s["layers"][0] + 1 for s in report["stages"]}
    shapes = {(tuple(s["submesh"]), tuple(s["logical_shape"]), s["intra_op"]) for s in report["stages"]}
    assert len(counts) > 1 or len(shapes) > 1, f"every stage alike: {plan_text}"
    # Forward and backward of every stage on the stage's own mesh.
    for k in range(len(report["stages"])):
        mine = {f.origin for f in found if f.mesh == f"m{k}"}
        assert {f'[#mpmd.user_origin<"stage{k}">]', f'[#mpmd.user_origin<"stage{k}"(1)>]'} <= mine, mine
