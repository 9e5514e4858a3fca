#!/usr/bin/env python3
"""What `parallelize(checkpoint_every=N, checkpoint_dir=...)` costs a training step, in one run.

    python tools/bench_checkpoint.py [--json] [--format orbax|npz] [--every 5] [--steps 5] [--warmup 1] [--rounds 8]
                                     [--hidden 256] [--layers 4] [--seq 64] [--batch 16] [--vocab 1024]

The zoo's GPT of `tools/bench_runtime.py` (same defaults: 3.4 M parameters, Adam, so a state
of about 40 MiB with the optimizer's moments) trains as a pipeline on `Cluster.local(2, 4)`
(two simulated hosts of 4 CPU devices, one Ray worker per mesh; the plan of bench_runtime's
`hlopar-pipelined-2x4` row) in two ways side by side, from the same initial state:

- `no-checkpoints`: `hlopar.parallelize(...)`;
- `checkpoint-every-N`: the same with `checkpoint_every=N, checkpoint_dir=<a temporary
  directory>`: every N calls each worker writes its part of the state in Orbax's format in
  a thread of its own while the next steps run, and the driver commits the save when all
  parts are written.

Both functions are open at once and run in turns, `--rounds` times `--warmup` untimed and
`--steps` timed steps each, the order reversed every other round (a load that comes and goes
falls on both alike). A step is the
call and reading its loss as a float; its time runs from the end of one step to the end of
the next (so a save that held a step up is counted). Printed: per way the median and the
mean step, and `ratio_mean` / `ratio_median` of the checkpointing way to the other (the
target: within 1.05), the saves committed, and how long each took from its start to its
commit (`save_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import HLOPAR_WAYS, Runner, machine  # noqa: E402 - sets up this process's 8 devices

# isort: split
import jax  # noqa: E402

import hlopar  # noqa: E402
from hlopar.models import gpt  # noqa: E402


def pipelined(step, args, **options) -> hlopar.api.ParallelizedFunction:
    """bench_runtime's `hlopar-pipelined-2x4`: the first candidate whose plan has several meshes."""
    hosts, per_host, candidates = HLOPAR_WAYS["hlopar-pipelined-2x4"]
    for k, (method, extra) in enumerate(candidates):
        parallel = hlopar.parallelize(
            step.step,
            cluster=hlopar.Cluster.local(hosts, per_host),
            method=method,
            batch_argnums=(2,),
            verbose=False,
            **extra,
            **options,
        )
        if len(parallel.plan(*args)[0].program.meshes) > 1 or k == len(candidates) - 1:
            return parallel
    raise AssertionError("unreachable")


def bench(args) -> dict:
    config = gpt.GPTConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        seq_len=args.seq,
        vocab_size=args.vocab,
        batch_size=args.batch,
    )
    step = gpt.train_step(config)
    params = step.init(jax.random.PRNGKey(0))
    train_args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(train_args[:2]))
    with tempfile.TemporaryDirectory(prefix="hlopar-bench-checkpoint-") as scratch:
        plain = pipelined(step, train_args)
        saving = pipelined(
            step,
            train_args,
            checkpoint_every=args.every,
            checkpoint_dir=Path(scratch) / "checkpoints",
            checkpoint_format=args.format,
        )
        runners = [
            Runner("no-checkpoints", plain, train_args, {}, plain.close),
            Runner(f"{args.format}-every-{args.every}", saving, train_args, {}, saving.close),
        ]
        try:
            for runner in runners:
                clock = time.perf_counter()
                runner.first()
                runner.row["first_call_s"] = time.perf_counter() - clock
            for k in range(args.rounds):  # ABBA: a load that rises or falls favours neither
                for runner in runners if k % 2 == 0 else runners[::-1]:
                    runner.measure(args.warmup, args.steps)
            last = saving.wait_for_checkpoint()
            saves = saving._saves
            committed = sorted(int(p.name) for p in (Path(scratch) / "checkpoints").iterdir() if p.name.isdigit())
            size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) if last else 0
            runtime = plain.runtime
            meshes = {m: len(runtime.program.devices[m]) for m in runtime.program.meshes}
        finally:
            for runner in runners:
                runner.close()
    rows = []
    for runner in runners:
        times = runner.times
        rows.append(
            {
                "way": runner.way,
                "step_s": statistics.median(times),
                "mean_s": statistics.fmean(times),
                "max_s": max(times),
                "first_call_s": runner.row["first_call_s"],
                "loss": runner.loss,
                "steps_s": times,
            }
        )
    base, saved = rows
    return {
        "machine": machine(),
        "config": {**vars(args), "state_bytes": state_bytes, "meshes": meshes, "calls": saves.calls},
        "rows": rows,
        "ratio_mean": saved["mean_s"] / base["mean_s"],
        "ratio_median": saved["step_s"] / base["step_s"],
        "saves": {
            "every": args.every,
            "committed": len(saves.seconds),
            "kept": committed,
            "save_s": saves.seconds,
            "errors": saves.errors,
            "save_bytes": size,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--every", type=int, default=5, help="checkpoint_every (calls)")
    parser.add_argument("--format", default="orbax", choices=("orbax", "npz"), help="checkpoint_format")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each round's")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    report = bench(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    m = report["machine"]
    print(
        f"{m['cpu']} ({m['nproc']} cores), jax {m['jax']}; GPT state {report['config']['state_bytes'] / 2**20:.1f} "
        f"MiB (parameters and Adam), meshes {report['config']['meshes']}"
    )
    print(f"{'way':24} {'median s':>9} {'mean s':>9} {'max s':>9} {'first s':>8} {'loss':>9}")
    for row in report["rows"]:
        print(
            f"{row['way']:24} {row['step_s']:9.4f} {row['mean_s']:9.4f} {row['max_s']:9.4f} "
            f"{row['first_call_s']:8.1f} {row['loss']:9.5f}"
        )
    saves = report["saves"]
    print(
        f"ratio (checkpointing / not): mean {report['ratio_mean']:.3f}, median {report['ratio_median']:.3f} "
        f"(target 1.05); {saves['committed']} saves committed in {report['config']['calls']} calls (every "
        f"{saves['every']}; one still being written when the next is due waits), "
        f"each {saves['save_bytes'] / 2**20:.1f} MiB, "
        f"{statistics.median(saves['save_s'] or [0]):.2f} s from call to commit (median); errors "
        f"{saves['errors'] or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
