#!/usr/bin/env python3
"""hlopar's runtime against what users run instead, in one process and one run.

    python tools/bench_runtime.py [--json] [--quick] [--steps 5] [--warmup 2] [--rounds 3] [--ways W,W,...]
                                  [--hidden 256] [--layers 4] [--seq 64] [--batch 16] [--vocab 1024]
                                  [--transport 1,16,64]

The zoo's GPT (`hlopar.models.gpt`; by default hidden 256, 4 layers, 4 heads, seq 64, batch
16, vocabulary 1024: 3.4 M parameters, Adam) trains from the same initial state in each of
these ways, on the 8 CPU devices of this process (`XLA_FLAGS` set here) or on hlopar's Ray
workers (each its own 8 or 4 CPU devices, on the same cores):

- `jit-1-device`: `jax.jit` on one device (the ratios' denominator, `ratio_to_jit`);
- `jit-data-parallel`: `jax.jit` with the batch sharded over the 8 devices, the parameters
  and optimizer state replicated;
- `jit-plan-shardings`: `jax.jit` with the shardings of hlopar's `method="shard"` plan on
  `Cluster.local(1, 8)`, read from the planned fragments' `sdy.sharding`s on the same 8
  devices: each result as the fragment making it lays it out, the parameters and optimizer
  state also so as arguments (where they live between steps; a fragment reading them in
  another layout reshards inside the program), the batch as its first reader reads it:
  XLA's own propagation inside from the plan's boundary layouts;
- `xla-shard-plan`: the whole step planned by `hlopar-auto-sharding` on the same 1 x 8 mesh
  (every op's sharding, as the "shard" plan's one stage is planned) and compiled as one
  executable by stock jaxlib (`codegen.executables.compile_executable`), run in this
  process on `jax.Array`s: the plan as one program, without hlopar's runtime;
- `fragments-shard-plan`: the "shard" plan's own executables (its forward, backward and
  update fragments) chained in this process on `jax.Array`s by
  `local_executor.PipelinedStep`: the plan fragment by fragment, without Ray;
- `one-program-shard-plan`: the same plan as the one executable its worker runs (one mesh,
  one microbatch: `codegen.one_program`), run in this process on `jax.Array`s, each step on
  the last step's results as they left the devices: the plan without hlopar's runtime, so
  that `hlopar-shard-1x8` over it is the runtime's own cost;
- `hlopar-<method>-<hosts>x<devices>`: `hlopar.parallelize(method=...)` on
  `Cluster.local(hosts, devices)`: shard, auto and pipeline on 1 x 8, each run in this
  process where the plan allows it (`runtime="auto"`: its one executable, or every mesh's
  stream; `runtime.in_process`); `hlopar-shard-1x8-ray`: the "shard" plan on a Ray worker
  (`runtime="ray"`), the Ray runtime's own cost; `hlopar-pipelined-2x4`:
  a pipelined plan on two simulated hosts of 4 devices, 1f1b, the first of method
  pipeline or auto, 2 or 4 microbatches, whose plan has several meshes (the row says which),
  run in this process (every mesh's stream here); `hlopar-pipelined-2x4-ray`: the same on
  Ray workers, one per mesh.

A step is the call and reading the loss as a Python float (what a training loop that logs
does); its time is the time from the end of one step to the end of the next, so a runtime
that returns before its work is done pays for it at the next step. Each way first runs a
first call (compilation, planning, worker start: `first_call_s`); then, `--rounds` times,
each way in turn runs `--warmup` untimed and `--steps` timed steps (all hlopar functions
open at once: a load that comes and goes on a shared machine falls on every way alike);
`step_s` is the median of a way's timed steps. The losses after the same number of steps
are printed beside each other (they agree to rounding: the same training).

For hlopar rows the runtime's own timing (`ParallelizedFunction.last_stats`) is reported as
medians too (for a plan run in this process, which has no worker, `dispatch_s`: the call's
return, its step not waited for): `placed`, the most arguments the runtime placed in one
timed step (from the host, or moved to another layout: a plan whose state leaves each step
as the next reads it places only the batch); `critical_s`, the slowest worker's own step (its `run_step`: stream, waits
and updates), `executables_s` (the sum over meshes of their executables' run time) and
`step_over_critical`. The targets of issue 18 are checked in `targets`: the "shard" plan at
most 1.05x the same plan without the runtime (`shard_over_...`; on Ray, `ray_shard_over_...`),
against `jit-plan-shardings`, `xla-shard-plan`, `fragments-shard-plan` and
`one-program-shard-plan` (the like for like); a pipelined plan's step at most 1.2x its
slowest worker's critical path.

`--json` prints `{"machine", "config", "rows": [{"way", "step_s", "ratio_to_jit", ...}],
"targets"}`. `--quick` (a test runs it): a GPT of hidden 64, 2 layers, seq 16, batch 8,
vocabulary 128, 1 warm-up and 2 timed steps, the ways in this process but `xla-shard-plan`
(planning the whole step is the slowest part) and hlopar's "shard" plan in process and on
Ray. `--transport SIZES`: also the CPU transport's throughput, a payload of each size (MiB)
from one Ray actor to another through `ObjectStoreTransport.send` against `numpy.copy` of
the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hlopar.runtime.host_devices import use_host_devices  # noqa: E402

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import hlopar  # noqa: E402
from hlopar.codegen.spmd import main_shardings  # noqa: E402
from hlopar.models import gpt  # noqa: E402

IN_PROCESS_WAYS = (
    "jit-1-device",
    "jit-data-parallel",
    "jit-plan-shardings",
    "xla-shard-plan",
    "fragments-shard-plan",
    "one-program-shard-plan",
)
HLOPAR_WAYS = {  # way -> hosts, devices per host, the (method, options) to try in turn
    "hlopar-shard-1x8": (1, 8, [("shard", {})]),
    "hlopar-shard-1x8-ray": (1, 8, [("shard", {"runtime": "ray"})]),
    "hlopar-auto-1x8": (1, 8, [("auto", {})]),
    "hlopar-pipeline-1x8": (1, 8, [("pipeline", {})]),
    # The planner chooses the stages (its costs change with the code): the first plan of
    # several meshes.
    "hlopar-pipelined-2x4": (
        2,
        4,
        [(method, {"num_microbatches": b, "schedule": "1f1b"}) for b in (2, 4) for method in ("pipeline", "auto")],
    ),
    "hlopar-pipelined-2x4-ray": (
        2,
        4,
        [
            (method, {"num_microbatches": b, "schedule": "1f1b", "runtime": "ray"})
            for b in (2, 4)
            for method in ("pipeline", "auto")
        ],
    ),
}
WAYS = IN_PROCESS_WAYS + tuple(HLOPAR_WAYS)
QUICK_WAYS = (
    "jit-1-device",
    "jit-data-parallel",
    "jit-plan-shardings",
    "fragments-shard-plan",
    "one-program-shard-plan",
    "hlopar-shard-1x8",
    "hlopar-shard-1x8-ray",
)
TARGET_SAME_SHARDINGS = 1.05
TARGET_CRITICAL = 1.2


# --------------------------------------------------------------------------- timing


@dataclass
class Runner:
    """One way, set up: its step, the arguments its next step takes (the last step's outputs),
    what the row says of it, and what its steps measured so far."""

    way: str
    call: Callable
    args: tuple
    row: dict
    close: Callable = lambda: None
    times: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    placed: list = field(default_factory=list)  # per timed step: arguments the runtime placed
    loss: float = float("nan")

    def step(self) -> None:
        params, state, loss = self.call(*self.args)
        self.args = (params, state, self.args[2])
        self.loss = float(loss)

    def first(self) -> Runner:
        clock = time.perf_counter()
        self.step()
        self.row["first_call_s"] = self.row.get("first_call_s", 0.0) + time.perf_counter() - clock
        return self

    def measure(self, warmup: int, steps: int) -> None:
        """`warmup` steps, then `steps` timed ones, each from the end of the last."""
        for _ in range(warmup):
            self.step()
        clock = time.perf_counter()
        for _ in range(steps):
            self.step()
            now = time.perf_counter()
            self.times.append(now - clock)
            clock = now
            self.stats.append(getattr(self.call, "last_stats", None))
            self.placed.append(_placed(self.call))

    def result(self) -> dict:
        return {
            "way": self.way,
            "step_s": statistics.median(self.times),
            "steps_s": self.times,
            **self.row,
            "loss": self.loss,
            **_worker_medians(self.stats),
            **({"placed": max(self.placed)} if None not in self.placed and self.placed else {}),
        }


def _placed(call) -> int | None:
    """Arguments the hlopar runtime placed in its last step (from the host, or moved to another
    layout): every worker's on Ray, this process's otherwise; None for jax.jit."""
    stats = getattr(call, "last_stats", None)
    if stats is not None and stats.workers:
        return sum(w.get("placed", 0) for w in stats.workers.values())
    return getattr(getattr(call, "runtime", None), "placed", None)


def _worker_medians(stats: list) -> dict:
    """Medians of the runtime's own step timing (hlopar rows; nothing for jax.jit)."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return {}
    if not any(s.workers for s in stats):  # run in this process: its dispatch, not waited for
        return {"dispatch_s": statistics.median(s.wall_s for s in stats)}
    try:
        critical = statistics.median(max(w["step_s"] for w in s.workers.values()) for s in stats)
        return {
            "critical_s": critical,
            "executables_s": statistics.median(s.executable_s for s in stats),
            "driver_s": statistics.median(s.wall_s for s in stats),
        }
    except (AttributeError, KeyError, TypeError, ValueError) as error:  # the runtime's timing changed shape
        return {"runtime_stats": f"unreadable: {type(error).__name__}: {error}"}


# --------------------------------------------------------------------------- the ways


def jit_way(way: str, step, args, plan_shardings) -> Runner:
    """`step.step` under `jax.jit` as `way` lays it out; arguments placed before timing."""
    devices = jax.devices()[:8]
    if way == "jit-1-device":
        return Runner(way, jax.jit(step.step), jax.device_put(args, devices[0]), {}).first()
    if way == "jit-data-parallel":
        mesh = Mesh(np.array(devices), ("data",))
        replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        ins = (
            jax.tree_util.tree_map(lambda _: replicated, args[0]),
            jax.tree_util.tree_map(lambda _: replicated, args[1]),
            jax.tree_util.tree_map(lambda _: rows, args[2]),
        )
        outs = (ins[0], ins[1], replicated)
    else:
        ins, outs = plan_shardings
    jitted = jax.jit(step.step, in_shardings=ins, out_shardings=outs)
    return Runner(way, jitted, jax.device_put(args, ins), {}).first()


def whole_plan_way(step, args) -> Runner:
    """`xla-shard-plan` (module docstring): hlopar-auto-sharding's plan of the whole step on
    1 x 8 as one executable; each step runs it on the last step's `jax.Array`s."""
    from hlopar.codegen.executables import compile_executable
    from hlopar.ir.module import parse_module
    from hlopar.passes.auto_sharding import AutoShardingPass
    from hlopar.passes.base import PassContext
    from hlopar.passes.import_program import ImportPass

    clock = time.perf_counter()
    lowered = jax.jit(step.step, keep_unused=True).lower(*args)
    module = parse_module(lowered.as_text())
    context = PassContext()
    ImportPass().run(module, context)
    AutoShardingPass(mesh_shape=(1, 8), axis_names=("x", "y"), preset="cpu").run(module, context)
    executable = compile_executable(module, jax.devices()[:8])

    def call(params, state, batch):
        return jax.tree_util.tree_unflatten(
            lowered.out_tree, executable.run(jax.tree_util.tree_leaves((params, state, batch)))
        )

    return Runner("xla-shard-plan", call, args, {"first_call_s": time.perf_counter() - clock}).first()


def shard_plan(step, args) -> tuple:
    """The `method="shard"` plan on `Cluster.local(1, 8)` (as `hlopar-shard-1x8` plans it:
    the same cache entry) and jax's lowering of the step."""
    parallel = hlopar.parallelize(step.step, cluster=hlopar.Cluster.local(1, 8), method="shard", verbose=False)
    return parallel.plan(*args)


def fragments_way(step, args, plan) -> Runner:
    """`fragments-shard-plan` (module docstring)."""
    from hlopar.runtime.local_executor import PipelinedStep

    planned, lowered = plan
    clock = time.perf_counter()
    local = PipelinedStep(planned.program, "eager-1f1b", dict(enumerate(jax.devices())))

    def call(params, state, batch):
        return jax.tree_util.tree_unflatten(
            lowered.out_tree, local.run(jax.tree_util.tree_leaves((params, state, batch)))
        )

    return Runner("fragments-shard-plan", call, args, {"first_call_s": time.perf_counter() - clock}).first()


def one_program_way(step, args, plan) -> Runner:
    """`one-program-shard-plan` (module docstring)."""
    from hlopar.codegen.executables import compile_executable
    from hlopar.codegen.one_program import one_program
    from hlopar.runtime.fragment_calls import Placements

    planned, lowered = plan
    program = planned.program
    clock = time.perf_counter()
    module = one_program(program)
    if module is None:
        raise SystemExit("the shard plan is not one mesh and one microbatch: it has no one-program form")
    executable = compile_executable(module, [jax.devices()[d] for d in program.devices[program.meshes[0]]])

    def call(params, state, batch):  # as the worker runs it: each (argument, layout) placed once
        inputs = Placements().inputs(executable, jax.tree_util.tree_leaves((params, state, batch)), 0)
        return jax.tree_util.tree_unflatten(lowered.out_tree, executable.run(inputs))

    return Runner("one-program-shard-plan", call, args, {"first_call_s": time.perf_counter() - clock}).first()


def planned_shardings(args, plan) -> tuple:
    """The `method="shard"` plan's shardings, as `jax.jit` takes them (pytrees of
    `NamedSharding` for the arguments and the results)."""
    planned, lowered = plan
    program = planned.program
    if len(program.meshes) != 1 or program.index_arg is not None:
        raise SystemExit(
            f"the shard plan has meshes {program.meshes} and index argument {program.index_arg}: "
            "jit-plan-shardings needs one mesh and the step's own arguments"
        )
    devices = [jax.devices()[d] for d in program.devices[program.meshes[0]]]
    shardings = {f.name: main_shardings(f.module, devices) for f in program.fragments}
    replicated = NamedSharding(shardings[program.fragments[0].name][0][0].mesh, PartitionSpec())

    def read_as(v: int) -> NamedSharding:  # the first reader's layout (an unread argument: replicated)
        for fragment in program.fragments:
            if v in fragment.operands:
                return shardings[fragment.name][0][len(fragment.accumulate) + fragment.operands.index(v)]
        return replicated

    def made_as(v: int) -> NamedSharding:  # its producer's layout (an argument returned as it is: read_as)
        fragment = program.fragments[program.values[v].producer] if program.values[v].producer is not None else None
        return shardings[fragment.name][1][fragment.results.index(v)] if fragment else read_as(v)

    by_argument = {value.argument: v for v, value in enumerate(program.values) if value.argument is not None}
    ins = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(args), [read_as(by_argument[i]) for i in range(len(program.argument_shapes))]
    )
    outs = jax.tree_util.tree_unflatten(lowered.out_tree, [made_as(v) for v in program.results])
    return (outs[0], outs[1], ins[2]), outs  # the state where the step leaves it


