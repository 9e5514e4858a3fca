"""Planned pipelines of the zoo's training steps, run fragment by fragment, compute what one device does.

Each tiny model is planned for 2 hosts × 4 CPU devices by the passes themselves
(`hlopar-import, hlopar-cluster-operators, hlopar-stage-construction`, and the whole
`hlopar-auto-parallel`), then run by the sequential MPMD runner: each fragment on its
mesh's devices, each `mpmd.transfer` by copying, each `hlopar.cross_mesh_transfer` by
carrying out its unit ops device to device. The results are compared with the unpartitioned
step on one device by `numerics.assert_step_close` (parameter updates, Adam's moments and the
loss to a relative RTOL; updates whose gradient is rounding noise masked).

Every plan must pipeline: at least two meshes, forward and backward of each stage on one
mesh, every value read on another mesh than its own brought by a transfer. On the `cpu`
preset the DP splits mlp, gpt, moe and u_transformer by itself; Wide-ResNet's default
clustering gives 2 layers that the DP keeps on one 2x4 mesh, so it is clustered into 4 layers
(`layers=4`), which the DP splits into two stages of 4 devices.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from jaxlib.mlir import ir
from numerics import assert_step_close
from oracles.sequential_mpmd import SequentialMpmd, run_mpmd
from program_checks import PLANNED_TRANSFERS, check_program, crossings, fragments, main_func
from zoo_steps import tiny_step_data

from hlopar.analysis.mpmd import parse_topology
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline
from hlopar.runtime.local_transfer import TransferError

CLUSTER = "num-hosts=2 devices-per-host=4"
# Layers to cluster into, where the default does not pipeline (see the module docstring).
LAYERS = {"wide_resnet": 4}
RTOL = 1e-5


step_data = tiny_step_data


@functools.cache
def planned(model: str, whole: bool, tmp_dir: str) -> tuple[str, dict]:
    """The planned program's text and the pass's report."""
    text = step_data(model)[0]
    report = f"{tmp_dir}/{model}-{'auto' if whole else 'stages'}.json"
    layers = f"layers={LAYERS[model]}" if model in LAYERS else ""
    if whole:
        pipeline = f"builtin.module(hlopar-auto-parallel{{{CLUSTER} {layers} schedule=1f1b report={report}}})"
    else:
        pipeline = (
            f"builtin.module(hlopar-import,hlopar-cluster-operators{{{layers}}},"
            f"hlopar-stage-construction{{schedule=1f1b {CLUSTER} report={report}}})"
        )
    module = parse_module(text)
    Pipeline.parse(pipeline, module.context).run(module, PassContext())
    found = json.loads(Path(report).read_text())
    return print_module(module), (found["stages"] if whole else found)


def check_pipeline(module: ir.Operation, stages: dict, tmp_path, transfers) -> None:
    check_program(module, tmp_path, transfers)
    topology = parse_topology(str(main_func(module).attributes["topology"]))
    assert len(topology) >= 2, f"one mesh only: the plan does not pipeline ({stages['stages']})"
    assert len(topology) == len(stages["stages"])
    devices = ir.DictAttr(module.attributes["hlopar.devices"])
    for k, stage in enumerate(stages["stages"]):
        mesh = topology[f"m{k}"]
        assert list(mesh.shape) == stage["logical_shape"]
        assert list(ir.DenseI64ArrayAttr(devices[f"m{k}"])) == stage["devices"]
    # Forward and backward of every stage, both on the stage's mesh (check_program: never on two).
    found = fragments(module)
    for k in range(len(topology)):
        mine = {f.origin for f in found if f.mesh == f"m{k}"}
        assert f'[#mpmd.user_origin<"stage{k}">]' in mine, f"stage {k} has no forward fragment on m{k}"
        assert f'[#mpmd.user_origin<"stage{k}"(1)>]' in mine, f"stage {k} has no backward fragment on m{k}"
        assert all(f.stage in (k, None) for f in found if f.mesh == f"m{k}")
    # Every value read on another mesh than its own comes through a transfer from another mesh.
    for producer, source, mesh in crossings(module):
        assert producer in transfers and source != mesh, (producer, source, mesh)


def compare(model: str, outputs) -> None:
    _, _, params, reference = step_data(model)
    assert_step_close(outputs, reference, params, rtol=RTOL)


def cases(fast):
    for model in ("mlp", "gpt", "moe", "wide_resnet", "u_transformer"):
        yield pytest.param(model, marks=() if model in fast else (pytest.mark.heavy,), id=model)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reports"))


# The default suite runs the MLP and the GPT in both tests and the U-Transformer (skip
# connections across stages) planned end to end; -m heavy runs the rest (the MoE and the
# Wide-ResNet, 35-40 s each on CI's 2 cores; both run sharded in test_numerics.py).
@pytest.mark.parametrize("model", list(cases({"mlp", "gpt"})))
def test_stage_construction_matches_one_device(model, report_dir, tmp_path):
    text, report = planned(model, False, report_dir)
    module = parse_module(text)
    check_pipeline(module, report, tmp_path, ("mpmd.transfer",))
    assert '{"x"' in text or '{"y"' in text, "no stage shards anything: the test would prove less"
    compare(model, run_mpmd(module, step_data(model)[1]))


@pytest.mark.parametrize("model", list(cases({"mlp", "gpt", "u_transformer"})))
def test_auto_parallel_matches_one_device(model, report_dir, tmp_path):
    text, report = planned(model, True, report_dir)
    module = parse_module(text)
    check_pipeline(module, report, tmp_path, PLANNED_TRANSFERS)
    assert "mpmd.transfer" not in text, "every inter-mesh transfer is planned"
    runner = SequentialMpmd(module)
    kinds = [type(step).__name__ for step in runner.steps]
    assert "_Transfer" in kinds and "_Copy" not in kinds
    compare(model, runner(step_data(model)[1]))


def test_runner_checks_the_unit_ops(report_dir):
    """A planned transfer missing one of its unit ops leaves a destination shard incomplete."""
    text, _ = planned("mlp", True, report_dir)
    # The last unit op of a transfer that has several (the slots of the others stay in order).
    last = re.search(
        r'\n *"hlopar\.(broadcast|send_recv|scatter_allgather)"\(\)[^\n]*slot = [1-9][^\n]*(?=\n *\}\))', text
    )
    assert last is not None
    module = parse_module(text[: last.start()] + text[last.end() :])
    with pytest.raises(TransferError, match="missing"):
        run_mpmd(module, step_data("mlp")[1])
