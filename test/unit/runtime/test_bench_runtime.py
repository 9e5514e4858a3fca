"""`tools/bench_runtime.py --quick --json` (issue 18, item 4): one process measures `jax.jit`
on one device, data-parallel and with the "shard" plan's own shardings, the plan's fragments
chained in the process and as its one executable, and hlopar's "shard" plan, in this process
and on a Ray worker, from the same initial state; the rows say so in the
structure the docs cite, and every way trains the same (equal losses). About 45 s on an idle
2-core machine (70 s loaded): heavy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.heavy
def test_quick_benchmark_rows(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HLOPAR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_runtime.py"), "--quick", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["machine"]) == {"nproc", "cpu", "jax", "devices"} and report["machine"]["devices"] == 8
    assert (report["config"]["steps"], report["config"]["warmup"], report["config"]["rounds"]) == (2, 1, 1)
    rows = {r["way"]: r for r in report["rows"]}
    assert list(rows) == [
        "jit-1-device",
        "jit-data-parallel",
        "jit-plan-shardings",
        "fragments-shard-plan",
        "one-program-shard-plan",
        "hlopar-shard-1x8",
        "hlopar-shard-1x8-ray",
    ]
    for row in rows.values():
        assert row["step_s"] > 0 and len(row["steps_s"]) == 2 and row["first_call_s"] >= row["step_s"]
        assert row["ratio_to_jit"] == pytest.approx(row["step_s"] / rows["jit-1-device"]["step_s"], rel=1e-12)
        # The same training: after the same number of steps, the same loss.
        assert row["loss"] == pytest.approx(rows["jit-1-device"]["loss"], rel=1e-5)
    assert rows["jit-1-device"]["ratio_to_jit"] == 1.0
    assert "critical_s" not in rows["jit-1-device"]
    assert "shard_over_whole_plan" not in report["targets"]
    for way, runtime, workers, prefix in (
        ("hlopar-shard-1x8", "InProcessRuntime", 0, "shard"),
        ("hlopar-shard-1x8-ray", "RayRuntime", 1, "ray_shard"),
    ):
        shard = rows[way]
        assert (shard["method"], shard["cluster"], shard["meshes"], shard["runtime"], shard["workers"]) == (
            "shard",
            "1x8",
            {"m0": 8},
            runtime,
            workers,
        )
        assert "ratio_to_whole_plan" not in shard
        assert shard["ratio_to_plan_shardings"] == pytest.approx(shard["step_s"] / rows["jit-plan-shardings"]["step_s"])
        assert shard["ratio_to_data_parallel"] == pytest.approx(shard["step_s"] / rows["jit-data-parallel"]["step_s"])
        if workers:
            assert shard["executables_s"] > 0 and shard["critical_s"] > 0 and "dispatch_s" not in shard
        else:  # in process: no worker's step, the dispatch of a step not waited for
            assert 0 < shard["dispatch_s"] < shard["step_s"] and "critical_s" not in shard
        assert shard["ratio_to_fragments"] == pytest.approx(shard["step_s"] / rows["fragments-shard-plan"]["step_s"])
        assert shard["ratio_to_one_program"] == pytest.approx(
            shard["step_s"] / rows["one-program-shard-plan"]["step_s"]
        )
        for name, ratio in (
            ("plan_shardings", "ratio_to_plan_shardings"),
            ("fragments", "ratio_to_fragments"),
            ("one_program", "ratio_to_one_program"),
        ):
            target = report["targets"][f"{prefix}_over_{name}"]
            assert target == {"ratio": shard[ratio], "target": 1.05, "met": shard[ratio] <= 1.05}