def hlopar_way(way: str, step, args) -> Runner:
    """`hlopar.parallelize` as `HLOPAR_WAYS` says; for a pipelined way, the first of its
    candidates whose plan has several meshes (planned first, without workers), else the last."""
    hosts, per_host, candidates = HLOPAR_WAYS[way]
    clock = time.perf_counter()
    for k, (method, options) in enumerate(candidates):
        parallel = hlopar.parallelize(
            step.step,
            cluster=hlopar.Cluster.local(hosts, per_host),
            method=method,
            batch_argnums=(2,),
            verbose=False,
            **options,
        )
        if len(candidates) == 1 or len(parallel.plan(*args)[0].program.meshes) > 1 or k == len(candidates) - 1:
            break
    runner = Runner(
        way,
        parallel,
        args,
        {"method": method, "cluster": f"{hosts}x{per_host}", "first_call_s": time.perf_counter() - clock},
        parallel.close,
    ).first()
    runtime = parallel.runtime
    program = runtime.program
    layout = getattr(runtime, "layout", None)  # Ray's workers; none in process
    runner.row.update(
        {
            "runtime": type(runtime).__name__,
            "microbatches": program.microbatches,
            "workers": len(layout.slots) if layout else 0,
            "meshes": {m: len(program.devices[m]) for m in program.meshes},
        }
    )
    return runner


