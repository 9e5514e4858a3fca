"""Writing a small program as MPMD: structure, well-formedness and the values it computes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jaxlib.mlir import ir
from numerics import assert_trees_close, assert_trees_equal
from oracles.sequential_mpmd import SequentialMpmd, run_mpmd
from program_checks import check_program, fragments, main_func, top_level_ops

from hlopar.codegen.fragments import fragment_modules
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.mpmd_program import StageMesh, layout_program, write_mpmd_program

# Measured bit-exact on 8 CPU devices; one ulp (1e-7) leaves room for a sharded contraction
# summed in another order.
RTOL, ATOL = 1e-7, 0.0

# Op 4 (stage 0) reads op 3 (stage 1), which reads op 1 (stage 0): stage 0's forward
# cannot be one fragment. The constant (op 0) is read on both meshes; x on both; the case
# op reads %1 and %7 only inside its branches.
PROGRAM = """
func.func @main(%x: tensor<8x16xf32>, %w0: tensor<16x16xf32>, %w1: tensor<16x16xf32>, %k: tensor<i32>)
    -> (tensor<16x16xf32> {jax.result_info = "w0"}, tensor<8x16xf32>, tensor<f32>) {
  %c = stablehlo.constant dense<2.0> : tensor<f32>
  %0 = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %1 = stablehlo.tanh %0 : tensor<8x16xf32>
  %2 = stablehlo.dot_general %1, %w1, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %3 = stablehlo.add %2, %0 : tensor<8x16xf32>
  %4 = stablehlo.reduce(%3 init: %c) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x16xf32>, tensor<f32>) -> tensor<f32>
  %5 = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
  %6 = stablehlo.multiply %3, %5 : tensor<8x16xf32>
  %7 = stablehlo.add %6, %x : tensor<8x16xf32>
  %8 = "stablehlo.case"(%k) ({
    stablehlo.return %7 : tensor<8x16xf32>
  }, {
    %n = stablehlo.negate %1 : tensor<8x16xf32>
    stablehlo.return %n : tensor<8x16xf32>
  }) : (tensor<i32>) -> tensor<8x16xf32>
  %9 = stablehlo.dot_general %x, %8, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
  %10 = stablehlo.subtract %w0, %9 : tensor<16x16xf32>
  return %10, %7, %4 : tensor<16x16xf32>, tensor<8x16xf32>, tensor<f32>
}
"""
F, B, U = "forward", "backward", "update"
STAGES = [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0]
ROLES = [F, F, F, F, F, F, B, B, B, B, B, U]
MESHES = [StageMesh("m0", ("x",), (4,), (0, 1, 2, 3)), StageMesh("m1", ("x", "y"), (2, 2), (4, 5, 6, 7))]


def arguments(k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((8, 16), np.float32),
        rng.standard_normal((16, 16), np.float32),
        rng.standard_normal((16, 16), np.float32),
        np.int32(k),
    ]


def written(plan: bool):
    """PROGRAM split (fragment by fragment in program order: its stage 0 forward reads stage 1's)."""
    module = parse_module(PROGRAM)
    write_mpmd_program(module, STAGES, ROLES, MESHES, plan_shardings=plan, pipelined=False)
    return module


def test_layout_splits_a_cyclic_group_and_copies_constants():
    module = parse_module(PROGRAM)
    graph = FuncGraph.from_func(main_func(module))
    layout = layout_program(graph, STAGES, ROLES)
    assert [(f.stage, f.role, f.ops) for f in layout.fragments] == [
        (0, F, (1,)),
        (1, F, (2, 3)),
        (0, F, (0, 4, 5)),
        (1, B, (0, 6, 7, 8, 9)),
        (0, B, (10,)),
        (0, U, (11,)),
    ]
    assert layout.home[graph.args[0]] == 0 and layout.home[graph.args[3]] == 1


@pytest.mark.parametrize("plan", [False, True], ids=["replicated", "planned"])
def test_structure(plan, tmp_path):
    module = written(plan)
    text = check_program(module, tmp_path)
    assert text.startswith(
        "module attributes {hlopar.devices = {m0 = array<i64: 0, 1, 2, 3>, m1 = array<i64: 4, 5, 6, 7>}}"
    )
    assert 'topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=2, "y"=2]>>>' in text
    assert 'sdy.mesh @m0 = <["x"=4]>' in text and 'sdy.mesh @m1 = <["x"=2, "y"=2]>' in text
    assert [(f.mesh, f.origin, f.stage) for f in fragments(module)] == [
        ("m0", '[#mpmd.user_origin<"stage0">]', 0),
        ("m1", '[#mpmd.user_origin<"stage1">]', 1),
        ("m0", '[#mpmd.user_origin<"stage0">]', 0),
        ("m1", '[#mpmd.user_origin<"stage1"(1)>]', 1),
        ("m0", '[#mpmd.user_origin<"stage0"(1)>]', 0),
        ("m0", '[#mpmd.user_origin<"stage0_update">]', None),
    ]
    names = [op.name for op in top_level_ops(module)]
    # %0 to m1, %2 back to m0, then %3 and x to m1, %8 back to m0; the constant never moves.
    assert names.count("mpmd.transfer") == 5
    assert text.count("stablehlo.constant") == 2
    assert 'jax.result_info = "w0"' in text
    if plan:
        assert 'sharding=<@m1, [{"x", "y"}, {}]>' in text


@pytest.mark.parametrize("plan", [False, True], ids=["replicated", "planned"])
def test_values_match_the_original(plan):
    original = parse_module(PROGRAM)
    program = SequentialMpmd(written(plan))
    for k in (0, 1):
        expected = compile_spmd(original, jax.devices()[:1])(*arguments(k))
        actual = program(arguments(k))
        assert_trees_close(list(actual), list(expected), rtol=RTOL, atol=ATOL)
    assert program.compiled == 6


def test_fragment_modules_are_standalone_spmd_programs():
    module = written(plan=True)
    standalone = fragment_modules(main_func(module))
    assert [s.mesh_name for s in standalone] == ["m0", "m1", "m0", "m1", "m0", "m0"]
    text = print_module(standalone[3].module)
    assert text.startswith('module {\n  sdy.mesh @m1 = <["x"=2, "y"=2]>\n  func.func @main(')
    assert "mpmd." not in text
    # Every argument and result has a closed sharding: none is left for Shardy to choose.
    func = main_func(standalone[3].module)
    for key in ("arg_attrs", "res_attrs"):
        assert all("sdy.sharding" in str(a) for a in func.attributes[key])
    assert "?" not in text


def test_wrong_plans_are_rejected():
    for stages, roles, message in (
        (STAGES[:-1], ROLES, "top-level ops"),
        ([2] + STAGES[1:], ROLES, "not a mesh index"),
        (STAGES, ["sideways"] + ROLES[1:], "role"),
    ):
        with pytest.raises(ValueError, match=message):
            write_mpmd_program(parse_module(PROGRAM), stages, roles, MESHES)
    shared = [MESHES[0], StageMesh("m1", ("x",), (4,), (3, 4, 5, 6))]
    with pytest.raises(ValueError, match="share"):
        write_mpmd_program(parse_module(PROGRAM), STAGES, ROLES, shared)
    with pytest.raises(ValueError, match="needs 4 devices"):
        StageMesh("m0", ("x",), (4,), (0, 1))
    # Stages may share a mesh (virtual stages), not give one mesh two shapes or device sets.
    for other in (StageMesh("m0", ("x", "y"), (2, 2), (0, 1, 2, 3)), StageMesh("m0", ("x",), (4,), (4, 5, 6, 7))):
        with pytest.raises(ValueError, match="stages on mesh 'm0' give it different axes, shapes or devices"):
            write_mpmd_program(parse_module(PROGRAM), STAGES, ROLES, [MESHES[0], other], pipelined=False)


def test_stages_that_share_a_mesh_are_written_on_it():
    """PROGRAM's two stages on one mesh: one topology entry and sdy.mesh, each stage's
    fragments (stage=k) on it, the values stage 0 hands stage 1 transferred from the mesh to
    itself; the same values as the program on one device."""
    module = parse_module(PROGRAM)
    write_mpmd_program(module, STAGES, ROLES, [MESHES[0], MESHES[0]], pipelined=False)
    text = print_module(module)
    assert text.count("sdy.mesh @") == 1 and '#mpmd.topology<<"m0" : <["x"=4]>>>' in text
    written = fragments(module)
    assert {f.mesh for f in written} == {"m0"} and {f.stage for f in written} == {0, 1, None}
    assert "mpmd.transfer" in text and '"m1"' not in text
    expected = compile_spmd(parse_module(PROGRAM), jax.devices()[:1])(*arguments(1))
    assert_trees_close(list(run_mpmd(module, arguments(1))), list(expected), rtol=RTOL, atol=ATOL)


def test_run_mpmd_checks_its_arguments():
    module = written(plan=False)
    with pytest.raises(ValueError, match="takes 4 arguments"):
        run_mpmd(module, arguments(0)[:3])
    bad = arguments(0)
    bad[0] = bad[0][:4]
    with pytest.raises(ValueError, match="shape"):
        run_mpmd(module, bad)


def test_signature_edge_cases():
    """A returned constant, a returned argument, a value returned twice, an unused argument."""
    module = parse_module("""
    func.func @main(%a: tensor<4xf32>, %unused: tensor<2xf32>)
        -> (tensor<f32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<2xf32>) {
      %c = stablehlo.constant dense<3.0> : tensor<f32>
      %0 = stablehlo.negate %a : tensor<4xf32>
      %1 = stablehlo.abs %0 : tensor<4xf32>
      return %c, %a, %1, %1, %unused : tensor<f32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<2xf32>
    }""")
    meshes = [StageMesh("a", ("x",), (2,), (0, 1)), StageMesh("b", ("x",), (2,), (2, 3))]
    write_mpmd_program(module, [1, 0, 1], [U, F, F], meshes)
    module.verify()
    text = print_module(module)
    # The constant stays in its own group's fragment (stage 1's update), which has no operands.
    assert 'mpmd.fragment<mesh="b", origin=["stage1_update"]> () ()' in text
    a = np.arange(4, dtype=np.float32)
    outputs = run_mpmd(module, [a, np.ones(2, np.float32)])
    expected = [np.float32(3.0), a, np.abs(-a), np.abs(-a), np.ones(2, np.float32)]
    assert_trees_equal(list(outputs), expected)


def test_stages_on_meshes_of_one_shape_plan_on_their_own_mesh():
    meshes = [StageMesh("m0", ("x", "y"), (2, 2), (0, 1, 2, 3)), StageMesh("m1", ("x", "y"), (2, 2), (4, 5, 6, 7))]
    module = parse_module(PROGRAM)
    write_mpmd_program(module, STAGES, ROLES, meshes, pipelined=False)
    for op in top_level_ops(module):
        if op.name == "mpmd.fragment":
            mesh = ir.StringAttr(op.attributes["mesh_name"]).value
            other = {"m0": "m1", "m1": "m0"}[mesh]
            assert f"@{other}" not in str(op), f"a fragment on {mesh} names @{other}"
    original = parse_module(PROGRAM)
    expected = compile_spmd(original, jax.devices()[:1])(*arguments(1))
    assert_trees_close(list(run_mpmd(module, arguments(1))), list(expected), rtol=RTOL, atol=ATOL)
