"""hlopar-reroll-stage-loops: which runs of iterations it rolls, and that a rolled fragment
computes what the unrolled one did (the lit test, test/lit/reroll_stage_loops, checks the IR;
test/unit/runtime/test_scan_pipelines.py the scanned models end to end)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hlopar.ir.module import parse_module
from hlopar.passes.base import PassContext
from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass, identical_runs, stage_loop_lines
from hlopar.runtime.sequential_mpmd import run_mpmd

LIT = Path(__file__).resolve().parents[2] / "lit" / "reroll_stage_loops" / "loops.mlir"


def test_identical_runs_are_maximal_runs_of_consecutive_equal_iterations():
    keys = {0: "a", 1: "a", 2: "a", 3: "b", 4: "a", 5: "a", 7: "a"}
    assert identical_runs(keys, 1) == [(0, 3), (3, 1), (4, 2), (7, 1)]
    assert identical_runs(keys, 2) == [(0, 3), (4, 2)]
    assert identical_runs({}, 2) == []


def test_the_plan_summary_names_looping_and_unrolled_ranges():
    report = {"ranges": [
        {"fragment": "stage0", "loop": 0, "first": 0, "trips": 2, "layers": [0, 1], "rolled": True, "reason": ""},
        {"fragment": "stage1", "loop": 0, "first": 2, "trips": 1, "layers": [2], "rolled": False,
         "reason": "1 iteration(s): cheaper unrolled (min-trips=2)"}]}
    assert stage_loop_lines(report) == [
        "  run as loops (hlopar-reroll-stage-loops): stage0 loop 0 over layers 0..1",
        "  left unrolled: stage1 loop 0 layer 2 (1 iteration(s): cheaper unrolled (min-trips=2))"]
    assert stage_loop_lines(None) == []


def test_a_rolled_fragment_computes_what_the_unrolled_one_did(tmp_path):
    text = LIT.read_text().split("// -----")[0]
    rolled = parse_module(text)
    RerollStageLoopsPass(report=str(tmp_path / "reroll.json")).run(rolled, PassContext())
    assert "stablehlo.while" in str(rolled) and "stablehlo.while" not in str(parse_module(text))
    rng = np.random.default_rng(0)
    arguments = [rng.standard_normal((8, 4)).astype(np.float32)] + [
        rng.standard_normal((1, 4, 4)).astype(np.float32) for _ in range(3)]
    want = run_mpmd(parse_module(text), arguments)
    got = run_mpmd(rolled, arguments)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):  # the same ops on the same values: the same bits
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
