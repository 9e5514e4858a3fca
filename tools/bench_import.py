#!/usr/bin/env python3
"""Times importing a training step with hlopar-opt, from file to printed file.

    python tools/bench_import.py [--model gpt --config 1.3B] [--repeat 3]

The model is exported from the zoo to a temporary .mlir, then
`hlopar-opt IN --pass-pipeline='builtin.module(hlopar-import)' -o OUT` runs as a
subprocess (the whole command a user runs: interpreter start, parse, passes, print,
write) `--repeat` times. Prints the median wall time, the per-phase times that
`--mlir-timing` reports, and the ratio to the target (5 s on a 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--config", default="1.3B")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from hlopar.models import get_train_step

    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "step.mlir"
        start = time.perf_counter()
        source.write_text(get_train_step(args.model, args.config).lower())
        export_seconds = time.perf_counter() - start
        ops = sum(1 for line in source.read_text().splitlines() if " = " in line and not line.lstrip().startswith("#"))
        command = [
            sys.executable,
            "-m",
            "hlopar.cli.opt",
            str(source),
            "--pass-pipeline=builtin.module(hlopar-import)",
            "-o",
            str(Path(scratch) / "out.mlir"),
        ]
        walls, report = [], ""
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = subprocess.run(
                command + ["--mlir-timing"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
            )
            walls.append(time.perf_counter() - start)
            if result.returncode != 0:
                print(result.stderr, file=sys.stderr)
                return 1
            report = result.stderr
    median = statistics.median(walls)
    print(f"model: {args.model} {args.config}, {ops} SSA ops (exported in {export_seconds:.2f} s)")
    print(f"hlopar-opt file -> file, {args.repeat} runs: " + ", ".join(f"{w:.2f} s" for w in walls))
    print("phases of the last run (--mlir-timing):")
    print("\n".join("  " + line for line in report.splitlines() if "(" in line and "%" in line))
    print(f"median {median:.2f} s; target {TARGET_SECONDS:.1f} s; ratio median/target = {median / TARGET_SECONDS:.2f}")
    return 0 if median <= TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
