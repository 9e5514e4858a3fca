"""Rematerialization in stage construction (issue 15): what a layer's plan says about its
forward (the time a rematerialized stage pays again), a user's `jax.checkpoint` charged once,
and the pass's `remat` option marking backward fragments `hlopar.remat`."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jaxlib.mlir import ir
from zoo_steps import mlp_step

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, logical_mesh, write_preset
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.analysis.stages.layer_costs import kernel_counts, plan_layer
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, planned_functions, run_function_pass
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.pipeline import Pipeline

WIDTH, BATCH, LAYERS = 64, 32, 3
EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def _layer(w, h):
    return jnp.tanh(jnp.tanh(h @ w) @ w)


@functools.cache
def layer_plans(checkpointed: bool, shape: tuple[int, int] = (1, 2)):
    args = ([jnp.zeros((WIDTH, WIDTH))] * LAYERS, jnp.zeros((BATCH, WIDTH)), jnp.zeros((BATCH, WIDTH)))
    module = parse_module(jax.jit(mlp_step(_layer, checkpointed)).lower(*args).as_text())
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    graph = FuncGraph.from_module(module)
    with module.context, ir.Location.unknown():
        layering, _ = ClusterOperatorsPass(layers=LAYERS).cluster(graph)
        run_function_pass(module, [planned_functions(module)[0]], "sdy-populate-op-sharding-rules")
        rules = {op.id: rule_of(op.mlir_op) for op in graph.walk()}
    mesh = logical_mesh(shape, ("x", "y"))
    layers = [graph.subgraph([op.index for op in graph.ops if layering.layers[op.index] == l]) for l in range(LAYERS)]
    return module, [
        (plan_layer(layer, rules, layering.roles, mesh), kernel_counts(layer, layering.roles)) for layer in layers
    ]


def test_forward_share_and_kernels_of_a_layer():
    _, plans = layer_plans(False)
    for plan, _counts in plans:
        assert 0 < plan.forward_latency < plan.latency
        assert 0 <= plan.forward_fixed_latency <= plan.fixed_latency
    # Each block is two matmuls forward (the tanh fuses into them) and twice as many back.
    assert sum(counts["forward"][1] for _, counts in plans) == 2 * LAYERS
    assert sum(counts["backward"][1] for _, counts in plans) == 4 * LAYERS - 1  # no gradient for x
    assert all(counts["update"] == (0.0, 0.0) for _, counts in plans)


def test_a_users_checkpoint_is_charged_once():
    """With `jax.checkpoint` the backward already recomputes: its copy of the forward is
    backward time, its values are no stashed activations (only the checkpoint's residuals),
    and the forward share, what a rematerialized stage would pay again, is the twin's (on
    one device, where the two plan alike)."""
    _, plain = layer_plans(False, (1, 1))
    _, checked = layer_plans(True, (1, 1))
    total = lambda plans, field: sum(getattr(p, field) for p, _ in plans)  # noqa: E731
    assert total(checked, "activation_bytes") < total(plain, "activation_bytes")
    assert total(checked, "forward_latency") == pytest.approx(total(plain, "forward_latency"), rel=1e-9)
    assert total(checked, "latency") > total(plain, "latency")
    forward = lambda plans: sum(c["forward"][1] for _, c in plans)  # noqa: E731
    backward = lambda plans: sum(c["backward"][1] for _, c in plans)  # noqa: E731
    assert forward(checked) == forward(plain) and backward(checked) == backward(plain) + forward(plain)


def test_preset_overheads():
    v100 = CLUSTER_PRESETS["v100-p3.16xlarge"]
    assert v100.op_seconds(10, 4) == pytest.approx(10 * 5e-6 + 4 * 8e-6, rel=1e-12)
    assert v100.matmul_efficiency(v100.matmul_half_flops) == pytest.approx(0.5)
    assert v100.matmul_efficiency(2 * 1024**3) == pytest.approx(2 * 1024**3 / (2 * 1024**3 + 1e9), rel=1e-12)
    assert CLUSTER_PRESETS["cpu"].op_seconds(10, 4) == 0.0
    handing = dataclasses.replace(v100, value_launch_s=2e-6)
    assert handing.op_seconds(10, 4, 7) == v100.op_seconds(10, 4) + 7 * 2e-6
    assert CLUSTER_PRESETS["cpu"].op_seconds(10, 4, 7) == 0.0


def _mlp_plan(tmp_path, value_launch_s: float, microbatches: str = "auto", **preset_fields) -> dict:
    """The bundled MLP step's stage report with the `cpu` preset, a per-value launch and
    `preset_fields`."""
    name = f"values-{value_launch_s}-" + "-".join(f"{k}={v}" for k, v in sorted(preset_fields.items()))
    preset = write_preset(
        dataclasses.replace(CLUSTER_PRESETS["cpu"], name="values", value_launch_s=value_launch_s, **preset_fields),
        tmp_path / f"{name}.json",
    )
    report = tmp_path / f"mlp-{name}-{microbatches}.json"
    module = parse_module((EXAMPLES / "mlp_train_step.mlir").read_text())
    count = "" if microbatches == "auto" else f" split=true microbatches={microbatches}"
    Pipeline.parse(
        f"builtin.module(hlopar-auto-parallel{{num-hosts=2 devices-per-host=4 preset={preset} report={report}{count}}})",
        module.context,
    ).run(module, PassContext())
    return json.loads(report.read_text())["stages"]


def test_values_a_fragment_hands_over_are_priced_per_run(tmp_path):
    """Each value a fragment reads or writes costs `value_launch_s` a run (the runtime hands
    buffers over one by one): at a fixed plan the predicted step grows linearly in it, and
    its price moves the planner to fewer microbatches (fewer runs)."""
    plans = [_mlp_plan(tmp_path, v, microbatches="8") for v in (1e-5, 2e-5, 3e-5)]
    assert (
        len(
            {
                json.dumps([(s["layers"], s["submesh"], s["logical_shape"], s["intra_op"]) for s in p["stages"]])
                for p in plans
            }
        )
        == 1
    )
    steps = [p["predicted_step_seconds"] for p in plans]
    rise = steps[1] - steps[0]
    assert steps[2] - steps[1] == pytest.approx(rise, rel=1e-9)
    # A whole number of values a step: each run of each fragment hands its values over.
    assert rise / 1e-5 == pytest.approx(round(rise / 1e-5), abs=1e-6) and rise / 1e-5 >= 8 * 2
    chosen_free, chosen_priced = _mlp_plan(tmp_path, 0.0), _mlp_plan(tmp_path, 1e-5)
    assert chosen_priced["microbatches"] < chosen_free["microbatches"]


@functools.cache
def planned(remat: str, tmp_dir: str):
    module = parse_module(get_train_step("gpt", "tiny").lower())
    report = f"{tmp_dir}/stages-{remat}.json"
    Pipeline.parse(
        "builtin.module(hlopar-import,hlopar-cluster-operators,hlopar-stage-construction{schedule=1f1b "
        f"num-hosts=2 devices-per-host=4 microbatches=2 remat={remat} report={report}}})",
        module.context,
    ).run(module, PassContext())
    with open(report) as f:
        stages = json.load(f)["stages"]
    main = planned_functions(module)[0]
    fragments = [
        (str(op.operation.attributes["origin"]), "hlopar.remat" in op.operation.attributes)
        for op in main.regions[0].blocks[0].operations
        if op.operation.name == "mpmd.fragment"
    ]
    return stages, fragments


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("remat"))


def test_remat_always_marks_every_backward_fragment(tmp_dir):
    stages, fragments = planned("always", tmp_dir)
    assert len(stages) >= 2 and all(s["remat"] for s in stages)
    marked = [origin for origin, remat in fragments if remat]
    assert marked == [origin for origin, _ in fragments if '"(1)' in origin] and len(marked) == len(stages)


@pytest.mark.parametrize("remat", ["never", "auto"])
def test_no_mark_where_nothing_is_rematerialized(tmp_dir, remat):
    """On the cpu preset the tiny GPT fits with its activations: auto keeps them."""
    stages, fragments = planned(remat, tmp_dir)
    assert not any(s["remat"] for s in stages)
    assert not any(remat for _, remat in fragments)
    # Rematerializing costs time; it saves memory on the first stage, which keeps both
    # microbatches in flight (the last keeps one: there its stashed inputs cost more).
    always, _ = planned("always", tmp_dir)
    assert [s["layers"] for s in always] == [s["layers"] for s in stages]
    assert all(kept["latency"] < recomputed["latency"] for kept, recomputed in zip(stages, always))
    assert stages[0]["memory_bytes"] > always[0]["memory_bytes"]


def test_kernels_in_a_loop_count_once_per_trip():
    """The scanned GPT runs its blocks' matrix products inside `while` loops: as many as the
    unrolled one, once the trip counts are applied."""
    counts = []
    for name in ("tiny", "tiny-scan"):
        module = parse_module(get_train_step("gpt", name).lower())
        Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
        graph = FuncGraph.from_module(module)
        with module.context, ir.Location.unknown():
            layering, _ = ClusterOperatorsPass(layers=1).cluster(graph)
        counts.append(kernel_counts(graph.subgraph([op.index for op in graph.ops]), layering.roles))
    unrolled, scanned = counts
    assert [unrolled[role][1] for role in ("forward", "backward")] == [13.0, 26.0]
    assert [scanned[role][1] for role in ("forward", "backward")] == [13.0, 26.0]


def test_a_dear_transport_keeps_the_step_on_one_stage(tmp_path):
    """With the transport calibrated at a millisecond a value moved between meshes, the MLP's
    three stages (cheap links) become one: its microbatches would move their activations and
    gradients at every stage boundary."""
    assert len(_mlp_plan(tmp_path, 0.0, microbatches="2")["stages"]) > 1
    dear = _mlp_plan(tmp_path, 0.0, microbatches="2", transfer_latency_s=1e-3, transfer_bandwidth=5e9)
    assert len(dear["stages"]) == 1
