"""A user's script through `hlopar.parallelize` prints its result and nothing else: no warning
from Ray, JAX, gloo or Python's warnings machinery (`runtime.local_ray`), and Ray's address
file left by a dead cluster is not joined."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Ten lines, as a user writes them. Two simulated hosts of one device each, on Ray: one mesh spans
# both workers, so they join one multi-process jax runtime over gloo, whose connection lines
# are among what must not reach the user.
SCRIPT = textwrap.dedent("""\
    import jax, jax.numpy as jnp
    import hlopar

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w, x = jnp.ones((4, 4)), jnp.ones((8, 4))
    fast = hlopar.parallelize(step, cluster=hlopar.Cluster.local(2, 1), method="shard", runtime="ray", verbose=False)
    print(float(fast(w, x)[1])); fast.shutdown()
""")

WARNING = re.compile(r"warning|\[gloo\]|deadlock|token auth|ray cluster|\bW\d{4}|^\[.* W \d+", re.IGNORECASE)


def test_user_script_prints_no_warning(tmp_path):
    (tmp_path / "step.py").write_text(SCRIPT)
    # Ray's default address file names a cluster that is gone: plain ray.init() would try to join it.
    stale = tmp_path / "ray"
    stale.mkdir()
    (stale / "ray_current_cluster").write_text("127.0.0.1:1")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HLOPAR_RAY"))}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "RAY_TMPDIR": str(stale),
            "HLOPAR_CACHE_DIR": str(tmp_path / "cache"),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "PYTHONWARNINGS": "default",
        }
    )
    done = subprocess.run(
        [sys.executable, "step.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # loss = mean((x @ w)^2) with every entry of x @ w equal to 4
    assert done.stdout == "16.0\n"
    assert [line for line in done.stderr.splitlines() if WARNING.search(line)] == []
    assert done.stderr == ""


def test_local_cluster_is_its_own_and_goes_away():
    import ray

    from hlopar.runtime import local_ray

    if ray.is_initialized():
        ray.shutdown()
    # The token is made once per process (Ray's driver keeps the first one it read): an
    # earlier test's local cluster may have made it already.
    local = local_ray.connect(None, 2)
    try:
        assert ray.cluster_resources()["CPU"] == 2
        assert list(local.directory.glob("session_*/logs"))  # its files are in its own directory
        assert (local.directory / "ray_current_cluster").read_text().strip() == local.address
        assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64  # its own token
    finally:
        local.stop()
    assert local.process.poll() is not None and not local.directory.exists() and not ray.is_initialized()
