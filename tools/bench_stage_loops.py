"""Compile time of one pipeline stage's fragments, unrolled against re-rolled (issue 17).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tools/bench_stage_loops.py [--model gpt:39B-scan] [--hosts 8] [--devices 8] [--stage K] ...

Exports the zoo model as `tools/bench_stage_construction.py` does, plans it with
`hlopar-opt` (import, unstack-layer-scans, cluster-operators, stage-construction), then runs
`hlopar-reroll-stage-loops` on a copy of the MPMD program and compiles the forward and
backward fragments of one stage (default: the first stage of the most layers whose mesh has
at most as many devices as this machine has) on the local devices, both forms, with stock
jaxlib (`codegen.spmd.compile_spmd`). Prints the stage's layers, the ranges rolled, the ops
in each fragment and the compile seconds of each.
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
    parser.add_argument("--program", type=Path, default=None,
                        help="an MPMD program planned before (with --save): skip the export and planning")
    parser.add_argument("--save", type=Path, default=None, help="write the planned MPMD program here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    text = args.program.read_text() if args.program else _plan(args)
    if text is None:
        return 1
    if args.save:
        args.save.write_text(text)
    return _compare(text, args.stage)


def _plan(args) -> str | None:
    """The zoo model exported and planned by hlopar-opt: the MPMD program's text."""
    from hlopar.models import get_train_step

    with tempfile.TemporaryDirectory() as scratch:
        model, config = args.model.split(":", 1)
        source, out = Path(scratch) / "in.mlir", Path(scratch) / "out.mlir"
        source.write_text(get_train_step(model, config).lower(donate=True))
        pipeline = (f"builtin.module(hlopar-import,hlopar-unstack-layer-scans,"
                    f"hlopar-cluster-operators{{layers={args.layers}}},hlopar-stage-construction{{num-hosts={args.hosts} devices-per-host={args.devices} "
                    f"microbatches={args.microbatches} preset={args.preset}}})")
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "hlopar.cli.opt", str(source), f"--pass-pipeline={pipeline}",
                                 "-o", str(out)], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        if result.returncode != 0:
            print(f"hlopar-opt failed:\n{result.stderr[-3000:]}", file=sys.stderr)
            return None
        print(f"{args.model} on {args.hosts}x{args.devices}: planned in {time.perf_counter() - start:.1f} s",
              flush=True)
        return out.read_text()


def _compare(text: str, wanted: int | None) -> int:
    import json

    import jax
    from jaxlib.mlir import ir

    from hlopar.codegen.fragments import fragment_module, program_devices, program_topology
    from hlopar.codegen.spmd import compile_spmd
    from hlopar.ir.module import parse_module
    from hlopar.passes.base import PassContext
    from hlopar.passes.mpmd_program import fragment_role
    from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass, fragments
    from hlopar.runtime.sequential_mpmd import _entry

    unrolled, rolled = parse_module(text), parse_module(text)
    report = Path(tempfile.mkstemp(suffix=".json")[1])
    start = time.perf_counter()
    RerollStageLoopsPass(report=str(report)).run(rolled, PassContext())
    print(f"hlopar-reroll-stage-loops: {time.perf_counter() - start:.1f} s", flush=True)
    ranges = json.loads(report.read_text())["ranges"]
    report.unlink()
    local = len(jax.devices())
    with unrolled.context:
        topology = program_topology(_entry(unrolled))
        physical = program_devices(unrolled, topology)

        def stage_of(fragment) -> int | None:
            return ir.IntegerAttr(fragment.attributes["stage_id"]).value if "stage_id" in fragment.attributes else None

        def mesh_of(fragment) -> str:
            return ir.StringAttr(fragment.attributes["mesh_name"]).value

        pairs = [(a, b) for a, b in zip(fragments(unrolled), fragments(rolled)) if fragment_role(a) != "update"]
        sizes = {stage_of(a): len(physical[mesh_of(a)]) for a, _ in pairs}
        held = {s: sum(r["trips"] for r in ranges if r["rolled"] and r["fragment"] == f"stage{s}") for s in sizes}
        stage = wanted if wanted is not None else max(
            (s for s in sizes if sizes[s] <= local), key=lambda s: (held[s], -s))
        print(f"stage {stage}: {sizes[stage]} devices; ranges rolled: "
              + "; ".join(f"{r['fragment']} loop {r['loop']} layers {r['layers']}" for r in ranges
                          if r["rolled"] and r["fragment"].startswith(f"stage{stage}")))
        totals = [0.0, 0.0]
        for a, b in pairs:
            if stage_of(a) != stage:
                continue
            devices = jax.devices()[:len(physical[mesh_of(a)])]  # as many local devices as the mesh has
            line = [f"  {fragment_role(a):<8}"]
            for k, fragment in enumerate((a, b)):
                module = fragment_module(fragment, topology)
                lines = str(module).count("\n")
                start = time.perf_counter()
                compile_spmd(module, devices)
                seconds = time.perf_counter() - start
                totals[k] += seconds
                line.append(f"{'unrolled' if k == 0 else 'rolled'}: {lines} lines, compiled in {seconds:.1f} s")
            print("; ".join(line), flush=True)
        print(f"  stage {stage} compile, forward + backward: unrolled {totals[0]:.1f} s, rolled {totals[1]:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
