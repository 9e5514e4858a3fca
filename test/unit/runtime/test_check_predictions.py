"""`tools/check_predictions.py` (issue 31 item 4): its rank correlation, what steps it takes,
and one quick run of a candidate list: every row has its plan, a measured time, and a
prediction where the plan has one."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from tools_module import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("check_predictions")


def test_spearman(tool):
    assert tool.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tool.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties take their average rank: ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3).
    assert tool.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert tool.spearman([1, 2], [2, 1]) is None and tool.spearman([1, 1, 1], [1, 2, 3]) is None


def test_steps_it_takes(tool, tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    def step(w, x, tokens):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2) + jnp.sum(tokens) * 0.0)(w)
        return w - 0.1 * g, loss

    exported = tmp_path / "exported.mlir"
    exported.write_text(jax.jit(step).lower(jnp.ones((4, 3)), jnp.ones((8, 4)), jnp.ones(8, jnp.int32)).as_text())
    fn, args, batch = tool.load_step(str(exported))
    assert batch == (1, 2) and [(a.shape, a.dtype) for a in args] == [
        ((4, 3), np.float32),
        ((8, 4), np.float32),
        ((8,), np.int32),
    ]
    assert 0.0 < float(np.std(args[0])) < 0.05 and not args[2].any()  # drawn floats, zero integers
    assert float(fn(*args)[-1]) == pytest.approx(float(step(*args)[-1]), rel=1e-6)
    stateless = tmp_path / "stateless.mlir"
    stateless.write_text(jax.jit(lambda x: jnp.sum(x)).lower(jnp.ones(3)).as_text())
    with pytest.raises(SystemExit, match="cannot tell its state from its batch"):
        tool.load_step(str(stateless))
    own = tmp_path / "mine.py"
    own.write_text(
        "import jax.numpy as jnp\n"
        "def make():\n"
        "    return {'step': lambda w, b: (w, w, jnp.sum(b)), 'args': (jnp.ones(2), jnp.ones(8)), 'batch_argnums': (1,)}\n"
    )
    fn, args, batch = tool.load_step(f"{own}:make")
    assert batch == (1,) and len(args) == 2 and float(fn(*args)[-1]) == 8.0


def test_the_jit_reference_feeds_back_the_state_before_the_batch(tool):
    """A step whose batch is its second argument (`TrainState`, batch), as Flax writes it:
    the jax.jit reference feeds back the one leading result, not two (a loss fed back as the
    batch failed the second step)."""
    import jax
    import jax.numpy as jnp

    def step(state, batch):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * g}, loss

    state, batch = {"w": jnp.ones((4, 3))}, {"x": jnp.ones((8, 4))}
    candidate = tool.jit_candidate(step, (state, batch), (1,), 2)
    candidate.measure(1, 2)
    expected = (state, batch)
    for _ in range(4):  # the first call, the warm-up and two timed steps
        expected = (step(*expected)[0], batch)
    assert jax.tree_util.tree_structure(candidate.args) == jax.tree_util.tree_structure(expected)
    np.testing.assert_allclose(candidate.args[0]["w"], expected[0]["w"], rtol=1e-6)


def test_calibrate_plans_with_this_machine_calibrated_as_the_cluster_now(tool, monkeypatch):
    """`--calibrate`: the cluster of `--cluster` calibrated at the start (a fresh
    measurement, not the cached `preset="calibrated"`), its preset file the one planned with."""
    from hlopar.runtime import calibrate as calibration

    asked = []

    def calibrate(cluster, *, output):
        asked.append((cluster.num_hosts, cluster.devices_per_host))
        Path(output).write_text("{}")

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    path = tool.calibrated_now("2x3")
    assert asked == [(2, 3)] and Path(path).read_text() == "{}" and path.endswith("calibrated-2x3.json")


@pytest.mark.heavy  # four plans planned, compiled and run: ~20 s on 2 cores
def test_a_quick_run(tool):
    args = argparse.Namespace(
        cluster="1x4",
        preset=None,
        microbatches=2,
        steps=1,
        warmup=0,
        rounds=1,
        stages=[2],
        schedules=["1f1b"],
    )
    result = tool.check_step("mlp:tiny", args)
    rows = {r["candidate"]: r for r in result["rows"]}
    assert list(rows) == ["auto", "2 stage(s) / 1f1b", "shard", "jax.jit data-parallel (4)"]
    assert rows["2 stage(s) / 1f1b"]["stages"] == 2 and rows["2 stage(s) / 1f1b"]["microbatches"] == 2
    assert all(r["measured_s"] > 0 for r in rows.values())
    assert rows["auto"]["predicted_s"] > 0 and rows["shard"]["predicted_s"] is None
    assert result["summary"]["auto_over_fastest"] >= 1.0
