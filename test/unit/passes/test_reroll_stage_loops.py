"""hlopar-reroll-stage-loops: which runs of iterations it rolls, and that a rolled fragment
computes what the unrolled one did (the lit test, test/lit/reroll-stage-loops, checks the IR;
test/unit/runtime/test_scan_pipelines.py the scanned models end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from oracles.sequential_mpmd import run_mpmd

from hlopar.analysis.stage_loops import identical_runs
from hlopar.dialect.layers import LayerPieces
from hlopar.ir.module import parse_module, planned_functions
from hlopar.passes.base import PassContext
from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass, stage_loop_lines

LIT = Path(__file__).resolve().parents[2] / "lit" / "reroll-stage-loops" / "loops.mlir"


def test_identical_runs_are_maximal_runs_of_consecutive_equal_iterations():
    keys = {0: "a", 1: "a", 2: "a", 3: "b", 4: "a", 5: "a", 7: "a"}
    assert identical_runs(keys, 1) == [(0, 3), (3, 1), (4, 2), (7, 1)]
    assert identical_runs(keys, 2) == [(0, 3), (4, 2)]
    assert identical_runs({}, 2) == []


def test_the_plan_summary_names_looping_and_unrolled_ranges():
    report = {
        "ranges": [
            {"fragment": "stage0", "loop": 0, "first": 0, "trips": 2, "layers": [0, 1], "rolled": True, "reason": ""},
            {
                "fragment": "stage1",
                "loop": 0,
                "first": 2,
                "trips": 1,
                "layers": [2],
                "rolled": False,
                "reason": "1 iteration(s): cheaper unrolled (min-trips=2)",
            },
        ],
        "held": [{"mesh": "m0", "first": 0, "rows": 2, "arguments": 3, "results": 3}],
    }
    assert stage_loop_lines(report) == [
        "  run as loops (hlopar-reroll-stage-loops): stage0 loop 0 over layers 0..1",
        "  held as one range of rows per stacked leaf: m0 layers 0..1 (3 argument(s), 3 result(s))",
        "  left unrolled: stage1 loop 0 layer 2 (1 iteration(s): cheaper unrolled (min-trips=2))",
    ]
    assert stage_loop_lines(None) == []


def test_a_rolled_fragment_computes_what_the_unrolled_one_did(tmp_path):
    text = LIT.read_text().split("// -----")[0]
    rolled = parse_module(text)
    RerollStageLoopsPass(report=str(tmp_path / "reroll.json")).run(rolled, PassContext())
    assert "stablehlo.while" in str(rolled) and "stablehlo.while" not in str(parse_module(text))
    rng = np.random.default_rng(0)
    arguments = [rng.standard_normal((8, 4)).astype(np.float32)] + [
        rng.standard_normal((1, 4, 4)).astype(np.float32) for _ in range(3)
    ]
    want = run_mpmd(parse_module(text), arguments)
    got = run_mpmd(rolled, arguments)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):  # the same ops on the same values: the same bits
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_stage_holding_its_range_computes_what_the_unrolled_one_did(tmp_path):
    """The stage of the lit test's last case (forward, backward, update of 3 layers): rolled,
    with the weight's pieces held as one range of rows 0:3 and the stash and gradients crossing
    as stacked values, the step gives the unrolled one's results bit for bit."""
    text = LIT.read_text().split("// -----")[-1]
    unrolled, rolled = parse_module(text), parse_module(text)
    RerollStageLoopsPass(report=str(tmp_path / "reroll.json")).run(rolled, PassContext())
    report = json.loads((tmp_path / "reroll.json").read_text())
    assert report["held"] == [{"mesh": "m0", "first": 0, "rows": 3, "arguments": 1, "results": 1}]
    assert all(r["rolled"] for r in report["ranges"]) and len(report["ranges"]) == 2
    before, after = LayerPieces.of(planned_functions(unrolled)[0]), LayerPieces.of(planned_functions(rolled)[0])
    assert (after.arg_piece, after.arg_rows, after.result_rows) == ((-1, 0), (1, 3), (1, 3))
    rng = np.random.default_rng(0)
    step_args = [rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 4, 4)).astype(np.float32)]
    want = before.join([np.asarray(v) for v in run_mpmd(unrolled, before.split(step_args))])
    got = after.join([np.asarray(v) for v in run_mpmd(rolled, after.split(step_args))])
    assert [g.shape for g in got] == [(8, 4), (3, 4, 4)]
    for g, w in zip(got, want):  # the same ops on the same values: the same bits
        np.testing.assert_array_equal(g, w)


def test_layer_pieces_hold_ranges_and_read_old_plans():
    """A piece of rows r: split slices them, join concatenates whatever the rows, resident
    pairs an argument with the result cut into the same rows; a plan without rows (before
    ranges) reads as rows 1."""
    pieces = LayerPieces(
        arg_origin=(0, 1, 1),
        arg_piece=(-1, 0, 3),
        result_origin=(0, 0, 1),
        result_piece=(0, 3, -1),
        arg_rows=(1, 3, 1),
        result_rows=(3, 1, 1),
    )
    stack = np.arange(8.0).reshape(4, 2)
    split = pieces.split([np.zeros(2), stack])
    np.testing.assert_array_equal(split[1], stack[0:3])
    np.testing.assert_array_equal(split[2], stack[3:4])
    joined = pieces.join([stack[:3], stack[3:], np.ones(1)])
    np.testing.assert_array_equal(joined[0], stack)
    assert pieces.layers == 4
    # Argument 1 (rows 0:3 of origin 1) is kept where result 0 of origin 0 is cut alike.
    assert pieces.resident({1: 0}) == {1: 0, 2: 1}
    assert LayerPieces.from_json(pieces.to_json()) == pieces
    old = {"arg_origin": [0, 0], "arg_piece": [0, 1], "result_origin": [0, 0], "result_piece": [0, 1]}
    assert LayerPieces.from_json(old).arg_rows == (1, 1) == LayerPieces.from_json(old).result_rows