def bench(args) -> dict:
    """Sets every way up (first calls), then `rounds` rounds of each way's warm-up and timed
    steps in turn (the hlopar functions stay open meanwhile), so that a load that comes and
    goes on the machine falls on every way alike; medians over all timed steps. One long
    function: the ways, their rounds and the medians share the open functions and timings,
    which helpers would only pass back and forth."""
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
    plan = (
        shard_plan(step, train_args)
        if {"jit-plan-shardings", "fragments-shard-plan", "one-program-shard-plan"} & set(args.ways)
        else None
    )
    plan_shardings = planned_shardings(train_args, plan) if "jit-plan-shardings" in args.ways else None
    runners = []
    try:
        for way in args.ways:
            if way == "xla-shard-plan":
                runners.append(whole_plan_way(step, train_args))
            elif way == "fragments-shard-plan":
                runners.append(fragments_way(step, train_args, plan))
            elif way == "one-program-shard-plan":
                runners.append(one_program_way(step, train_args, plan))
            elif way in IN_PROCESS_WAYS:
                runners.append(jit_way(way, step, train_args, plan_shardings))
            else:
                runners.append(hlopar_way(way, step, train_args))
            if not args.json:
                print(f"  {way}: first call {runners[-1].row['first_call_s']:.1f} s", file=sys.stderr)
        for _ in range(args.rounds):
            for runner in runners:
                runner.measure(args.warmup, args.steps)
    finally:
        for runner in runners:
            runner.close()
    rows = []
    for runner in runners:
        row = runner.result()
        if "critical_s" in row:
            row["step_over_critical"] = row["step_s"] / row["critical_s"]
        rows.append(row)
    by_way = {r["way"]: r for r in rows}
    base = by_way.get("jit-1-device")
    for row in rows:
        row["ratio_to_jit"] = row["step_s"] / base["step_s"] if base else None
        for key, other in (
            ("ratio_to_data_parallel", "jit-data-parallel"),
            ("ratio_to_plan_shardings", "jit-plan-shardings"),
            ("ratio_to_whole_plan", "xla-shard-plan"),
            ("ratio_to_fragments", "fragments-shard-plan"),
            ("ratio_to_one_program", "one-program-shard-plan"),
        ):
            if row["way"].startswith("hlopar-") and other in by_way:
                row[key] = row["step_s"] / by_way[other]["step_s"]
    targets = {}
    for key, other in (
        ("ratio_to_plan_shardings", "jit-plan-shardings"),
        ("ratio_to_whole_plan", "xla-shard-plan"),
        ("ratio_to_fragments", "fragments-shard-plan"),
        ("ratio_to_one_program", "one-program-shard-plan"),
    ):
        for way, name in (("hlopar-shard-1x8", "shard"), ("hlopar-shard-1x8-ray", "ray_shard")):
            if way in by_way and other in by_way:
                ratio = by_way[way][key]
                targets[f"{name}_over_{key[len('ratio_to_') :]}"] = {
                    "ratio": ratio,
                    "target": TARGET_SAME_SHARDINGS,
                    "met": ratio <= TARGET_SAME_SHARDINGS,
                }
    for row in rows:
        if len(row.get("meshes", ())) > 1 and "step_over_critical" in row:
            targets[f"{row['way']}_over_critical"] = {
                "ratio": row["step_over_critical"],
                "target": TARGET_CRITICAL,
                "met": row["step_over_critical"] <= TARGET_CRITICAL,
            }
    return {
        "machine": machine(),
        "config": {
            "hidden": args.hidden,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "vocab": args.vocab,
            "params": step.param_count(),
            "warmup": args.warmup,
            "steps": args.steps,
            "rounds": args.rounds,
        },
        "rows": rows,
        "targets": targets,
    }


