"""hlopar-opt starts without jax: the lit suite runs it 171 times, and importing jax costs
about 1 s of each start (0.76 s instead of 1.7 s for an empty module on CI's 2 cores). Passes
that compile (the memory check) import it where they run."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mlp_train_step.mlir"

PROBE = """
import sys
from hlopar.cli.opt_driver import OptDriver
result = OptDriver(pipeline=sys.argv[1]).process_file(sys.argv[2])
assert result.ok, [d.message for d in result.diagnostics]
print(sorted(name for name in ("jax", "matplotlib", "pandas") if name in sys.modules))
"""


def test_sharding_a_module_imports_no_jax():
    pipeline = "builtin.module(hlopar-import,hlopar-auto-sharding)"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, pipeline, str(EXAMPLE)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
