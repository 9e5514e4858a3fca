#!/usr/bin/env python3
"""Times hlopar-auto-sharding, file to annotated file, on zoo models and corpus modules.

    python tools/bench_auto_sharding.py [--mesh 2x4] [--time-limit 60] [CASE ...]

CASE is `gpt:1.3B` (a zoo model, exported to a temporary file) or a path to a `.mlir`. Each
runs `hlopar-opt IN --pass-pipeline='builtin.module(hlopar-import,hlopar-auto-sharding{...})'
-o OUT` as a subprocess (interpreter start, parse, import, plan, print, write) and prints the
wall time, the time in the solver, the ILP's status and gap, its size before and after
merging, the plan's objective, and the ratio to the target (10 s for GPT-1.3B on a 2x4 mesh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hlopar.corpus import corpus_dir  # noqa: E402

CORPUS = corpus_dir()
DEFAULT_CASES = ["gpt:1.3B", "gpt:39B", str(CORPUS / "models" / "alphafold.mlir")]
TARGET_SECONDS = 10.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--options", default="", help="more hlopar-auto-sharding options")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for case in args.cases:
            source = Path(case)
            if ":" in case and not source.exists():
                from hlopar.models import get_train_step

                model, config = case.split(":", 1)
                source = Path(scratch) / f"{model}-{config}.mlir"
                source.write_text(get_train_step(model, config).lower())
            report = Path(scratch) / "report.json"
            pipeline = (
                f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={args.mesh} "
                f"time-limit={args.time_limit} report={report} {args.options}}})"
            )
            command = [
                sys.executable,
                "-m",
                "hlopar.cli.opt",
                str(source),
                f"--pass-pipeline={pipeline}",
                "-o",
                str(Path(scratch) / "out.mlir"),
            ]
            start = time.perf_counter()
            result = subprocess.run(
                command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
            )
            wall = time.perf_counter() - start
            if result.returncode != 0:
                print(f"{case}: hlopar-opt failed:\n{result.stderr[-2000:]}", file=sys.stderr)
                rows.append((case, wall, None))
                continue
            rows.append((case, wall, json.loads(report.read_text())))
    print(
        f"{'case':<28} {'wall s':>7} {'build s':>8} {'solve s':>8} {'status':>9} {'gap':>8} "
        f"{'nodes':>7} {'core':>6} {'vars':>8} {'objective s':>14}"
    )
    for case, wall, report in rows:
        name = Path(case).name if "/" in case else case
        if report is None:
            print(f"{name:<28} {wall:>7.1f}  failed")
            continue
        sizes = report["ilp_sizes"]
        print(
            f"{name:<28} {wall:>7.1f} {report['build_s']:>8.2f} {report['solve_s']:>8.2f} {report['status']:>9} "
            f"{'-' if report['gap'] is None else format(report['gap'], '.1e'):>8} "
            f"{sizes.get('nodes', 0):>7} {sizes.get('nodes_core', 0):>6} "
            f"{sizes.get('variables', 0):>8} {report['objective_s']:>14.9g}"
        )
    gpt = next((r for r in rows if r[0] == "gpt:1.3B" and r[2] is not None), None)
    if gpt:
        print(
            f"gpt:1.3B on {args.mesh}: {gpt[1]:.1f} s, target {TARGET_SECONDS:.0f} s, "
            f"ratio {gpt[1] / TARGET_SECONDS:.2f}, "
            f"status {gpt[2]['status']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
