#!/usr/bin/env python3
"""The planner's per-device memory of every fragment against what XLA compiles (issue 15).

    python tools/bench_memory.py [--json] [--hosts 2] [--devices-per-host 4] [--schedule eager-1f1b]
                                 [MODEL[:CONFIG] ...]

Each zoo model (default: the tiny mlp, gpt, moe, wide_resnet, u_transformer) is planned as
`hlopar.parallelize` plans it (`api.plan_step`: hlopar-auto-parallel, codegen, the bundle),
which compiles every fragment with stock jaxlib for its mesh's CPU devices
(`codegen.memory_check`). Prints one row per fragment: its mesh and devices, the predicted
and compiled bytes per device of its executable (arguments + outputs + temporaries -
aliased), their ratio, and the temporaries alone (predicted / compiled); then per mesh the
most a fragment needs with what the schedule keeps resident, predicted and compiled, beside
stage construction's own estimate for the stage (`span_costs`: the larger of the update's old
state + gradients + new state and the forward/backward's state + accumulators + stashed
activations of the microbatches in flight + one layer's temporaries, from the layers' plans)
and its ratio to the compiled peak. With `--json`, the bundles' memory.json per model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hlopar.runtime.host_devices import use_host_devices  # noqa: E402

DEFAULT_MODELS = ["mlp", "gpt", "moe", "wide_resnet", "u_transformer"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, help="MODEL[:CONFIG] (default config: tiny)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--schedule", default="eager-1f1b")
    parser.add_argument("--json", action="store_true", help="print the memory.json of each model")
    args = parser.parse_args(argv)
    use_host_devices(args.hosts * args.devices_per_host)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

    from hlopar.api import Cluster, plan_step
    from hlopar.models import get_train_step

    cluster = Cluster.local(num_hosts=args.hosts, devices_per_host=args.devices_per_host, device_kind="cpu").resolved()
    reports = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as cache:
        os.environ["HLOPAR_CACHE_DIR"] = cache
        for spec in args.models:
            model, _, config = spec.partition(":")
            step = plan_step(get_train_step(model, config or "tiny").lower(), cluster, schedule=args.schedule)
            reports[spec] = json.loads((step.bundle / "memory.json").read_text())
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    print(table(reports))
    return 0


def table(reports: dict) -> str:
    """The fragment rows and the mesh rows as Markdown tables."""
    lines = [
        "| model | fragment | mesh (devices) | predicted B | compiled B | ratio | temporaries predicted / compiled B |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for model, report in reports.items():
        for f in report["fragments"]:
            compiled = f["compiled"]
            if compiled is None:
                lines.append(
                    f"| {model} | {f['fragment']} | {f['mesh']} ({f['devices']}) | {f['predicted']['total']} "
                    "| not compiled | | |"
                )
                continue
            worst = max(worst, abs(f["ratio"] - 1))
            lines.append(
                f"| {model} | {f['fragment']} | {f['mesh']} ({f['devices']}) | {f['predicted']['total']} | "
                f"{compiled['total']} | {f['ratio']:.3f} | "
                f"{f['predicted']['temporaries']} / {compiled['temporaries']} |"
            )
    lines += [
        "",
        f"largest deviation of a fragment's total: {100 * worst:.1f}%",
        "",
        "| model | mesh | stage construction B | predicted peak B | compiled peak B | "
        "stage construction / compiled | device B |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, report in reports.items():
        for m in report["meshes"]:
            estimate, compiled = m["stage_construction"], m["compiled_peak"]
            planned = "" if estimate is None else f"{estimate:.0f}"
            ratio = "" if estimate is None or not compiled else f"{estimate / compiled:.3f}"
            lines.append(
                f"| {model} | {m['mesh']} | {planned} | {m['predicted_peak']} | {compiled} | {ratio} | "
                f"{report['device_memory']:.3g} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
