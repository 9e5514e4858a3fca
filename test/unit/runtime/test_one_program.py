"""No per-step work `jax.jit` would not do (issue 18), in one process, no Ray:

- a plan of one mesh and one microbatch ("shard") runs as ONE executable
  (`codegen.one_program`): it trains as one device does, fed its own results back, and
  `describe_plan` says so; a plan of two microbatches is not fused;
- `fragment_calls.Placements`: an argument read by several fragments in a layout it does not
  have is laid out once per step (counted), one already laid out so is not touched, and a
  donated copy leaves the step's cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from numerics import assert_step_close

from hlopar.api import Cluster, describe_plan, plan_step
from hlopar.codegen.executables import compile_executable
from hlopar.codegen.one_program import fuses, one_program
from hlopar.models import get_train_step
from hlopar.runtime.fragment_calls import Placements

ONE_HOST = Cluster.local(num_hosts=1, devices_per_host=8, device_kind="cpu").resolved()


def test_one_mesh_one_microbatch_runs_as_one_executable_equal_to_one_device(tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step = get_train_step("mlp", "tiny")
    text = jax.jit(step.step, keep_unused=True).lower(*step.abstract_args()).as_text()
    planned = plan_step(text, ONE_HOST, method="shard")
    program = planned.program
    assert fuses(program) and "runs as one executable" in describe_plan(planned)
    ex = compile_executable(one_program(program), jax.devices()[:8])
    assert ex.num_inputs == len(program.argument_shapes) and len(ex.output_shardings) == len(program.results)

    params = step.init(jax.random.PRNGKey(0))
    state, batch = step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1))
    leaves = jax.tree_util.tree_leaves((params, state, batch))
    count = len(jax.tree_util.tree_leaves((params, state)))
    p, s = params, state
    for _ in range(2):  # the second step reads the first's results as they were left on the devices
        outputs = ex.run(leaves)
        expected = step.jitted_step(p, s, batch)
        assert_step_close([np.asarray(o) for o in outputs], expected, p, rtol=1e-5, update_max_rtol=1e-4)
        leaves = list(outputs[:count]) + leaves[count:]
        p, s = expected[0], expected[1]

    two = plan_step(text, ONE_HOST, method="shard", num_microbatches=2).program
    assert not fuses(two) and one_program(two) is None


def test_an_argument_is_laid_out_once_per_step():
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("y",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("y"))
    ex = SimpleNamespace(
        input_shardings=[replicated, replicated, rows], place=lambda n, x: jax.device_put(x, ex.input_shardings[n])
    )
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    sharded, placed = jax.device_put(value, rows), jax.device_put(value, rows)
    host = value + 1

    step = Placements()
    first = step.inputs(ex, [sharded, host, placed], 0)
    assert step.moved == 2 and first[2] is placed  # already laid out: as it is
    assert first[0].sharding == replicated and np.array_equal(np.asarray(first[0]), value)
    assert first[1].sharding == replicated and np.array_equal(np.asarray(first[1]), host)
    again = step.inputs(ex, [sharded, host, placed], 0)  # another fragment of the step
    assert step.moved == 2 and again[0] is first[0] and again[1] is first[1]
    donated = step.inputs(ex, [sharded, host], 0, donated=(0,))  # its last reader consumes it
    assert donated[0] is first[0] and step.moved == 2
    assert step.inputs(ex, [sharded], 0)[0] is not first[0] and step.moved == 3
    assert Placements().inputs(ex, [sharded], 0)[0] is not first[0]  # a new step places anew
