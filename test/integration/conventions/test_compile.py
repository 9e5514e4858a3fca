"""The conventions suite's steps exported as a user would (`jax.jit(step).lower(...).as_text()`)
and planned by `hlopar-compile` for 2 hosts x 4 devices: the bundle is written and the plan
has stages. No Ray, nothing runs; numerics are `test_parallelize.py`'s."""

from __future__ import annotations

import json

import jax
import pytest
from steps import CASES

from hlopar.cli.compile import main


@pytest.mark.parametrize("name", list(CASES))
def test_exported_step_compiles(tmp_path, capfd, monkeypatch, name):
    monkeypatch.setenv("HLOPAR_NO_FORK", "1")  # in this process: no fork of a multithreaded jax
    case = CASES[name]()
    if not case.exported:
        pytest.skip("jax.jit exports it only through parallelize (non-array leaves, or the loss not returned)")
    source = tmp_path / f"{name}.mlir"
    source.write_text(jax.jit(case.step).lower(*case.args).as_text())
    bundle = tmp_path / "bundle"
    status = main(
        [
            str(source),
            "--num-hosts",
            "2",
            "--devices-per-host",
            "4",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
            "-o",
            str(bundle),
        ]
    )
    err = capfd.readouterr().err
    assert status == 0, err
    if case.microbatch_semantics:  # said once, as a warning diagnostic at the user's line
        assert err.count("per microbatch") == 1 and f"{name}.mlir:" in err, err
    plan = json.loads((bundle / "plan.json").read_text())
    assert plan["stages"]["stages"], plan["stages"]
    assert (bundle / "pipeline.json").is_file() and (bundle / "program.mlir").is_file()
    pipeline = json.loads((bundle / "pipeline.json").read_text())
    assert pipeline["microbatches"] == 2
