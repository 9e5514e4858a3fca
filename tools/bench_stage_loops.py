"""Compile and run time of one pipeline stage's fragments, unrolled against re-rolled (issue 17).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tools/bench_stage_loops.py [--model gpt:39B-scan] [--hosts 8] [--devices 8] [--stage K] ...

Exports the zoo model as `tools/bench_stage_construction.py` does, plans it with
`hlopar-opt` (import, unstack-layer-scans, cluster-operators, stage-construction), then runs
`hlopar-reroll-stage-loops` on copies of the MPMD program (`hold-ranges=false`: "rolled", the
loops pack their layers' pieces; `hold-ranges=true`: "held", the stage holds its range as one
value) and compiles the forward, backward and update fragments of one stage (default: the
first stage of the most layers whose mesh has at most as many devices as this machine has) on
the local devices, all three forms, with stock jaxlib (`codegen.spmd.compile_spmd`), then runs
each on zeros (`--repeats` timed runs after a warm-up; the median). Prints the stage's layers,
the ranges rolled, the lines of each fragment, its compile seconds and one run's time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt:39B-scan")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", default="48")
    parser.add_argument("--microbatches", default="64")
    parser.add_argument("--preset", default="a100-80g-nvlink")
    parser.add_argument("--stage", type=int, default=None, help="the stage whose fragments to compile")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each fragment timed (after one warm-up); 0: compile only"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="a field of the model's configuration changed, e.g. batch_size=16 seq_len=256 (to run "
        "a big model's stage on a CPU); repeatable",
    )
    parser.add_argument(
        "--program",
        type=Path,
        default=None,
        help="an MPMD program planned before (with --save): skip the export and planning",
    )
    parser.add_argument("--save", type=Path, default=None, help="write the planned MPMD program here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    text = args.program.read_text() if args.program else _plan(args)
    if text is None:
        return 1
    if args.save:
        args.save.write_text(text)
    return _compare(text, args.stage, args.repeats)


def _plan(args) -> str | None:
    """The zoo model exported and planned by hlopar-opt: the MPMD program's text."""
    from dataclasses import replace

    from hlopar.models import MODELS, get_train_step

    with tempfile.TemporaryDirectory() as scratch:
        model, config = args.model.split(":", 1)
        if args.set:
            fields = dict(item.split("=", 1) for item in args.set)
            config = replace(MODELS[model].configs[config], **{k: int(v) for k, v in fields.items()})
        source, out = Path(scratch) / "in.mlir", Path(scratch) / "out.mlir"
        source.write_text(get_train_step(model, config).lower(donate=True))
        pipeline = (
            f"builtin.module(hlopar-import,hlopar-unstack-layer-scans,"
            f"hlopar-cluster-operators{{layers={args.layers}}},"
            f"hlopar-stage-construction{{schedule=1f1b num-hosts={args.hosts} devices-per-host={args.devices} "
            f"microbatches={args.microbatches} preset={args.preset}}})"
        )
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "hlopar.cli.opt", str(source), f"--pass-pipeline={pipeline}", "-o", str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if result.returncode != 0:
            print(f"hlopar-opt failed:\n{result.stderr[-3000:]}", file=sys.stderr)
            return None
        print(
            f"{args.model} on {args.hosts}x{args.devices}: planned in {time.perf_counter() - start:.1f} s", flush=True
        )
        return out.read_text()


FORMS = ("unrolled", "rolled", "held")  # held: rolled, the stage's layers held as one range


def _compare(text: str, wanted: int | None, repeats: int) -> int:
    import json

    import jax
    from jaxlib.mlir import ir

    from hlopar.codegen.fragments import fragment_module, program_devices, program_topology
    from hlopar.codegen.pipeline_program import _entry  # @main
    from hlopar.codegen.spmd import compile_spmd
    from hlopar.dialect.mpmd import fragment_role
    from hlopar.ir.module import parse_module
    from hlopar.passes.base import PassContext
    from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass, fragments

    modules = {form: parse_module(text) for form in FORMS}
    ranges = []
    for form in FORMS[1:]:
        report = Path(tempfile.mkstemp(suffix=".json")[1])
        start = time.perf_counter()
        RerollStageLoopsPass(hold_ranges=form == "held", report=str(report)).run(modules[form], PassContext())
        print(
            f"hlopar-reroll-stage-loops{{hold-ranges={str(form == 'held').lower()}}}: "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
        ranges = json.loads(report.read_text())["ranges"]
        report.unlink()
    local = len(jax.devices())
    unrolled = modules["unrolled"]
    with unrolled.context:
        topology = program_topology(_entry(unrolled))
        physical = program_devices(unrolled, topology)

        def stage_of(fragment) -> int | None:
            return ir.IntegerAttr(fragment.attributes["stage_id"]).value if "stage_id" in fragment.attributes else None

        def mesh_of(fragment) -> str:
            return ir.StringAttr(fragment.attributes["mesh_name"]).value

        rows = list(zip(*(fragments(modules[form]) for form in FORMS)))
        sizes = {stage_of(r[0]): len(physical[mesh_of(r[0])]) for r in rows if stage_of(r[0]) is not None}
        held = {s: sum(r["trips"] for r in ranges if r["rolled"] and r["fragment"] == f"stage{s}") for s in sizes}
        stage = (
            wanted if wanted is not None else max((s for s in sizes if sizes[s] <= local), key=lambda s: (held[s], -s))
        )
        mesh = next(mesh_of(r[0]) for r in rows if stage_of(r[0]) == stage)
        print(
            f"stage {stage}: {sizes[stage]} devices; ranges rolled: "
            + "; ".join(
                f"{r['fragment']} loop {r['loop']} layers {r['layers']}"
                for r in ranges
                if r["rolled"] and r["fragment"].startswith(f"stage{stage}")
            )
        )
        totals = {form: [0.0, 0.0] for form in FORMS}
        for row in rows:
            if mesh_of(row[0]) != mesh:
                continue
            devices = jax.devices()[: len(physical[mesh])]  # as many local devices as the mesh has
            line = [f"  {fragment_role(row[0]):<8}"]
            for form, fragment in zip(FORMS, row):
                module = fragment_module(fragment, topology)
                lines = str(module).count("\n")
                start = time.perf_counter()
                executable = compile_spmd(module, devices)
                seconds = time.perf_counter() - start
                run = _run_seconds(executable, repeats) if repeats else 0.0
                totals[form][0] += seconds
                totals[form][1] += run
                line.append(
                    f"{form}: {lines} lines, compile {seconds:.1f} s" + (f", run {run * 1e3:.0f} ms" if repeats else "")
                )
            print("; ".join(line), flush=True)
        print(
            f"  stage {stage} (forward, backward, update), compile / one run of each: "
            + "; ".join(f"{form} {c:.1f} s / {r * 1e3:.0f} ms" for form, (c, r) in totals.items())
        )
    return 0


def _run_seconds(executable, repeats: int) -> float:
    """The median seconds of one run of a compiled fragment on zeros placed beforehand."""
    import jax
    import numpy as np

    placed = [
        jax.device_put(np.zeros(shape, dtype), sharding)
        for (shape, dtype), sharding in zip(executable.input_types, executable.input_shardings)
    ]
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        outputs = executable.executable.execute_sharded(placed).disassemble_into_single_device_arrays()
        jax.block_until_ready(outputs)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
