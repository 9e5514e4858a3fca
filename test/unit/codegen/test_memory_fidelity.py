"""The planner's per-device memory of every fragment against XLA's (`codegen.memory_check`,
`analysis.fragment_memory`): each tiny zoo model planned on 2x4 as `hlopar.parallelize`
plans it, each fragment compiled once by the bundle writer; a plan that does not fit the
device memory is refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from hlopar.analysis.fragment_memory import fragment_memory, io_tiles
from hlopar.api import Cluster, plan_step
from hlopar.codegen.memory_check import check_memory
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.module import parse_module
from hlopar.models import get_train_step

CLUSTER = Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu").resolved()
MODELS = ("mlp", "gpt", "moe", "wide_resnet", "u_transformer")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """model -> (its PlannedStep, the bundle's memory.json), planned once per model."""
    cache = tmp_path_factory.mktemp("hlopar-cache")
    found = {}

    def plan(model: str):
        if model not in found:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("HLOPAR_CACHE_DIR", str(cache))
                # eager-1f1b, as before schedule="auto": the fragments measured are those of a pipeline.
                step = plan_step(get_train_step(model, "tiny").lower(), CLUSTER, schedule="eager-1f1b", cache=True)
            found[model] = step, json.loads((step.bundle / "memory.json").read_text())
        return found[model]

    return plan


# The Wide-ResNet's first stage of two (layers' plans with the new state tied to the old,
# issue 15) has a convolution backward that XLA:CPU compiles with 1.8x the temporaries the
# model counts (its relayout copies): 0.75x in all.
LOWEST_RATIO = {"wide_resnet": 0.75}


# The Wide-ResNet and the U-Transformer are heavy (18-30 s each on CI's 2 cores: its 35
# minutes); the default suite keeps the MLP, the GPT and the MoE.
@pytest.mark.parametrize(
    "model",
    [pytest.param(m, marks=[pytest.mark.heavy] if m in ("wide_resnet", "u_transformer") else []) for m in MODELS],
)
def test_every_fragment_within_20_percent_of_xla(planned, model):
    step, memory = planned(model)
    assert memory["skipped"] == {} and memory["platform"] == "cpu" and step.plan["memory"] == memory
    assert [f["fragment"] for f in memory["fragments"]] == [f.name for f in step.program.fragments]
    for f in memory["fragments"]:
        predicted, compiled = f["predicted"], f["compiled"]
        where = f"{model} {f['fragment']}: predicted {predicted}, compiled {compiled}"
        # Arguments, results and donated accumulators are the planner's layouts, tile for tile.
        for part in ("arguments", "outputs", "aliased"):
            assert predicted[part] == compiled[part], where
        assert LOWEST_RATIO.get(model, 0.8) <= predicted["total"] / compiled["total"] <= 1.2, where
        assert f["need"] == compiled["total"] + f["resident"]


@pytest.mark.parametrize("model", ("gpt", "moe", "u_transformer"))
def test_stage_construction_bounds_the_compiled_peak(planned, model):
    """Stage construction's memory for a stage (`span_costs`: the larger of the update's old
    state + gradients + new state and the forward/backward's state + accumulators + stashes
    + temporaries + what it receives and sends) against the most a compiled fragment of its
    mesh needs with what the schedule keeps resident: at least it (less 0.1%: u_transformer's
    m2 is 8 B short of 414 KB) and at most 1.15x (gpt's m1 is 1.10x: the layers' temporaries
    summed and the values crossing the stage counted whole). Not here: the MLP's m0, whose
    layers' plans split state that the stage's own plan keeps whole (0.74x), and the
    Wide-ResNet, whose backward XLA:CPU compiles with twice the temporaries the model counts
    (0.63x, 0.85x; docs/performance.md, "Memory estimates against XLA")."""
    _, memory = planned(model)
    for m in memory["meshes"]:
        assert 0.999 <= m["stage_construction"] / m["compiled_peak"] <= 1.15, (model, m)


def test_resident_bytes_are_state_sums_and_other_stashes(planned):
    """The MLP's first mesh: while its forward runs, the optimizer state (which only the
    update reads), the backward's gradient accumulators and the stashes of the other
    microbatches in flight stay resident; while its update runs, nothing else."""
    step, memory = planned("mlp")
    program = step.program
    resident = {f["fragment"]: f["resident"] for f in memory["fragments"]}
    forward, backward, update = (program.fragment(f"stage0_{role}") for role in ("forward", "backward", "update"))
    update_tiles = dict(zip(update.operands, io_tiles(update.module)[0]))
    optimizer_state = sum(
        n for v, n in update_tiles.items() if program.values[v].argument is not None and v not in forward.operands
    )
    backward_tiles = io_tiles(backward.module)[0]
    accumulators = sum(backward_tiles[: len(backward.accumulate)])
    stash = sum(
        n
        for v, n in zip(backward.operands, backward_tiles[len(backward.accumulate) :])
        if v in forward.results or program.values[v].per_microbatch and program.values[v].argument is not None
    )
    assert optimizer_state > 0 and accumulators > 0 and stash > 0
    in_flight = 3  # eager-1f1b, stage 0 of 2, 4 microbatches: at most 3 stashes at once on its stream
    assert resident["stage0_forward"] == optimizer_state + accumulators + stash * (in_flight - 1)
    assert resident["stage0_update"] == 0


def test_small_device_memory_refuses_the_plan(planned):
    step, memory = planned("mlp")
    need = max(f["need"] for f in memory["fragments"] if f["mesh"] == "m0")
    worst = max((f for f in memory["fragments"] if f["mesh"] == "m0"), key=lambda f: f["need"])
    with pytest.raises(DiagnosticError) as raised:
        check_memory(step.program, step.program.streams("eager-1f1b"), device_memory=need - 1)
    message = str(raised.value)
    assert f"fragment {worst['fragment']} on mesh m0 needs {need} B" in message
    assert f"the planner predicted {worst['predicted']['total'] + worst['resident']} B" in message
    assert f"a device has {need - 1} B" in message
    assert "mesh m1" not in message  # m1 fits
    check_memory(step.program, step.program.streams("eager-1f1b"), device_memory=need)


def test_hlopar_compile_refuses_what_stage_construction_let_through(tmp_path):
    """10000 B per device passes stage construction's estimate for the tiny MLP (8416 B on
    m0: its layers' plans split state that the stage's own plan keeps whole), not the
    compiled fragments (11380 B)."""
    source = tmp_path / "mlp.mlir"
    source.write_text(get_train_step("mlp", "tiny").lower())
    out = tmp_path / "bundle"
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "hlopar-compile"),
            str(source),
            "--num-hosts",
            "2",
            "--devices-per-host",
            "4",
            "--microbatches",
            "4",
            "--schedule",
            "1f1b",
            "--memory-per-device",
            "10000",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HLOPAR_DEBUG": ""},
    )
    error = done.stderr
    assert done.returncode == 1 and not out.exists(), error
    assert (
        f"{source}: error: the plan does not fit the devices' memory: fragment stage0_update on mesh m0 needs " in error
    ), error
    assert "a device has 10000 B (9.8 KiB)" in error and "Traceback" not in error


