"""`hlopar-compile`: plan a training step for a cluster and write the compiled bundle.

    hlopar-compile step.mlir --num-hosts 2 --devices-per-host 4 --microbatches 4 --schedule 1f1b -o out/

runs `hlopar-auto-parallel{split=true ...}` (import, hlopar-split-microbatches, operator
clustering, stage construction, cross-mesh resharding: the planning pipeline `parallelize`
runs too, `passes.planning`, its flags' choices read from `passes.plan_options`), reads the planned program as a
pipeline (`codegen.pipeline_program`), builds the schedule's instruction streams, simulates
them, and writes the bundle (`codegen.bundle`, docs/codegen.md).

On success it prints a short summary (stages on meshes, microbatches, the simulated step
time and bubble, the bundle's path). Failures behave as in `hlopar-opt` (`cli.guard`): `file:line:col: error: ...` lines, exit
status 1, no traceback; the work runs in a forked child so jaxlib crashes are reported too.
Nothing is half-written: the bundle is written into a hidden directory beside DIR and
renamed to DIR at the end; an existing DIR is replaced only when it is an earlier bundle
(or empty).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hlopar.analysis.limits import check_cluster, check_cluster_dimension, check_count, check_positive
from hlopar.analysis.schedules.registry import PLANNED_SCHEDULES, get_schedule
from hlopar.cli.arguments import ArgumentParser
from hlopar.cli.guard import run_isolated
from hlopar.passes.plan_options import DEFAULT_PLAN_SCHEDULE, METHODS, REMAT_MODES, RNG_MODES, SCHEDULE_NAMES
from hlopar.runtime.host_devices import use_host_devices

BUNDLE_MARKER = "pipeline.json"

DESCRIPTION = """\
Plan a JAX training step (StableHLO .mlir/.mlirbc, e.g. from jax.jit(step).lower(...) or
tools/export_model.py) for a cluster of N hosts x M devices, pipelined over B microbatches
under a schedule, and write everything a runtime needs into the bundle directory DIR.

Steps: hlopar-import; hlopar-split-microbatches{microbatches=B} (the step becomes the step of
one microbatch; gradients are summed over microbatches, the optimizer runs once; losses that
are not sums or means over the batch are refused); hlopar-cluster-operators;
hlopar-stage-construction{schedule=S} (stages on submeshes, an intra-op plan per stage; S=auto,
the default, also chooses the schedule: the one of least simulated step time within memory);
hlopar-cross-mesh-resharding (every inter-mesh transfer as load-balanced broadcast unit ops).
That is the pass `hlopar-auto-parallel{split=true ...}`; `hlopar-opt` runs it alone.
Then codegen: one executable module per fragment, one instruction stream per mesh, and a
discrete-event simulation of the step.
"""

EPILOG = """\
bundle (DIR):
  plan.json                     the hlopar-auto-parallel report: split, clustering, stages
                                (per-stage latency, memory, devices), cross_mesh (every transfer)
  program.mlir                  the planned MPMD program (mpmd fragments + hlopar.cross_mesh_transfer)
  pipeline.json                 the program as the runtime reads it: meshes and devices, stages,
                                fragments (role, files, accumulated results), transfers, edges
  meshes/<mesh>/<fragment>.mlir each fragment as a standalone StableHLO module with its sdy
                                shardings, as the runtime compiles it for the mesh's devices
                                (results summed over microbatches take donated accumulators)
  meshes/<mesh>/stream.txt      the mesh's instruction stream (RUN, SEND, RECV, ACCUMULATE,
                                FREE, UPDATE with their dependencies), readable
  meshes/<mesh>/stream.json     the same stream as JSON
  simulation.json               simulated iteration time, bubble fraction, peak memory per mesh,
                                and the costs used
  memory.json                   every fragment's memory per device: predicted from the plan's
                                layouts and as XLA compiles it (a plan that does not fit the
                                device memory is refused); --no-memory-check skips it
  timeline.png                  with --timeline-png: the simulated timeline, one row per mesh
                                (time axis in s/ms/us; drawn with matplotlib only when asked)
  timeline.json                 the same as a Chrome trace: open it in ui.perfetto.dev

simulation costs: a RUN takes its stage's latency per microbatch from the stage-construction
report, split between forward and backward by their FLOPs (and, for eager-1f1b-wd, the
backward between its B and W fragments by theirs); a SEND takes the predicted time of
the cross-mesh transfers it carries (planned by hlopar-cross-mesh-resharding on the host
model of --preset with M devices per host).

presets (--preset):
{presets}

output: the bundle is written into a hidden directory beside DIR and renamed to DIR when
complete. An existing DIR is replaced only if it is an earlier bundle (it has pipeline.json)
or empty; anything else there is refused.

