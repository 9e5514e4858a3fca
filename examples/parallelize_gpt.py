#!/usr/bin/env python3
"""Train the zoo's tiny GPT through `hlopar.parallelize`, next to single-device JAX.

    python examples/parallelize_gpt.py [--steps 5] [--hosts 2] [--devices-per-host 4]
                                       [--schedule NAME] [--microbatches 2] [--method auto]
                                       [--runtime auto] [--address ray://head:10001]

Without `--address`, the machine at hand: hosts are simulated on local CPU devices, and the
plan runs in this process, every mesh on its own devices (`--runtime ray`: a local Ray of
its own, one worker per mesh and host). Prints the plan (stages, meshes, shardings), then each step's
loss next to single-device JAX's and its time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    from hlopar.analysis.schedules import DEFAULT_SCHEDULE, SCHEDULES  # pure Python: no jax yet

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=tuple(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--method", default="auto", choices=("auto", "shard", "pipeline"))
    parser.add_argument("--model", default="gpt", help="a zoo model with a 'tiny' configuration")
    parser.add_argument("--runtime", default="auto", choices=("auto", "ray", "process"))
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: this machine)")
    args = parser.parse_args()
    from hlopar.runtime.host_devices import use_host_devices

    use_host_devices(args.hosts * args.devices_per_host)

    import jax

    import hlopar
    from hlopar.models import get_train_step

    if args.address:
        cluster = hlopar.Cluster(address=args.address, num_hosts=args.hosts, devices_per_host=args.devices_per_host)
    else:
        cluster = hlopar.Cluster.local(num_hosts=args.hosts, devices_per_host=args.devices_per_host, device_kind="cpu")
    model = get_train_step(args.model, "tiny")
    params = model.init(jax.random.PRNGKey(0))
    state = model.init_opt_state(params)
    batch = model.make_batch(jax.random.PRNGKey(1))
    step = hlopar.parallelize(
        model.step,
        cluster=cluster,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        method=args.method,
        batch_argnums=(2,),
        runtime=args.runtime,
    )
    p, s, rp, rs = params, state, params, state
    for k in range(args.steps):
        clock = time.perf_counter()
        p, s, loss = step(p, s, batch)
        value = float(loss)  # the step done (a plan run in this process returns before it is)
        seconds = time.perf_counter() - clock
        if k == 0:  # after the first call's plan and progress lines, right above the rows
            print(f"{'step':>4} {'hlopar loss':>14} {'jax loss':>14} {'rel. diff':>10} {'time':>9}", flush=True)
        rp, rs, reference = model.jitted_step(rp, rs, batch)
        diff = abs(value - float(reference)) / max(abs(float(reference)), 1e-30)
        print(
            f"{k:4d} {value:14.8f} {float(reference):14.8f} {diff:10.2e} {seconds * 1e3:7.1f} ms"
            + ("  (the first call: lower, plan, start workers or compile here)" if k == 0 else "")
        )
    step.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