SHARDED = """
module {
  sdy.mesh @m = <["y"=4]>
  func.func @main(%acc: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {"y"}]>, tf.aliasing_output = 0 : i32},
                  %x: tensor<8x32xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {}]>},
                  %w: tensor<32x16xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {"y"}]>})
      -> (tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@m, [{}, {"y"}]>},
          tensor<8xf32> {sdy.sharding = #sdy.sharding<@m, [{}]>}) {
    %e = stablehlo.exponential %x {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}, {}]>]>} : tensor<8x32xf32>
    %t = stablehlo.tanh %e {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}, {}]>]>} : tensor<8x32xf32>
    %d = stablehlo.dot_general %t, %w, contracting_dims = [1] x [0] {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}, {"y"}]>]>} : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %n = stablehlo.negate %d {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}, {"y"}]>]>} : tensor<8x16xf32>
    %r = stablehlo.reduce(%n init: %z) applies stablehlo.add across dimensions = [1] {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}]>]>} : (tensor<8x16xf32>, tensor<f32>) -> tensor<8xf32>
    %s = stablehlo.add %acc, %d {sdy.sharding = #sdy.sharding_per_value<[<@m, [{}, {"y"}]>]>} : tensor<8x16xf32>
    return %s, %r : tensor<8x16xf32>, tensor<8xf32>
  }
}
"""


def test_prediction_of_a_small_module_and_its_compiled_memory():
    """Tiles of the planner's layouts; the elementwise chain feeding the matrix product is one
    buffer (tanh(exp(x)), 8x32 floats), the product another (8x4 per device), the negation
    fused into the reduction."""
    module = parse_module(SHARDED)
    predicted = fragment_memory(module)
    assert predicted.arguments == 8 * 4 * 4 + 8 * 32 * 4 + 32 * 4 * 4
    assert predicted.outputs == 8 * 4 * 4 + 8 * 4 + 2 * 8  # two results: XLA's tuple of two pointers
    assert predicted.aliased == 8 * 4 * 4
    assert predicted.temporaries == 8 * 32 * 4 + 8 * 4 * 4

    from hlopar.codegen.executables import compile_executable
    from hlopar.codegen.memory_check import compiled_memory

    compiled = compiled_memory(compile_executable(module, jax.devices()[:4]).spmd.executable)
    assert (compiled.arguments, compiled.outputs, compiled.aliased) == (
        predicted.arguments,
        predicted.outputs,
        predicted.aliased,
    )
    assert 0.8 <= predicted.total / compiled.total <= 1.2, (predicted, compiled)


def test_parallelize_refuses_a_plan_the_devices_cannot_hold(monkeypatch):
    """Through `hlopar.parallelize`: the preset's device memory (10000 B) passes stage
    construction's estimate and not the compiled fragments; refused while planning, before
    any worker starts."""
    import dataclasses

    import hlopar
    from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS

    monkeypatch.setitem(CLUSTER_PRESETS, "cpu", dataclasses.replace(CLUSTER_PRESETS["cpu"], device_memory_bytes=10000))
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    arguments = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    function = hlopar.parallelize(step.step, cluster=CLUSTER, cache=False, verbose=False)
    with pytest.raises(
        hlopar.api.PlanningError,
        match=r"fragment stage0_update on mesh m0 needs \d+ B .* a device "
        r"has 10000 B",
    ):
        function.plan(*arguments)
    assert function.runtime is None
