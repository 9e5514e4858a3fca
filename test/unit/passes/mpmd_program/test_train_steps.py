"""The zoo's training steps split over two meshes of 4 CPU devices compute what one device does.

The split is the hand-made one of `two_stage.py`. Results are compared with one device's by
`numerics.assert_step_close` (parameter updates, Adam's moments and the loss to a relative RTOL;
updates whose gradient is rounding noise masked).
"""

from __future__ import annotations

import functools
from collections import Counter

import jax
import numpy as np
import pytest
from jaxlib.mlir import ir
from numerics import assert_step_close
from oracles.sequential_mpmd import SequentialMpmd
from program_checks import check_program, fragments, main_func
from two_stage import roles_of, stages_of

from hlopar.analysis.step_io import state_pairs
from hlopar.codegen.spmd import compile_spmd
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import parse_module, print_module
from hlopar.models import get_train_step
from hlopar.passes.base import PassContext
from hlopar.passes.mpmd_program import StageMesh, write_mpmd_program
from hlopar.passes.pipeline import Pipeline

RTOL = 1e-5
MESHES = [StageMesh("m0", ("x", "y"), (2, 2), (0, 1, 2, 3)), StageMesh("m1", ("x", "y"), (1, 4), (4, 5, 6, 7))]


@functools.cache
def imported(model: str):
    """The imported step's text, its flat arguments, parameters and one device's ``(params, state, loss)``."""
    step = get_train_step(model, "tiny")
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    arguments = [np.asarray(a) for a in jax.tree_util.tree_leaves((params, state, batch))]
    module = parse_module(step.lower())
    Pipeline.parse("builtin.module(hlopar-import)", module.context).run(module, PassContext())
    flat = compile_spmd(module, jax.devices()[:1])(*arguments)
    treedef = jax.tree_util.tree_structure(jax.eval_shape(step.jitted_step, params, state, batch))
    return print_module(module), arguments, params, jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in flat])


def split(text: str, plan: bool):
    module = parse_module(text)
    main = next(op.operation for op in module.regions[0].blocks[0].operations if op.operation.name == "func.func")
    graph = FuncGraph.from_func(main)
    roles = roles_of(graph)
    stages = stages_of(graph, roles)
    groups = Counter(zip(stages, roles))
    assert all(groups[stage, role] for stage in (0, 1) for role in ("forward", "backward", "update")), groups
    # No latency: on tiny models it would make replication optimal and test nothing.
    write_mpmd_program(module, stages, roles, MESHES, plan_shardings=plan, auto_sharding={"latency": (0.0, 0.0)})
    return module


CASES = [
    pytest.param("mlp", False, id="mlp-replicated"),
    pytest.param("mlp", True, id="mlp-planned"),
    pytest.param("gpt", False, id="gpt-replicated", marks=pytest.mark.heavy),
    pytest.param("gpt", True, id="gpt-planned"),
]


@pytest.mark.parametrize("model, plan", CASES)
def test_two_stage_program_matches_one_device(model, plan, tmp_path):
    text, arguments, params, reference = imported(model)
    module = split(text, plan)
    program = check_program(module, tmp_path)
    found = fragments(module)
    for stage, mesh in enumerate(("m0", "m1")):
        origins = {f.origin for f in found if f.mesh == mesh}
        assert origins == {
            f'[#mpmd.user_origin<"stage{stage}">]',
            f'[#mpmd.user_origin<"stage{stage}"(1)>]',
            f'[#mpmd.user_origin<"stage{stage}_update">]',
        }
    assert len(found) == 6, "the split is acyclic: one fragment per (stage, role)"
    if plan:
        assert '{"x"' in program or '{"y"' in program, "the plan shards nothing: the test would prove nothing"

    assert_step_close(SequentialMpmd(module)(arguments), reference, params, rtol=RTOL)


@pytest.mark.parametrize("model, across", [("mlp", 0), ("gpt", 1)])
def test_a_state_leaves_the_step_as_the_next_step_reads_it(model, across):
    """A training state's new value is returned in its argument's layout, whatever layout the
    update computes it in: the plan ties the two (and prices the conversion), so the next
    step lays nothing out again."""
    text, *_ = imported(model)
    module = parse_module(text)
    graph = FuncGraph.from_func(main_func(module))
    pairs = state_pairs(graph)
    assert len(pairs) == len(graph.args) - 2  # every parameter and optimizer state; not the batch
    planned = split(text, plan=True)
    main = main_func(planned)
    arg_types = [str(a.type) for a in main.regions[0].blocks[0].arguments]
    result_types = [str(t) for t in ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results]
    mesh_of = [t.split('"')[1] for t in arg_types]
    # The hand-made split reads a few parameters on one mesh and updates them on the other
    # (one of the GPT's vectors: a transfer every step, whatever the layouts).
    same_mesh = [(a, r) for a, r in pairs if result_types[r].startswith(f'!mpmd.mesh_tensor<"{mesh_of[a]}"')]
    assert len(same_mesh) == len(pairs) - across
    assert [result_types[r] for _, r in same_mesh] == [arg_types[a] for a, _ in same_mesh]
    assert any("sharding" in arg_types[a] for a, _ in pairs), "no state is sharded: the test would prove nothing"