exit status: 0 on success; 1 for bad input or a step that cannot be planned (errors printed as
file:line:col: error: ...; DIR is left as it was); 2 for a bad command line.
See docs/codegen.md for the bundle and stream formats.
"""


class _CompileArgumentParser(ArgumentParser):
    def format_help(self) -> str:
        # The preset list needs hlopar.analysis (jaxlib): only when help is asked for.
        from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS

        presets = "\n".join(f"  {name:<18} {p.description}" for name, p in CLUSTER_PRESETS.items())
        presets += f"\n  {'FILE.json':<18} a preset file, such as hlopar-calibrate -o FILE.json writes"
        self.epilog = EPILOG.replace("{presets}", presets)
        return super().format_help()


def _checked(check: Callable[[int], None]) -> Callable[[str], int]:
    """An argparse type: an integer that passes `check` (`analysis.limits`, as the passes' options)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
        try:
            check(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    return parse


_positive = _checked(lambda n: check_count(n, low=1))
_cluster_dimension = _checked(check_cluster_dimension)


def _indices(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(word) for word in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected argument indices like 19,20, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected argument indices like 19,20, got {text!r}")
    for value in values:
        _checked(check_count)(str(value))
    return values


def _index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected one result index (0, 1, ...), got {text!r}")
    return _checked(check_count)(text)


def build_parser() -> argparse.ArgumentParser:
    """hlopar-compile's flags. One function on purpose: it reads as the table of flags (one
    `add_argument` each, choices from the planning options and the schedule registry)."""
    parser = _CompileArgumentParser(
        prog="hlopar-compile", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("input", help="the training step: .mlir text or .mlirbc bytecode, or - for stdin")
    parser.add_argument("-o", dest="output", required=True, metavar="DIR", help="bundle directory to write")
    parser.add_argument("--num-hosts", type=_cluster_dimension, required=True, metavar="N", help="hosts in the cluster")
    parser.add_argument(
        "--devices-per-host", type=_cluster_dimension, required=True, metavar="M", help="devices per host"
    )
    parser.add_argument(
        "--microbatches",
        type=_positive,
        required=True,
        metavar="B",
        help="microbatches per step (divides the batch: the leading dim of every batch argument)",
    )
    parser.add_argument(
        "--schedule",
        default=DEFAULT_PLAN_SCHEDULE,
        choices=SCHEDULE_NAMES,
        help="pipeline schedule, from the registry (analysis/schedules/registry.py): "
        + "; ".join(f"{name}: {get_schedule(name).description}" for name in PLANNED_SCHEDULES)
        + "; auto (the default): the one of least simulated step time, chosen with the stages "
        "(plan.json's stages.schedule)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="auto: stages, submeshes and each stage's intra-op plan chosen; shard: one stage on one mesh "
        "of every device (intra-op only); pipeline: stages replicated over their submeshes (default: auto)",
    )
    parser.add_argument(
        "--remat",
        choices=REMAT_MODES,
        default="auto",
        help="stages that recompute their forward in the backward: auto (where stage construction finds "
        "it pays), always (per stage), layers (per layer), never (default: auto)",
    )
    parser.add_argument(
        "--stage-loops",
        action="store_true",
        help="run each stage's iterations of a scanned layer stack as one loop (hlopar-reroll-stage-loops)",
    )
    parser.add_argument(
        "--preset",
        default="cpu",
        metavar="P",
        help="cluster preset for link bandwidths, device FLOP/s and memory, or a preset file (hlopar-calibrate -o FILE; default: cpu)",
    )
    parser.add_argument(
        "--memory-per-device",
        default=None,
        metavar="X",
        help="bytes per device, e.g. 80GiB or 512MB (default: the preset's)",
    )
    parser.add_argument(
        "--stages",
        type=_positive,
        default=None,
        metavar="S",
        help="exactly this many pipeline stages (default: chosen by hlopar-stage-construction)",
    )
    parser.add_argument(
        "--idle-hosts",
        action="store_true",
        help="the stages may leave whole hosts idle where that is predicted faster (a small model on slow "
        "links between hosts; default: every device is used)",
    )
    parser.add_argument(
        "--layers",
        type=_positive,
        default=None,
        metavar="L",
        help="layers for operator clustering (default: chosen by hlopar-cluster-operators)",
    )
    parser.add_argument(
        "--batch-args",
        type=_indices,
        default=None,
        metavar="I,J",
        help="the arguments that are the batch, cut into microbatches along dim 0 (default: the "
        "arguments that are not training state)",
    )
    parser.add_argument(
        "--loss-result",
        type=_index,
        default=None,
        metavar="R",
        help="the result that is the loss (default: found from the step)",
    )
    parser.add_argument(
        "--rng",
        choices=RNG_MODES,
        default="exact",
        help="per-microbatch: let whole-shape random generators (stablehlo.rng, rng_bit_generator) "
        "draw per microbatch, other numbers than the whole batch's (default: refuse them)",
    )
    parser.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="skip compiling every fragment to check its memory against the device's (memory.json)",
    )
    parser.add_argument(
        "--timeline-png",
        action="store_true",
        help="also draw the simulated timeline as timeline.png (matplotlib; timeline.json is always written)",
    )
    parser.add_argument("--timing", action="store_true", help="print the wall time of each phase to stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_cluster(args.num_hosts, args.devices_per_host)
    except ValueError as error:
        parser.error(f"--num-hosts {args.num_hosts} --devices-per-host {args.devices_per_host}: {error}")
    output = os.path.abspath(args.output)
    problem = _output_problem(output)
    if problem:
        sys.stderr.write(f"{args.output}: error: {problem}\n")
        return 1
    try:
        staging = tempfile.mkdtemp(prefix=".hlopar-compile-", dir=os.path.dirname(output))
    except OSError as error:
        sys.stderr.write(f"{args.output}: error: cannot write the bundle: {error.strerror}\n")
        return 1
    # Before jaxlib loads: the memory check compiles each fragment for its mesh's CPU devices,
    # and jaxlib's client would list them on stderr.
    use_host_devices(args.num_hosts * args.devices_per_host)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        status = run_isolated(lambda: _compile(args, staging), args.input)
        if status == 0:
            _install(staging, output)
            print(summary(output))
        return status
    except OSError as error:
        sys.stderr.write(f"{args.output}: error: cannot write the bundle: {error.strerror}\n")
        return 1
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def summary(directory: str) -> str:
    """What a bundle holds, in a few lines: stages on meshes, microbatches, the schedule (and,
    where auto chose it, the runner-up), the simulated step."""
    from hlopar.passes.stage_construction import schedule_choice_lines

    bundle = Path(directory)
    pipeline = json.loads((bundle / "pipeline.json").read_text())
    simulation = json.loads((bundle / "simulation.json").read_text())
    report = json.loads((bundle / "plan.json").read_text())["stages"]
    stages = report["stages"]
    lines = [
        f"hlopar-compile: {len(stages)} stage{'s' if len(stages) != 1 else ''} on "
        f"{len(pipeline['meshes'])} mesh{'es' if len(pipeline['meshes']) != 1 else ''}, "
        f"{simulation['microbatches']} microbatches, schedule {simulation['schedule']}"
    ]
    lines += schedule_choice_lines(report.get("schedule_choice"))
    for stage in stages:
        mesh = stage.get("mesh") or pipeline["meshes"][stage["stage"]]["mesh"]
        shape = "x".join(str(n) for n in stage["logical_shape"])
        lines.append(
            f"  stage {stage['stage']}: mesh {mesh}, {shape} devices {_ranges(stage['devices'])}, "
            f"{_seconds(stage['latency'])} per microbatch"
        )
    lines.append(
        f"  step {_seconds(simulation['iteration_time_s'])} (simulated), "
        f"bubble {100 * simulation['bubble_fraction']:.1f}%"
    )
    memory = bundle / "memory.json"
    if memory.exists():
        lines.append(_memory_line(json.loads(memory.read_text())))
    drawn = "timeline.png, " if (bundle / "timeline.png").exists() else ""
    lines.append(f"  bundle: {bundle} ({drawn}timeline.json for Perfetto)")
    return "\n".join(lines)


def _memory_line(memory: dict) -> str:
    """The fragment that needs the most memory per device, compiled and predicted."""
    from hlopar.units import format_bytes

    checked = [f for f in memory["fragments"] if f["compiled"] is not None]
    if not checked:
        return f"  memory: not checked ({'; '.join(memory['skipped'].values()) or 'no fragment'})"
    top = max(checked, key=lambda f: f["need"])
    predicted = top["predicted"]["total"] + top["resident"]
    device = memory["device_memory"]
    return (
        f"  memory: at most {format_bytes(top['need'])} per device ({top['fragment']} on {top['mesh']}, as XLA "
        f"compiles it; predicted {format_bytes(predicted)}) of "
        f"{format_bytes(device) if device is not None else 'an unknown device memory'}; every fragment in memory.json"
    )


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def _ranges(devices: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'."""
    parts, start = [], None
    for k, d in enumerate(devices):
        if start is None:
            start = d
        if k + 1 == len(devices) or devices[k + 1] != d + 1:
            parts.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


def _output_problem(output: str) -> str | None:
    """Why DIR cannot be (re)written, or None."""
    if not os.path.isdir(os.path.dirname(output)):
        return f"the parent directory '{os.path.dirname(output)}' does not exist"
    if os.path.lexists(output):
        if not os.path.isdir(output) or os.path.islink(output):
            return "exists and is not a directory"
        if os.listdir(output) and not os.path.exists(os.path.join(output, BUNDLE_MARKER)):
            return "exists and is not an hlopar-compile bundle; refusing to replace it"
    return None


def _install(staging: str, output: str) -> None:
    """Renames the finished bundle to DIR, replacing an earlier bundle there."""
    if not os.path.lexists(output):
        os.rename(staging, output)
        return
    old = tempfile.mkdtemp(prefix=".hlopar-compile-old-", dir=os.path.dirname(output))
    os.rmdir(old)
    os.rename(output, old)
    try:
        os.rename(staging, output)
    except OSError:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


# The split and planning passes' options their messages name -> hlopar-compile's flags.
_CLI_OPTIONS = (
    (re.compile(r"\bbatch-args=\.\.\."), "--batch-args I,J"),
    (re.compile(r"\bbatch-args="), "--batch-args "),
    (re.compile(r"\bloss-result=N\b"), "--loss-result R"),
    (re.compile(r"\bloss-result="), "--loss-result "),
    (re.compile(r"\brng=per-microbatch"), "--rng per-microbatch"),
    (re.compile(r"(?<![\w-])microbatches="), "--microbatches "),
)


def in_cli_terms(message: str) -> str:
    """A pass's message as an hlopar-compile user reads it: options named as its flags."""
    for pattern, replacement in _CLI_OPTIONS:
        message = pattern.sub(replacement, message)
    return message


def _compile(args: argparse.Namespace, staging: str) -> int:
    from hlopar.codegen.bundle import write_bundle
    from hlopar.codegen.pipeline_program import ProgramError, pipeline_program
    from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, error_at
    from hlopar.ir.module import parse_module, print_module, read_source
    from hlopar.passes.auto_parallel import AutoParallelPass
    from hlopar.passes.base import OptionError, PassContext
    from hlopar.passes.pipeline import Instrumentation, Pipeline, Step
    from hlopar.units import parse_bytes

    timings: list[tuple[str, float]] = []
    clock = time.perf_counter()
    memory = None
    if args.memory_per_device is not None:
        try:
            memory = parse_bytes(args.memory_per_device)
            check_positive(memory)
        except ValueError as error:
            raise DiagnosticError(
                [Diagnostic("error", f"--memory-per-device: invalid value '{args.memory_per_device}': {error}")]
            ) from None
    module = parse_module(read_source(args.input), source_name=args.input)
    timings.append(("parse", time.perf_counter() - clock))

    try:
        planner = AutoParallelPass(
            num_hosts=args.num_hosts,
            devices_per_host=args.devices_per_host,
            microbatches=args.microbatches,
            split=True,
            method=args.method,
            schedule=args.schedule,
            memory_per_device=memory,
            preset=args.preset,
            layers=args.layers,
            stages=args.stages,
            idle_hosts=args.idle_hosts,
            batch_args=args.batch_args,
            loss_result=args.loss_result,
            rng=args.rng,
            remat=args.remat,
            reroll="auto" if args.stage_loops else "never",
        )
    except OptionError as error:
        raise DiagnosticError([Diagnostic("error", in_cli_terms(str(error)))]) from None
    context = PassContext(reports={})
    steps: list[tuple[str, float]] = []
    try:
        Pipeline([Step(planner.name, hlopar_pass=planner)]).run(module, context, Instrumentation(timings=steps))
    except DiagnosticError as error:
        raise error.reworded(in_cli_terms) from None
    timings += steps
    for diagnostic in context.diagnostics:
        sys.stderr.write(diagnostic.reworded(in_cli_terms).format(args.input) + "\n")
    plan = context.reports[planner.name]
    schedule = get_schedule(plan["stages"]["schedule"])  # the option's, or the one chosen (auto)

    clock = time.perf_counter()
    try:
        program = pipeline_program(module, split_backward=schedule.split_backward)
    except ProgramError as error:
        raise DiagnosticError([error_at(error.location, f"hlopar-compile: {error}")]) from None
    timings.append(("codegen", time.perf_counter() - clock))
    clock = time.perf_counter()
    write_bundle(
        staging,
        program,
        print_module(module),
        plan,
        schedule,
        memory_check=args.memory_check,
        timeline_png=args.timeline_png,
    )
    timings.append(("bundle", time.perf_counter() - clock))
    if args.timing:
        total = sum(seconds for _, seconds in timings)
        for name, seconds in timings:
            sys.stderr.write(f"{seconds:10.4f} s  {name}\n")
        sys.stderr.write(f"{total:10.4f} s  total\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
