"""Memory of a step whose state is donated: the update holds the state once, in stage
construction's estimate and in the compiled fragments.

- Stage construction (`span_costs`, `layer_costs`): the update's phase of a one-layer SGD
  step with momentum is old state + gradients + new state undonated, old state + gradients
  donated (plus XLA's 8-byte result pointers), byte for byte.
- Codegen and the memory check (`pipeline_program`, `memory_check`): the tiny MLP planned
  on 2x4 with its state donated and not, the same plan; each update fragment donates every
  state operand into its new value, the predicted aliased bytes are the compiled ones and
  the state's tiles, and the compiled update is smaller by exactly them.
- What is not donated: an argument the step donates but returns unchanged is consumed by no
  fragment; run in one process, the other donated argument is deleted, it is not.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_updates_close

from hlopar.analysis.fragment_memory import TUPLE_POINTER_BYTES, io_tiles
from hlopar.api import Cluster, plan_step
from hlopar.ir.module import parse_module
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Pipeline

N, K, ROWS = 128, 64, 2
F32 = 4


def momentum_step(w, velocity, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    velocity = 0.9 * velocity + grad
    return w - 0.1 * velocity, velocity, loss


def stage_report(tmp_path: Path, donate: tuple[int, ...]) -> dict:
    abstract = (jax.ShapeDtypeStruct((N, K), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((ROWS, N), jnp.float32),)
    module = parse_module(jax.jit(momentum_step, donate_argnums=donate).lower(*abstract).as_text())
    report = tmp_path / f"stages{len(donate)}.json"
    Pipeline.parse(
        "builtin.module(hlopar-import,hlopar-stage-construction{schedule=1f1b num-hosts=1 devices-per-host=1 layers=1 "
        f"microbatches=1 report={report}}})",
        module.context,
    ).run(module, PassContext())
    return json.loads(report.read_text())


def test_update_phase_counts_donated_state_once(tmp_path):
    state = 2 * N * K * F32 + ROWS * N * F32  # w, velocity and the batch the layer reads
    gradients = N * K * F32
    new_state = 2 * N * K * F32
    pointers = 2 * TUPLE_POINTER_BYTES  # the update's two results
    (kept,) = stage_report(tmp_path, ())["stages"]
    (donated,) = stage_report(tmp_path, (0, 1))["stages"]
    assert kept["update_memory_bytes"] == state + gradients + new_state + pointers
    assert donated["update_memory_bytes"] == state + gradients + pointers
    assert kept["memory_bytes"] == kept["update_memory_bytes"]  # undonated, the update is the peak
    assert donated["memory_bytes"] > donated["update_memory_bytes"]  # donated, the backward is


@pytest.fixture(scope="module")
def mlp_plans():
    cluster = Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu").resolved()
    return {
        donate: plan_step(
            get_train_step("mlp", "tiny").lower(donate=donate), cluster, schedule="eager-1f1b", cache=False
        )
        for donate in (False, True)
    }


def test_update_fragments_take_the_donated_state_and_the_memory_check_agrees(mlp_plans):
    kept, donated = mlp_plans[False], mlp_plans[True]

    def layout(planned):
        return [(s["layers"], s["submesh"], s["logical_shape"], s["devices"]) for s in planned.plan["stages"]["stages"]]

    assert layout(kept) == layout(donated)
    memory = {
        donate: {f["fragment"]: f for f in json.loads((p.bundle / "memory.json").read_text())["fragments"]}
        for donate, p in mlp_plans.items()
    }
    program = donated.program
    assert [f.name for f in program.fragments] == [f.name for f in kept.program.fragments]
    updates = [f for f in program.fragments if f.role == "update"]
    assert len(updates) == 2
    for f in updates:
        values = program.values
        tiles = io_tiles(f.module)[0]
        state = [p for p, v in enumerate(f.operands) if values[v].argument is not None and not values[v].per_microbatch]
        assert sorted(f.donated) == state and None not in f.donated.values()
        assert f.text.count("tf.aliasing_output") == len(state)
        state_bytes = sum(tiles[p] for p in state)
        predicted, compiled = memory[True][f.name]["predicted"], memory[True][f.name]["compiled"]
        assert predicted["aliased"] == compiled["aliased"] == state_bytes > 0
        assert predicted["total"] == memory[False][f.name]["predicted"]["total"] - state_bytes
        assert compiled["total"] == memory[False][f.name]["compiled"]["total"] - state_bytes
        assert memory[False][f.name]["compiled"]["aliased"] == 0
    for f in program.fragments:
        if f.role != "update":
            assert not f.donated and memory[True][f.name]["compiled"] == memory[False][f.name]["compiled"]


def scaled_step(w, scale, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ (w * scale)) ** 2))(w)
    return w - 0.1 * grad, scale, loss


def test_a_donated_argument_returned_unchanged_is_not_consumed():
    """`scale` is donated but returned as it is (its result is its own buffer): no fragment
    consumes it, while `w` is updated in place; run in one process (`PipelinedStep`) on
    arrays laid out as the update reads them, `w`'s is deleted, `scale`'s kept, and the
    results are jax.jit's (the new `w` by update, `scale` exactly)."""
    from hlopar.runtime.local_executor import PipelinedStep

    shapes = [(N, K), (N, K), (ROWS * 2, N)]
    abstract = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    text = jax.jit(scaled_step, keep_unused=True, donate_argnums=(0, 1)).lower(*abstract).as_text()
    assert text.count("tf.aliasing_output") == 2
    cluster = Cluster.local(num_hosts=1, devices_per_host=2, device_kind="cpu").resolved()
    program = plan_step(text, cluster, num_microbatches=2, method="pipeline", cache=False).program
    (update,) = [f for f in program.fragments if f.role == "update"]
    assert {update.operands[p]: update.results[r] for p, r in update.donated.items()} == {0: program.results[0]}
    assert program.results[1] == 1  # scale: the argument itself
    step = PipelinedStep(program, "1f1b")
    keys = jax.random.split(jax.random.key(0), 3)
    arrays = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]
    want = jax.jit(scaled_step)(*arrays)
    executable = step.executables[update.name]
    # Buffers of their own (a device_put may share the source's, which XLA cannot take over).
    w, scale = (
        jax.jit(jnp.copy, out_shardings=executable.input_shardings[p])(arrays[update.operands[p]])
        for p in (update.operands.index(0), update.operands.index(1))
    )
    before = np.asarray(arrays[0])
    results = step.run([w, scale, np.asarray(arrays[2])])
    assert w.is_deleted() and not scale.is_deleted()
    assert_updates_close(results[0], want[0], before, rtol=1e-5, max_rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(results[1]), np.asarray(arrays[1]))
    np.testing.assert_allclose(float(results[2]), float(want[2]), rtol=1e-5)
