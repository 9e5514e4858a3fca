#!/usr/bin/env python3
"""The planner's predicted step times against measured ones, for the candidate plans of a step.

    python tools/check_predictions.py [STEP ...] [--cluster 2x4] [--preset P | --calibrate] [--microbatches 4]
                                      [--steps 5] [--warmup 2] [--rounds 3] [--stages 1,2,4]
                                      [--schedules gpipe,1f1b,eager-1f1b,zb-h1] [--json]

STEP is a zoo step, `model:config` (default `gpt:tiny` and `mlp:tiny`), or a JAX function of
your own, `path/to/file.py:factory`, where `factory()` returns a dict with `step` (the
function), `args` (a tuple of its arguments) and optionally `batch_argnums` (default (2,)).
Or an exported module, `step.mlir` / `step.mlirbc` (`hlopar.ModuleStep`): its arguments are
made from `@main`'s types (floats drawn from N(0, 0.02), integers and booleans zero, seeded),
its state is the longest run of leading arguments whose types equal the results' at the same
positions (each step feeds those results back), the rest its batch; the last result is read
as the loss. A module is not a JAX function: it has no `jax.jit data-parallel` candidate.

For each step, on `Cluster.local(hosts, devices)` with `--preset` (a built-in preset or a
preset file, `hlopar-calibrate -o FILE`; `--calibrate`: this machine calibrated at the start
of the run), the candidates are planned and run in this process
(`runtime="auto"`), each on its own:

- `auto`: `parallelize`'s default plan (`schedule="auto"`: stages, submeshes, schedule and
  microbatches chosen), the plan the planner picks;
- `S stages / schedule`: exactly S stages (`stages=S`) with each schedule, at `--microbatches`;
- `shard`: one mesh of every device (`method="shard"`); no prediction (its plan has none);
- `jax.jit data-parallel`: the batch split over every device, the state replicated; measured
  only, the outside reference.

Each first call plans and compiles; then, `--rounds` times, each candidate in turn runs
`--warmup` untimed and `--steps` timed steps (interleaved: a load that comes and goes falls
on all alike); a step is the call and its loss read as a float, each step fed the last one's
state. Printed per candidate: predicted step (the stage construction report's
`simulated_step_seconds`, the plan's step in the simulator; its `predicted_step_seconds`,
Alpa's Eq. 2, where there is none), measured step (median of every round's steps; the range of the
rounds' medians), the relative error; per step: the Spearman rank correlation of predicted
and measured over the candidates with a prediction, the median relative error, and how much
slower than the fastest measured candidate `auto` runs (issue 31's targets: correlation at
least 0.8, median error at most 15%, auto within 10% of the fastest). Peak memory is not
measured: XLA's CPU devices keep no allocator statistics.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hlopar.runtime.host_devices import use_host_devices  # noqa: E402

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hlopar.module_step import ModuleStep  # noqa: E402

TARGETS = {"spearman_at_least": 0.8, "median_error_at_most": 0.15, "auto_over_fastest_at_most": 1.10}


@dataclass
class Candidate:
    """One plan of a step (or the jax.jit reference), set up, and its timings so far."""

    name: str
    call: object
    args: tuple
    predicted_s: float | None = None
    row: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # per round, its timed steps

    state: int = 2  # the leading arguments each step's leading results replace

    def step(self) -> None:
        outputs = self.call(*self.args)
        self.args = (*outputs[: self.state], *self.args[self.state :])
        float(jax.tree_util.tree_leaves(outputs[-1])[0])

    def measure(self, warmup: int, steps: int) -> None:
        for _ in range(warmup):
            self.step()
        times = []
        clock = time.perf_counter()
        for _ in range(steps):
            self.step()
            now = time.perf_counter()
            times.append(now - clock)
            clock = now
        self.rounds.append(times)

    def result(self) -> dict:
        medians = [statistics.median(r) for r in self.rounds]
        measured = statistics.median([t for r in self.rounds for t in r])
        error = None if self.predicted_s is None else (self.predicted_s - measured) / measured
        return {
            "candidate": self.name,
            "predicted_s": self.predicted_s,
            "measured_s": measured,
            "rounds_s": (min(medians), max(medians)),
            "relative_error": error,
            **self.row,
        }


def load_step(spec: str):
    """(step, args, batch_argnums) of a zoo name, a `file.py:factory` or a module file."""
    if spec.endswith((".mlir", ".mlirbc")):
        return module_step(spec)
    if ".py:" in spec:
        path, name = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if module_spec is None or module_spec.loader is None:
            raise SystemExit(f"{spec}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        made = getattr(module, name)()
        return made["step"], tuple(made["args"]), tuple(made.get("batch_argnums", (2,)))
    from hlopar.models import get_train_step

    model, _, config = spec.partition(":")
    step = get_train_step(model, config or "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step.step, (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1))), (2,)


def module_step(path: str):
    """A module file as a step (module docstring): the `ModuleStep`, arguments made from
    `@main`'s types, and its batch: the arguments after its state."""
    from hlopar.module_step import ModuleStep

    step = ModuleStep(path)
    state = 0
    while state < min(len(step.in_info), len(step.out_info) - 1) and step.in_info[state] == step.out_info[state]:
        state += 1
    if state == 0 or state == len(step.in_info):
        raise SystemExit(
            f"{path}: cannot tell its state from its batch (the state: leading arguments whose types "
            "equal the results' at the same positions, then the batch)"
        )
    draw = np.random.default_rng(0)
    args = tuple(
        (draw.normal(0.0, 0.02, info.shape) if np.issubdtype(info.dtype, np.floating) else np.zeros(info.shape)).astype(
            info.dtype
        )
        for info in step.in_info
    )
    return step, args, tuple(range(state, len(args)))


