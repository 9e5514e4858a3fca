#!/usr/bin/env python3
"""Times the inter-op pass (Alpa's Algorithm 1) with the cost model, broken down like Table 5.

    python tools/bench_stage_construction.py [--model gpt:39B] [--hosts 8] [--devices 8]
                                             [--layers 48] [--microbatches 8] [--preset ...]
                                             [--schedule NAME] [--remat auto|always|never]
                                             [--no-donate] [--against ROOT] [--repeat N]
                                             [--baseline DIR] [--save DIR]

Exports the zoo model (its state donated, as a training loop lowers it, unless `--no-donate`),
then runs `hlopar-opt IN --pass-pipeline='builtin.module(hlopar-import,
hlopar-unstack-layer-scans,hlopar-cluster-operators{layers=L},hlopar-stage-construction{...})' -o OUT`
as a subprocess (the unstack pass unrolls a scanned model, `--model gpt:39B-scan`, and does
nothing to an unrolled one) and
reads the pass reports. Prints the wall time of the whole command and the breakdown: operator
clustering, the layer ILPs ("compilation" in the paper's Table 5: each distinct layer on each
logical mesh, cost model instead of profiling), the span table, the stage DP, writing the MPMD
program (each stage's ILP and the fragments), and the rest (interpreter start, parse, import,
print). Targets (issue 4): Algorithm 1 within 60 s, the DP within 2 s; the paper's numbers
for GPT-39B on 64 GPUs are 2,393 s in all and 1.65 s for the DP. Issue 28: the whole command
within 15 s for GPT-39B on 8x8 (B=8) and 30 s on 16x16.

The schedule is the project's default (`analysis.schedules.DEFAULT_SCHEDULE`) unless given;
`--schedule auto` adds the simulation of the candidates to Algorithm 1's time and prints the
choice and the runner-up.
`--against ROOT` runs the same command with another checkout's code (`PYTHONPATH=ROOT`, e.g.
the main branch) and this one, interleaved `--repeat` times (the machine is shared: pairs in
turn see the same load), and prints both times side by side, wall and CPU (the command's
processes, children included: less sensitive to the load), with the load (`os.getloadavg`)
of each run, and whether the two plans are equal. `--baseline DIR` compares the plan with one
saved by `--save DIR` (the report's stages, microbatch counts and predicted latency, and the
MPMD program byte for byte; the timings are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_TOTAL_S = 60.0
TARGET_DP_S = 2.0
TARGET_COMMAND_S = {64: 15.0, 256: 30.0}  # issue 28, GPT-39B: the whole hlopar-opt command
# What a plan is, in the report: compared between runs (the timings and counts of work are not).
PLAN_KEYS = ("microbatches", "predicted_step_seconds", "t_max", "stages", "runner_ups", "microbatch_candidates")


def main() -> int:
    """Export, plan in a subprocess, print. One sequential script: the reports it reads are
    printed where they are read."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt:39B")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", default="48")
    parser.add_argument("--microbatches", default="8")
    parser.add_argument("--schedule", default=None, help="pipeline schedule (default: the project's default)")
    parser.add_argument("--preset", default="a100-80g-nvlink")
    parser.add_argument("--memory-per-device", default="none")
    parser.add_argument(
        "--remat",
        default="auto",
        choices=("auto", "always", "never", "layers"),
        help="stage rematerialization (hlopar-stage-construction's remat option)",
    )
    parser.add_argument(
        "--no-donate",
        dest="donate",
        action="store_false",
        help="lower the step without donating its state (default: donate_argnums=(0, 1), the "
        "update in place, as Alpa's and a jax training loop's)",
    )
    parser.add_argument("--against", type=Path, help="another checkout to time the same command with, side by side")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each checkout, interleaved")
    parser.add_argument("--baseline", type=Path, help="a directory written by --save: compare the plan with it")
    parser.add_argument("--save", type=Path, help="keep this checkout's last outputs (reports, MPMD program) here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from hlopar.analysis.schedules import DEFAULT_SCHEDULE
    from hlopar.models import get_train_step

    args.schedule = args.schedule or DEFAULT_SCHEDULE
    with tempfile.TemporaryDirectory() as scratch:
        model, config = args.model.split(":", 1)
        source = Path(scratch) / "in.mlir"
        start = time.perf_counter()
        source.write_text(get_train_step(model, config).lower(donate=args.donate))
        export_s = time.perf_counter() - start
        roots = [ROOT] if args.against is None else [args.against.resolve(), ROOT]
        for root in roots:
            _check_code(root)
        runs: dict[Path, list] = {root: [] for root in roots}
        for _ in range(args.repeat):
            for root in roots:
                out = Path(scratch) / f"run{len(runs[root])}-{roots.index(root)}"
                run = _plan(args, source, out, root)
                if run is None:
                    return 1
                runs[root].append(run)
        wall, cpu, load, out = runs[ROOT][-1]
        cluster_report = json.loads((out / "clustering.json").read_text())
        unstack_report = json.loads((out / "unstack.json").read_text())
        report = json.loads((out / "stages.json").read_text())
        plan_equal = {root: _same_plan(runs[root][-1][3], out) for root in roots if root != ROOT}
        if args.baseline is not None:
            plan_equal[args.baseline] = _same_plan(args.baseline, out)
        if args.save is not None:
            shutil.copytree(out, args.save, dirs_exist_ok=True)
    t = report["timings"]
    simulation = t.get("simulation", 0.0)  # schedule=auto: the candidates simulated
    algorithm_1 = (
        cluster_report["seconds"] + t["sharding_rules"] + t["layer_ilps"] + t["span_costs"] + t["stage_dp"] + simulation
    )
    loops = unstack_report["loops"]
    rows = [
        (
            f"unstack layer scans ({len(loops)} loops unrolled, {unstack_report['split_arguments']} stacked arguments "
            "split)",
            unstack_report["seconds"],
        ),
        ("operator clustering (Eq. 6)", cluster_report["seconds"]),
        ("sharding rules (sdy)", t["sharding_rules"]),
        (
            f"layer ILPs ({report['layer_ilps_solved']} solved, {report['logical_meshes']} logical meshes, "
            f"{'spawned workers' if report.get('layer_ilps_spawned') else 'in process'})",
            t["layer_ilps"],
        ),
        ("span cost table", t["span_costs"]),
        ("stage DP (Eq. 3-4, Alg. 1)", t["stage_dp"]),
        ("schedules simulated (schedule=auto)", simulation),
        ("Algorithm 1 in all", algorithm_1),
        ("MPMD program (stage ILPs, fragments)", t["mpmd_program"]),
        (
            "rest (start, parse, import, print)",
            wall - t["total"] - cluster_report["seconds"] - unstack_report["seconds"],
        ),
        ("hlopar-opt, file to file", wall),
    ]
    print(
        f"{args.model} on {args.hosts}x{args.devices} ({args.preset}), {report['num_layers']} layers, "
        f"B={report['microbatches']}, {args.schedule}, remat={args.remat}, "
        f"state {'donated' if args.donate else 'not donated'}; export {export_s:.1f} s"
    )
    for name, seconds in rows:
        print(f"  {name:<60} {seconds:>8.2f} s")
    print("  stages:")
    for stage in report["stages"]:
        print(
            f"    layers {stage['layers'][0]:>2}-{stage['layers'][1]:<2} submesh {tuple(stage['submesh'])} "
            f"logical {tuple(stage['logical_shape'])} latency {stage['latency'] * 1e3:.1f} ms "
            f"memory {stage['memory_bytes'] / 2**30:.1f} GiB{_remat_note(stage)}"
        )
    print(f"  predicted step {report['predicted_step_seconds']:.3f} s, bubble {report['bubble_fraction']:.1%}")
    choice = report.get("schedule_choice")
    if choice:
        said = lambda c: f"{c['schedule']} B={c['microbatches']} {c['simulated_step_seconds']:.4g} s"  # noqa: E731
        runner = f", runner-up {said(choice['runner_up'])}" if choice.get("runner_up") else ""
        print(f"  schedule chosen (simulated): {said(choice['chosen'])}{runner}")
    tried = ", ".join(f"B={c['microbatches']}: " + _tried(c) for c in report["microbatch_candidates"])
    print(f"  microbatch counts tried: {tried}")
    print(
        f"Algorithm 1: {algorithm_1:.1f} s (target {TARGET_TOTAL_S:.0f} s, ratio {algorithm_1 / TARGET_TOTAL_S:.2f}); "
        f"DP: {t['stage_dp']:.2f} s (target {TARGET_DP_S:.0f} s, ratio {t['stage_dp'] / TARGET_DP_S:.2f})"
    )
    target = TARGET_COMMAND_S.get(args.hosts * args.devices) if args.model.startswith("gpt:39B") else None
    print("hlopar-opt, whole command (wall / CPU seconds; load average at the end of each run):")
    for root in roots:
        cells = "  ".join(f"{w:6.1f} / {c:6.1f} (load {l:.1f})" for w, c, l, _ in runs[root])
        walls = [w for w, _, _, _ in runs[root]]
        print(f"  {str(root):<40} {cells}   range {min(walls):.1f}-{max(walls):.1f} s")
    if args.against is not None:
        ratios = [b[0] / a[0] for a, b in zip(runs[ROOT], runs[roots[0]])]
        cpu_ratios = [b[1] / a[1] for a, b in zip(runs[ROOT], runs[roots[0]])]
        print(
            f"  speed-up over {roots[0]}: wall {min(ratios):.2f}-{max(ratios):.2f}x, "
            f"CPU {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}x"
        )
    if target is not None:
        walls = [w for w, _, _, _ in runs[ROOT]]
        print(f"  target {target:.0f} s: ratio {min(walls) / target:.2f}-{max(walls) / target:.2f}")
    for other, equal in plan_equal.items():
        print(f"  plan equal to {other}'s: {equal}")
    return 0 if all(equal is True for equal in plan_equal.values()) else 2


def _plan(args, source: Path, out: Path, root: Path) -> tuple[float, float, float, Path] | None:
    """Runs hlopar-opt with `root`'s code, outputs in `out`: (wall s, CPU s, load, out)."""
    out.mkdir(parents=True)
    pipeline = (
        f"builtin.module(hlopar-import,hlopar-unstack-layer-scans{{report={out / 'unstack.json'}}},"
        f"hlopar-cluster-operators{{layers={args.layers} report={out / 'clustering.json'}}},"
        f"hlopar-stage-construction{{num-hosts={args.hosts} devices-per-host={args.devices} "
        f"microbatches={args.microbatches} schedule={args.schedule} preset={args.preset} "
        f"memory-per-device={args.memory_per_device} remat={args.remat} report={out / 'stages.json'}}})"
    )
    command = [sys.executable, "-m", "hlopar.cli.opt", str(source), f"--pass-pipeline={pipeline}"]
    command += ["-o", str(out / "out.mlir"), "--mlir-timing"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # In `root` too: `python -m` puts the working folder first on the path, before PYTHONPATH,
    # so from another checkout's folder that checkout's code would run.
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, cwd=root
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        print(f"hlopar-opt ({root}) failed:\n{result.stderr[-3000:]}", file=sys.stderr)
        return None
    (out / "timing.txt").write_text(result.stderr)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, os.getloadavg()[0], out


def _check_code(root: Path) -> None:
    """Refuses to time a checkout whose code the command would not run (an installed copy
    first on the path)."""
    found = subprocess.run(
        [sys.executable, "-c", "import hlopar; print(hlopar.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(root.resolve()):
        sys.exit(f"the command would run {found}, not {root}'s code")


def _same_plan(expected: Path, got: Path) -> bool | str:
    """Whether two runs' plans are equal: the report's plan fields and the MPMD program, byte
    for byte; else what differs."""
    a, b = (json.loads((d / "stages.json").read_text()) for d in (expected, got))
    differ = [key for key in PLAN_KEYS if a.get(key) != b.get(key)]
    if (expected / "out.mlir").read_bytes() != (got / "out.mlir").read_bytes():
        differ.append("MPMD program")
    return not differ or "differs in " + ", ".join(differ)


def _tried(count: dict) -> str:
    """A count's best: its Eq. 2 latency, or why it has none (not simulated: its bound)."""
    if count["total_latency"] is not None:
        return f"{count['total_latency']:.3f} s"
    why = count.get("why", "")
    return (
        f">= {why.split('at least ')[1].split(' s')[0]} s (not simulated)"
        if why.startswith("not simulated")
        else "no plan"
    )


def _remat_note(stage: dict) -> str:
    if not stage.get("remat"):
        return ""
    return " remat per layer" if stage.get("remat_form") == "layers" else " remat"


if __name__ == "__main__":
    sys.exit(main())
