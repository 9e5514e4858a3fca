"""Host callbacks in a parallelized step (issue 25 item 5): `jax.debug.print`,
`jax.debug.callback` and `io_callback` call a Python function of the process that lowered
the step. Where hlopar runs the plan in that process as one executable (one mesh, one
microbatch, this machine: `runtime/in_process.py`) they run there, called as `jax.jit` calls
them, with the same values; a plan for Ray workers (other processes, which do not hold the
function) or a pipelined one (calling it per microbatch and stage) is refused at the user's
line before anything starts
(`codegen/pipeline_program.py`), and so is an ordered one (`ordered=True`, at import).
No test here starts Ray: the refusals come first."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import hlopar
from hlopar.api import PlanningError
from hlopar.runtime.in_process import InProcessRuntime

ONE_HOST = hlopar.Cluster.local(1, 8, device_kind="cpu")
W = jnp.arange(16, dtype=jnp.float32).reshape(4, 4) / 16
X = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 8
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _line_of(marker: str) -> int:
    """The line of this file that ends with the comment `# marker`."""
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def printing_step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    jax.debug.print("loss {l} w00 {v}", l=loss, v=w[0, 0])  # print
    return w - 0.1 * grad, loss


def ordered_step(w, x):
    jax.debug.print("w00 {v}", v=w[0, 0], ordered=True)  # ordered
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * grad, loss


def io_step(calls: list):
    """A step whose `io_callback` records its argument here and returns a scale it uses."""

    def record(total):
        calls.append(float(total))
        return np.float32(1 + len(calls))

    def step(w, x):
        scale = io_callback(record, jax.ShapeDtypeStruct((), jnp.float32), w.sum())  # io
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * scale * grad, loss

    return step


def partitioned_step(shapes: list):
    """A step with a `partitioned=True` callback, called once per shard of `x`."""

    def step(w, x):
        jax.debug.callback(lambda shard: shapes.append(shard.shape), x, partitioned=True)
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    return step


@pytest.fixture(scope="module", autouse=True)
def plan_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HLOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("hlopar-cache")))
        yield


def _printed(text: str) -> list[list[float]]:
    return [[float(v) for v in NUMBER.findall(line)] for line in text.splitlines() if line.startswith("loss ")]


def test_debug_print_runs_in_process_once_per_step(capfd):
    capfd.readouterr()
    w = W
    for _ in range(2):
        w, _ = jax.block_until_ready(jax.jit(printing_step)(w, X))
    expected = _printed(capfd.readouterr().out)
    assert len(expected) == 2

    parallel = hlopar.parallelize(printing_step, cluster=ONE_HOST, method="shard", verbose=False)
    try:
        w = W
        for _ in range(2):
            w, _ = jax.block_until_ready(parallel(w, X))
        assert isinstance(parallel.runtime, InProcessRuntime)
        printed = _printed(capfd.readouterr().out)
        assert len(printed) == 2  # once per step, as jax.jit prints (one device prints)
        np.testing.assert_allclose(printed, expected, rtol=1e-5)
    finally:
        parallel.close()


def test_io_callback_runs_in_process_with_its_values():
    expected_calls, calls = [], []
    reference = jax.jit(io_step(expected_calls))
    parallel = hlopar.parallelize(io_step(calls), cluster=ONE_HOST, method="shard", verbose=False)
    try:
        w, v = W, W
        for _ in range(2):
            w, loss = parallel(w, X)
            v, expected_loss = reference(v, X)
            np.testing.assert_allclose(np.asarray(w), np.asarray(v), rtol=1e-5)
            np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
        assert isinstance(parallel.runtime, InProcessRuntime)
        np.testing.assert_allclose(calls, expected_calls, rtol=1e-5)
        assert len(calls) == 2
    finally:
        parallel.close()


def test_partitioned_callback_is_called_as_jax_jit_calls_it_on_the_same_layout():
    """A `partitioned=True` callback runs once per shard: as many calls, of the same shapes,
    as `jax.jit` makes with the executable's own input layouts."""
    shapes, expected = [], []
    parallel = hlopar.parallelize(partitioned_step(shapes), cluster=ONE_HOST, method="shard", verbose=False)
    try:
        jax.block_until_ready(parallel(W, X))
        executable = parallel.runtime.executable
        same_layout = jax.jit(partitioned_step(expected), in_shardings=tuple(executable.input_shardings))
        jax.block_until_ready(same_layout(*(jax.device_put(a, s) for a, s in zip((W, X), executable.input_shardings))))
        assert sorted(shapes) == sorted(expected) and shapes, (shapes, expected)
    finally:
        parallel.close()


def _refused_at(marker: str, *reasons: str):
    here = rf"{re.escape(__file__)}:{_line_of(marker)}:\d+: error: "
    return pytest.raises(PlanningError, match=rf"(?s){here}.*" + ".*".join(re.escape(r) for r in reasons))


def test_a_plan_for_ray_workers_is_refused_at_the_users_line():
    on_ray = hlopar.parallelize(printing_step, cluster=ONE_HOST, method="shard", runtime="ray", verbose=False)
    with _refused_at(
        "print",
        "host callback 'xla_ffi_python_cpu_callback' (jax.debug.print",
        "the plan runs on Ray workers",
        "runtime='process'",
    ):
        on_ray.compile(W, X)


def test_a_pipelined_plan_is_refused_at_the_users_line():
    """2 hosts x 4 devices, 2 microbatches: a pipelined plan (in this process, or on Ray
    workers) would call it per microbatch and stage; the print and the io_callback are
    refused where the user wrote them, not as an internal error."""
    for step, marker in ((printing_step, "print"), (io_step([]), "io")):
        pipelined = hlopar.parallelize(step, cluster=hlopar.Cluster.local(2, 4), num_microbatches=2, verbose=False)
        with _refused_at(marker, "host callback", "microbatch(es) on", "once per microbatch and stage"):
            pipelined.compile(W, X)


def test_an_ordered_callback_is_refused_at_the_users_line():
    parallel = hlopar.parallelize(ordered_step, cluster=ONE_HOST, method="shard", verbose=False)
    with _refused_at("ordered", "takes a token of ordered_step: an ordered effect (ordered=True"):
        parallel.compile(W, X)


def unused_argument_step(w, x, unused):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    jax.debug.print("loss {l}", l=loss)  # unused
    return w - 0.1 * grad, loss


def test_a_one_mesh_plan_with_an_argument_nothing_reads_runs_here_with_its_callback(capfd):
    """One mesh and one microbatch with an argument no fragment reads (jax keeps it): fused
    without it (`one_program.fused_arguments`, issue 27), so it runs in this process and
    prints once per step, as jax.jit does; it went to Ray workers and was refused before."""
    capfd.readouterr()
    want_w, _ = jax.block_until_ready(jax.jit(unused_argument_step)(W, X, jnp.ones(3)))
    expected = _printed(capfd.readouterr().out)
    parallel = hlopar.parallelize(unused_argument_step, cluster=ONE_HOST, method="shard", verbose=False)
    try:
        w, _ = jax.block_until_ready(parallel(W, X, jnp.ones(3)))
        assert isinstance(parallel.runtime, InProcessRuntime)
        printed = _printed(capfd.readouterr().out)
        assert len(printed) == len(expected) == 1
        np.testing.assert_allclose(printed, expected, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6)
    finally:
        parallel.close()