def hlopar_candidate(name, fn, args, cluster, preset, **options) -> Candidate:
    import hlopar

    parallel = hlopar.parallelize(fn, cluster=hlopar.Cluster.local(*cluster, preset=preset), verbose=False, **options)
    clock = time.perf_counter()
    planned, _ = parallel.plan(*args)
    candidate = Candidate(name, parallel, args, state=min(options["batch_argnums"]))
    candidate.step()  # the first call: compiles and starts
    stages = planned.plan.get("stages") or {}
    simulated = stages.get("simulated_step_seconds")
    candidate.predicted_s = simulated if simulated is not None else stages.get("predicted_step_seconds")
    candidate.row = {
        "stages": len(stages.get("stages", [])),
        "schedule": planned.schedule.name,
        "microbatches": planned.program.microbatches,
        "meshes": {m: len(d) for m, d in planned.program.devices.items()},
        "first_call_s": time.perf_counter() - clock,
    }
    return candidate


def jit_candidate(fn, args, batch_argnums, devices: int) -> Candidate:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # As many devices as divide every batch leaf's rows (the tiny GPT's batch is 4 sequences).
    for k in batch_argnums:
        for leaf in jax.tree_util.tree_leaves(args[k]):
            devices = math.gcd(devices, int(np.shape(leaf)[0]))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    shardings = tuple(
        jax.tree_util.tree_map(lambda _, s=(rows if k in batch_argnums else replicated): s, a)
        for k, a in enumerate(args)
    )
    jitted = jax.jit(fn, in_shardings=shardings)
    clock = time.perf_counter()
    candidate = Candidate(
        f"jax.jit data-parallel ({devices})", jitted, jax.device_put(args, shardings), state=min(batch_argnums)
    )
    candidate.step()
    candidate.row = {"first_call_s": time.perf_counter() - clock}
    return candidate


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (ties get their average rank); None for fewer than 3."""
    if len(x) < 3:
        return None

    def ranks(values):
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        sorted_values = np.asarray(values)[order]
        k = 0
        while k < len(values):
            j = k
            while j + 1 < len(values) and sorted_values[j + 1] == sorted_values[k]:
                j += 1
            out[order[k : j + 1]] = (k + j) / 2.0
            k = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def check_step(spec: str, args: argparse.Namespace) -> dict:
    fn, step_args, batch_argnums = load_step(spec)
    cluster = tuple(int(n) for n in args.cluster.split("x"))
    say = lambda message: print(f"[{spec}] {message}", file=sys.stderr, flush=True)  # noqa: E731
    candidates = []
    say("planning auto")
    candidates.append(hlopar_candidate("auto", fn, step_args, cluster, args.preset, batch_argnums=batch_argnums))
    for stages in args.stages:
        for schedule in args.schedules:
            if stages == 1 and schedule != args.schedules[0]:
                continue  # one stage: every schedule is the same plan
            name = f"{stages} stage(s) / {schedule}" if stages > 1 else "1 stage"
            say(f"planning {name}")
            try:
                candidates.append(
                    hlopar_candidate(
                        name,
                        fn,
                        step_args,
                        cluster,
                        args.preset,
                        batch_argnums=batch_argnums,
                        stages=stages,
                        schedule=schedule,
                        num_microbatches=args.microbatches,
                    )
                )
            except Exception as error:  # noqa: BLE001 - a candidate the planner refuses is reported, not fatal
                say(f"  {name}: not planned: {type(error).__name__}: {str(error)[:200]}")
    say("planning shard")
    candidates.append(
        hlopar_candidate("shard", fn, step_args, cluster, args.preset, batch_argnums=batch_argnums, method="shard")
    )
    candidates[-1].predicted_s = None  # its report holds no prediction
    if not isinstance(fn, ModuleStep):
        candidates.append(jit_candidate(fn, step_args, batch_argnums, cluster[0] * cluster[1]))
    for r in range(args.rounds):
        say(f"round {r + 1} of {args.rounds}")
        for candidate in candidates:
            candidate.measure(args.warmup, args.steps)
    rows = [c.result() for c in candidates]
    predicted = [r for r in rows if r["predicted_s"] is not None]
    fastest = min(r["measured_s"] for r in rows if not r["candidate"].startswith("jax.jit"))
    auto = next(r for r in rows if r["candidate"] == "auto")
    summary = {
        "spearman": spearman([r["predicted_s"] for r in predicted], [r["measured_s"] for r in predicted]),
        "median_error": statistics.median(abs(r["relative_error"]) for r in predicted) if predicted else None,
        "auto_over_fastest": auto["measured_s"] / fastest,
        "fastest": min((r for r in rows if not r["candidate"].startswith("jax.jit")), key=lambda r: r["measured_s"])[
            "candidate"
        ],
    }
    for candidate in candidates:
        close = getattr(candidate.call, "close", None)
        if close is not None:
            close()
    return {"step": spec, "cluster": args.cluster, "preset": args.preset, "rows": rows, "summary": summary}


def print_report(result: dict) -> None:
    print(f"\n{result['step']} on {result['cluster']} (preset {result['preset']}):")
    print(f"  {'candidate':<26} {'predicted':>10} {'measured':>10} {'rounds':>17} {'error':>7}  plan")
    for r in result["rows"]:
        predicted = "-" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.3f}ms"
        error = "-" if r["relative_error"] is None else f"{r['relative_error']:+.0%}"
        low, high = r["rounds_s"]
        plan = (
            f"{r['stages']} stage(s), {r['schedule']}, {r['microbatches']} microbatch(es), meshes {r['meshes']}"
            if "stages" in r
            else ""
        )
        print(
            f"  {r['candidate']:<26} {predicted:>10} {r['measured_s'] * 1e3:>8.3f}ms "
            f"{low * 1e3:>7.3f}-{high * 1e3:<7.3f}ms {error:>7}  {plan}"
        )
    s = result["summary"]
    spearman_text = "-" if s["spearman"] is None else f"{s['spearman']:.2f}"
    error_text = "-" if s["median_error"] is None else f"{s['median_error']:.0%}"
    print(
        f"  Spearman {spearman_text} (target >= {TARGETS['spearman_at_least']}), median |error| {error_text} "
        f"(target <= {TARGETS['median_error_at_most']:.0%}), auto {s['auto_over_fastest']:.2f}x the fastest "
        f"({s['fastest']}; target <= {TARGETS['auto_over_fastest_at_most']}x)"
    )


def calibrated_now(cluster: str) -> str:
    """A preset file of this machine calibrated as `cluster` ("HxD") uses it, just now (not
    the cached one `preset="calibrated"` reads: these machines' speed moves within the hour,
    docs/performance.md)."""
    import tempfile

    import hlopar
    from hlopar.runtime.calibrate import calibrate

    hosts, devices = (int(n) for n in cluster.split("x"))
    path = Path(tempfile.mkdtemp(prefix="hlopar-check-")) / f"calibrated-{cluster}.json"
    clock = time.perf_counter()
    calibrate(hlopar.Cluster.local(hosts, devices), output=path)
    print(f"calibrated {cluster} in {time.perf_counter() - clock:.1f} s: {path}")
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps_", nargs="*", metavar="STEP", default=["gpt:tiny", "mlp:tiny"])
    parser.add_argument("--cluster", default="2x4", help="hosts x devices per host (default 2x4)")
    parser.add_argument("--preset", default=None, help="a built-in preset or a preset file (default: cpu)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", default="1,2,4", type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--schedules", default="gpipe,1f1b,eager-1f1b,zb-h1", type=lambda s: s.split(","))
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate this machine as --cluster first and plan with that preset (instead of --preset): "
        "a calibration is of the machine at that moment",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.calibrate:
        args.preset = calibrated_now(args.cluster)
    results = []
    for spec in args.steps_:
        results.append(check_step(spec, args))
        print_report(results[-1])
    print(f"\nload average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
