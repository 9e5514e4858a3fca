"""`hlopar-calibrate`: time this machine's devices and write a preset file the planner reads.

    hlopar-calibrate [--hosts N] [--devices-per-host D] [--across-processes] [-o FILE]

The file is what `--preset` / `preset=` / `Cluster(preset=...)` take everywhere a cluster
preset is named (`hlopar-opt`'s passes, `hlopar-compile`, `parallelize`). Without `-o` the
file's JSON goes to stdout; the report goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from hlopar.cli.guard import run_guarded

EPILOG = """\
The measurements (runtime/calibrate.py): a large matrix product per device with every device
busy (peak FLOP/s), a chain of small ones (the matmul ramp), a chain of tiny kernels (the cost of
a launch), near-empty executables run back to back as the runtime runs a fragment (what its
one host thread pays per launch, device and value), a value moved between meshes, and the five
collectives over groups of 2 devices, a host's and all of them, fit to the alpha-beta model the
planner prices collectives with. --across-processes adds collectives across --hosts processes
(gloo on CPUs): what a mesh spanning hosts pays on Ray workers (the host thread is then not
priced: each worker launches its own).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hlopar-calibrate",
        description="Time this machine's devices and write a cluster preset file for the planner.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hosts", type=int, default=1, help="hosts of the cluster, simulated here (default: 1)")
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        help="devices per host (default: the devices jax sees over --hosts; on CPU, 8 forced host devices)",
    )
    parser.add_argument(
        "--across-processes", action="store_true", help="also time collectives across --hosts processes"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each measurement (default: 5)")
    parser.add_argument("-o", "--output", default=None, help="the preset file to write (default: stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("hosts", "devices_per_host", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.output is not None:
        parent = Path(args.output).expanduser().resolve().parent
        if not parent.is_dir():
            parser.error(f"-o {args.output}: no such directory {parent}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's start-up lines are no part of the report
    return run_guarded(lambda: _calibrate(args), "hlopar-calibrate")


def _calibrate(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:  # a busy machine: said as the command says things
        warnings.simplefilter("always")
        try:
            return _measure(args)
        except ValueError as error:  # the cluster asked for is not this machine's
            print(f"hlopar-calibrate: error: {error}", file=sys.stderr)
            return 1
        finally:
            for warning in caught:
                print(f"hlopar-calibrate: warning: {warning.message}", file=sys.stderr)


def _measure(args: argparse.Namespace) -> int:
    from hlopar.runtime.host_devices import use_host_devices

    # On CPU the cluster's devices are forced host devices (as the tests and examples do).
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        use_host_devices(args.hosts * (args.devices_per_host or max(1, 8 // args.hosts)))
    from hlopar.analysis.cluster import Cluster
    from hlopar.runtime.calibrate import calibrate

    cluster = Cluster.local(args.hosts, args.devices_per_host)
    say = lambda message: print(f"hlopar-calibrate: {message}", file=sys.stderr, flush=True)  # noqa: E731
    if args.output is not None:
        result = calibrate(
            cluster, output=args.output, across_processes=args.across_processes, repeats=args.repeats, progress=say
        )
        print(result.report(), file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="hlopar-calibrate-") as tmp:
        result = calibrate(
            cluster,
            output=Path(tmp) / "preset.json",
            across_processes=args.across_processes,
            repeats=args.repeats,
            progress=say,
        )
        print(result.report(), file=sys.stderr)
        sys.stdout.write(json.dumps(json.loads(result.path.read_text()), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
