#!/usr/bin/env python3
"""The Ray runtime's overhead, and the CPU transport's throughput.

    python tools/bench_runtime.py [--json] [--steps 5] [--hidden 256] [--layers 4] [--seq 64] [--batch 16]
                                  [--microbatches 2] [--schedule 1f1b] [--sizes 1,16,64]

1. Overhead. A GPT (the zoo's model at the given size) trains through `hlopar.parallelize`
   on 2 simulated hosts x 4 CPU devices (two Ray workers: one per mesh and host, Ray started
   here). For each step after the first (warm-up: planning, worker start, compilation) it
   reports:
   - `wall_s`: the call as the user sees it (arguments sent, the step, every result back on
     the driver as jax arrays);
   - `runtime_s`: the driver's `RayRuntime.run` (the same minus turning the results into jax
     arrays);
   - `executables_s`: the sum, over the meshes, of the time their executables ran
     (measured by the workers in the same run, each execution waited for; a mesh across
     both hosts: its slower worker's, the two run the same SPMD program together);
   - `critical_s`: the slowest worker's own step time (`run_step`, the stream and the
     updates, without the driver's calls);
   and the ratios wall / executables and runtime / executables. With 2 cores shared by two
   workers, the two meshes' executables do not overlap, so the sum is the compute the step
   cannot go below.
2. Transport. A payload of each size (MiB) goes from one Ray actor to another through
   `ObjectStoreTransport.send` (the receiver's `deliver` puts it in its mailbox, the sender
   waits for the call), against `numpy.copy` of the same bytes in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hlopar.runtime.host_devices import use_host_devices  # noqa: E402

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402

import hlopar  # noqa: E402
from hlopar.models import gpt  # noqa: E402
from hlopar.runtime import local_ray  # noqa: E402
from hlopar.runtime.transports import Mailbox, ObjectStoreTransport, Payload  # noqa: E402


def bench_overhead(args) -> dict:
    config = gpt.GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                           seq_len=args.seq, vocab_size=args.vocab, batch_size=args.batch)
    step = gpt.train_step(config)
    params = step.init(jax.random.PRNGKey(0))
    state = step.init_opt_state(params)
    batch = step.make_batch(jax.random.PRNGKey(1))
    parallel = hlopar.parallelize(step.step, cluster=hlopar.Cluster.local(num_hosts=2, devices_per_host=4),
                                  num_microbatches=args.microbatches, schedule=args.schedule, batch_argnums=(2,),
                                  verbose=not args.json)
    clock = time.perf_counter()
    params, state, loss = parallel(params, state, batch)
    first = time.perf_counter() - clock
    rows = []
    for _ in range(args.steps):
        clock = time.perf_counter()
        params, state, loss = parallel(params, state, batch)
        wall = time.perf_counter() - clock
        stats = parallel.last_stats
        executables = stats.executable_s
        rows.append({"wall_s": wall, "runtime_s": stats.wall_s, "executables_s": executables,
                     "critical_s": max(w["step_s"] for w in stats.workers.values()),
                     "sent_bytes": sum(w["sent_bytes"] for w in stats.workers.values()),
                     "loss": float(loss)})
    program = parallel.runtime.program
    parallel.shutdown()
    median = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "runtime_s", "executables_s", "critical_s")}
    return {"config": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                       "vocab": args.vocab, "params": step.param_count(), "microbatches": args.microbatches,
                       "schedule": args.schedule, "meshes": {m: list(program.devices[m]) for m in program.meshes}},
            "first_call_s": first, "steps": rows, "median": median,
            "wall_over_executables": median["wall_s"] / median["executables_s"],
            "runtime_over_executables": median["runtime_s"] / median["executables_s"]}


@ray.remote
class _Receiver:
    def __init__(self):
        self.mailbox = Mailbox()

    def deliver(self, step, items):
        for (name, m), payload in items.items():
            self.mailbox.put((step, name, m), payload)
        return sum(p.nbytes for p in items.values())

    def take(self, step):
        return self.mailbox.take((step, "t", 0), 60).nbytes


@ray.remote
class _Sender:
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


def bench_transport(sizes_mib: list[float], repeats: int) -> list[dict]:
    receiver, sender = _Receiver.remote(), _Sender.remote()
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
        rows.append({"mib": mib, "transport_s": transport, "copy_s": copy,
                     "transport_gbps": nbytes / transport / 1e9, "copy_gbps": nbytes / copy / 1e9,
                     "slowdown": transport / copy})
    for actor in (receiver, sender):
        ray.kill(actor)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "eager-1f1b"))
    parser.add_argument("--sizes", default="1,16,64", help="transport payloads, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    local = local_ray.connect(None, 4)  # hlopar's own local Ray, as parallelize starts it
    report = {}
    if not args.skip_overhead:
        report["overhead"] = bench_overhead(args)
    report["transport"] = bench_transport([float(s) for s in args.sizes.split(",")], args.repeats)
    local.stop()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    if "overhead" in report:
        o = report["overhead"]
        print(f"GPT {o['config']}: first call {o['first_call_s']:.1f} s")
        print(f"{'wall':>9} {'runtime':>9} {'execs':>9} {'critical':>9}  (seconds per step)")
        for r in o["steps"]:
            print(f"{r['wall_s']:9.4f} {r['runtime_s']:9.4f} {r['executables_s']:9.4f} {r['critical_s']:9.4f}")
        print(f"median: wall / executables = {o['wall_over_executables']:.3f}, "
              f"runtime / executables = {o['runtime_over_executables']:.3f}")
    print(f"{'MiB':>6} {'transport s':>12} {'GB/s':>7} {'copy s':>9} {'GB/s':>7} {'slowdown':>9}")
    for r in report["transport"]:
        print(f"{r['mib']:6g} {r['transport_s']:12.5f} {r['transport_gbps']:7.2f} {r['copy_s']:9.5f} "
              f"{r['copy_gbps']:7.2f} {r['slowdown']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