def machine() -> dict:
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {"nproc": os.cpu_count(), "cpu": model, "jax": jax.__version__, "devices": len(jax.devices())}


# --------------------------------------------------------------------------- the CPU transport


def bench_transport(sizes_mib: list[float], repeats: int) -> list[dict]:
    import ray

    from hlopar.runtime.transports import Mailbox, ObjectStoreTransport, Payload

    class Receiver:
        def __init__(self):
            self.mailbox = Mailbox()

        def deliver(self, step, items):
            for (name, m), payload in items.items():
                self.mailbox.put((step, name, m), payload)
            return sum(p.nbytes for p in items.values())

        def take(self, step):
            return self.mailbox.take((step, "t", 0), 60).nbytes

    class Sender:
        def send(self, peer, nbytes: int, repeats: int) -> list[float]:
            data = np.random.default_rng(0).random(nbytes // 8)
            transport = ObjectStoreTransport()
            times = []
            for k in range(repeats):
                clock = time.perf_counter()
                ray.get(transport.send(peer, k, {("t", 0): Payload(array=data)}))
                times.append(time.perf_counter() - clock)
                ray.get(peer.take.remote(k))
            return times

    if not ray.is_initialized():
        from hlopar.runtime.local_ray import connect

        connect(None, os.cpu_count() or 1)
    receiver = ray.remote(num_cpus=0.01)(Receiver).remote()
    sender = ray.remote(num_cpus=0.01)(Sender).remote()
    rows = []
    for mib in sizes_mib:
        nbytes = int(mib * 2**20)
        times = ray.get(sender.send.remote(receiver, nbytes, repeats))
        data = np.random.default_rng(0).random(nbytes // 8)
        copies = []
        for _ in range(repeats):
            clock = time.perf_counter()
            np.copy(data)
            copies.append(time.perf_counter() - clock)
        transport, copy = statistics.median(times), statistics.median(copies)
        rows.append(
            {
                "mib": mib,
                "transport_s": transport,
                "copy_s": copy,
                "transport_gbps": nbytes / transport / 1e9,
                "copy_gbps": nbytes / copy / 1e9,
                "slowdown": transport / copy,
            }
        )
    for actor in (receiver, sender):
        ray.kill(actor)
    return rows


# --------------------------------------------------------------------------- the report


def print_table(report: dict) -> None:
    c, m = report["config"], report["machine"]
    print(
        f"GPT hidden {c['hidden']}, {c['layers']} layers, seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']} "
        f"({c['params'] / 1e6:.2f} M params); {m['nproc']} cores ({m['cpu']}), jax {m['jax']}; median of "
        f"{c['rounds']} x {c['steps']} steps, each round after {c['warmup']} warm-up"
    )
    print(
        f"{'way':<24} {'step s':>8} {'x jit':>6} {'x plan-sh':>9} {'x whole':>7} {'x frags':>7} {'x one':>6} "
        f"{'x dp':>6} "
        f"{'crit s':>7} {'step/crit':>9} {'placed':>6} {'1st call s':>10} {'loss':>9}  plan"
    )

    def num(row, key, spec):
        return format(row[key], spec) if row.get(key) is not None else "-"

    for r in report["rows"]:
        print(
            f"{r['way']:<24} {r['step_s']:8.4f} {num(r, 'ratio_to_jit', '6.2f'):>6} "
            f"{num(r, 'ratio_to_plan_shardings', '9.2f'):>9} {num(r, 'ratio_to_whole_plan', '7.2f'):>7} "
            f"{num(r, 'ratio_to_fragments', '7.2f'):>7} {num(r, 'ratio_to_one_program', '6.2f'):>6} "
            f"{num(r, 'ratio_to_data_parallel', '6.2f'):>6} "
            f"{num(r, 'critical_s', '7.4f'):>7} {num(r, 'step_over_critical', '9.2f'):>9} {num(r, 'placed', 'd'):>6} "
            f"{r['first_call_s']:10.1f} "
            f"{r['loss']:9.5f}  " + (f"{r['method']} B={r['microbatches']} {r['meshes']}" if "meshes" in r else "")
        )
    for r in report["rows"]:
        if "runtime_stats" in r:
            print(f"{r['way']}: the runtime's own timing is {r['runtime_stats']}")
    for name, t in report["targets"].items():
        print(f"target {name}: {t['ratio']:.3f} (at most {t['target']}): {'met' if t['met'] else 'NOT met'}")
    for r in report.get("transport", ()):
        print(
            f"transport {r['mib']:g} MiB: {r['transport_s']:.5f} s ({r['transport_gbps']:.2f} GB/s) vs np.copy "
            f"{r['copy_s']:.5f} s ({r['copy_gbps']:.2f} GB/s), {r['slowdown']:.1f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a small GPT, few steps, fewer ways")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --quick 2)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps before each round's (default 2; --quick 1)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds over the ways (default 3; --quick 1)")
    parser.add_argument("--ways", default=None, help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--transport", default=None, help="also the transport, payloads in MiB (e.g. 1,16,64)")
    parser.add_argument("--repeats", type=int, default=5, help="transport repeats")
    args = parser.parse_args()
    defaults = (
        {"steps": 2, "warmup": 1, "rounds": 1, "hidden": 64, "layers": 2, "seq": 16, "batch": 8, "vocab": 128}
        if args.quick
        else {"steps": 5, "warmup": 2, "rounds": 3, "hidden": 256, "layers": 4, "seq": 64, "batch": 16, "vocab": 1024}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ways = args.ways.split(",") if args.ways else list(QUICK_WAYS if args.quick else WAYS)
    unknown = [w for w in args.ways if w not in WAYS]
    if unknown:
        parser.error(f"unknown ways {unknown}; the ways are {', '.join(WAYS)}")
    if args.batch % 8:
        parser.error(f"--batch {args.batch}: the data-parallel and sharded ways cut the batch over 8 devices")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    report = bench(args)
    if args.transport:
        report["transport"] = bench_transport([float(s) for s in args.transport.split(",")], args.repeats)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
