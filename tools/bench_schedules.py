#!/usr/bin/env python3
"""Pipeline schedules in the discrete-event simulator, against the 'signal send/recv' bound.

    python tools/bench_schedules.py [--json] [--microbatches 16,64,256] [--stages 4] [--device-tflops 10]
                                    [--timeline DIR] [--memory-per-device 16e9]

For the zoo's GPT (1.3B) and U-Transformer (2.1B), cut into 4 stages on the cross-mesh
paper's testbed (§5: 2 hosts x 4 V100, NVLink inside a host, 10 Gbps between hosts; stage k
on a 2-device mesh, stages 0-1 on host 0 and 2-3 on host 1), each schedule of the registry
is simulated twice: with real transfer sizes, and with every transfer costing one byte (the
paper's upper bound, §4). The schedules of several stages per mesh (interleaved-1f1b, zb-v)
run the same layers cut into 2 x 4 chunks, two per mesh, placed as each places them. Prints
time, signal time, their ratio, bubble fraction, peak memory per device and the peak
activation stash in microbatches (`peak_stash_microbatches`), then
ZB-H1's, ZB-H2's, interleaved 1F1B's and ZB-V's bubbles next to 1F1B's and the papers'
formulas, and what `schedule="auto"` picks on these stages (the fastest within
`--memory-per-device` of stash, default 80 GB, among every schedule the planner places,
`PLANNED_SCHEDULES`: one stage per mesh, and interleaved-1f1b and zb-v at two chunks per
mesh) with its gain over eager-1F1B and 1F1B; or with `--json` a list of rows (model, schedule, microbatches, time_s,
signal_time_s, bubble_fraction, steady_time_s and steady_bubble_fraction (steps back to back
without a barrier at the optimizer step, `SimResult.steady_period`), peak_memory_bytes per
mesh, ...). The global batch is the zoo
config's; more microbatches make them smaller.

The cost model, stated: a transformer layer's forward is 2 FLOPs per parameter per token
for its matmuls (12 d^2 parameters, plus 4 d^2 for a U-Transformer skip projection) plus
4 s d per token for attention scores and context; backward is twice forward, half of it
weight gradients; a mesh runs at `devices x device_tflops` (default 10 TFLOPS per device,
about 64% of a V100's FP32 peak; both zoo configs are FP32). A stage sends each tensor its
later stages read once per receiving stage: GPT the last layer's output; U-Transformer also
every skip source that a later stage reads (layer i feeds layer L-1-i). Transfers across
hosts take 50 us + bytes / 10 Gbps and share each host's NIC (one direction each); inside a
host 5 us + bytes / 25 GB/s. Stash per microbatch: 34 s b d bytes per layer (Korthikanti et
al., 2022, FP16, no attention scores), doubled for FP32. Embedding and head are left out,
so GPT's stages cost the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hlopar.analysis.schedules import (  # noqa: E402
    DEFAULT_SCHEDULE,
    PLANNED_SCHEDULES,
    SCHEDULES,
    AlphaBeta,
    Edge,
    HostComm,
    PipelineTopology,
    StageCost,
    Timeline,
    build_streams,
    draw_timeline,
    signal,
    simulate,
    stage_placement,
)

GBPS = 1e9 / 8
HOSTS, DEVICES_PER_HOST = 2, 4
INTER_HOST = AlphaBeta(50e-6, 10 * GBPS)
INTRA_HOST = AlphaBeta(5e-6, 25e9)


@dataclass(frozen=True)
class Case:
    model: str
    topology: PipelineTopology
    costs: tuple[StageCost, ...]
    comm: HostComm


def _layer_flops(d: int, seq: int, tokens: int, extra_params: int = 0) -> float:
    return 2.0 * tokens * (12 * d * d + extra_params) + 4.0 * tokens * seq * d


def _balanced_cuts(weights: list[float], parts: int) -> list[int]:
    """Start layer of each part, contiguous, minimizing the heaviest part (exhaustive DP)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = {(0, 0): (0.0, [])}  # (layers used, parts used) -> (max part, starts)
    for p in range(parts):
        nxt = {}
        for (used, _), (worst, starts) in best.items():
            for end in range(used + 1, n - (parts - p - 1) + 1):
                cand = (max(worst, prefix[end] - prefix[used]), starts + [used])
                if (end, p + 1) not in nxt or cand[0] < nxt[(end, p + 1)][0]:
                    nxt[(end, p + 1)] = cand
        best = nxt
    return best[(n, parts)][1]


def _case(
    model: str,
    d: int,
    seq: int,
    mb_size: int,
    dtype_bytes: int,
    layer_flops: list[float],
    reads: list[list[int]],
    meshes: int,
    device_tflops: float,
    chunks: int = 1,
    placement: str = "loop",
) -> Case:
    """A case from per-layer FLOPs and, per layer, the earlier layers whose outputs it reads:
    the layers cut into `meshes` x `chunks` stages, placed on the meshes by `placement`."""
    stages = meshes * chunks
    starts = _balanced_cuts(layer_flops, stages)
    stage_of = [sum(1 for s in starts if s <= layer) - 1 for layer in range(len(layer_flops))]
    tensor = mb_size * seq * d * dtype_bytes
    crossing: dict[tuple[int, int], set[int]] = {}
    for layer, sources in enumerate(reads):
        for src in sources:
            if stage_of[src] != stage_of[layer]:
                crossing.setdefault((stage_of[src], stage_of[layer]), set()).add(src)
    edges = tuple(Edge(s, t, len(srcs) * tensor) for (s, t), srcs in sorted(crossing.items()))
    devices = HOSTS * DEVICES_PER_HOST // meshes
    stash_per_layer = 34 * seq * mb_size * d * (dtype_bytes // 2 or 1)
    costs, stash = [], []
    for k in range(stages):
        layers = [i for i in range(len(layer_flops)) if stage_of[i] == k]
        fwd = sum(layer_flops[i] for i in layers) / (devices * device_tflops * 1e12)
        costs.append(StageCost(forward=fwd, backward=2 * fwd))
        stash.append(len(layers) * stash_per_layer)
    names = tuple(f"m{j + 1}" for j in stage_placement(placement, meshes, chunks))
    topo = PipelineTopology(stages, edges, tuple(stash), meshes=names)
    host_of = {mesh: k * devices // DEVICES_PER_HOST for k, mesh in enumerate(topo.mesh_names)}
    return Case(model, topo, tuple(costs), HostComm(host_of, INTER_HOST, INTRA_HOST))


def gpt_case(microbatches: int, stages: int, device_tflops: float, chunks: int = 1, placement: str = "loop") -> Case:
    from hlopar.models.gpt import GPT_CONFIGS

    cfg = GPT_CONFIGS["1.3B"]
    mb = cfg.batch_size // microbatches
    flops = [_layer_flops(cfg.hidden_size, cfg.seq_len, mb * cfg.seq_len)] * cfg.num_layers
    reads = [[i - 1] if i else [] for i in range(cfg.num_layers)]
    return _case(
        "gpt-1.3B", cfg.hidden_size, cfg.seq_len, mb, 4, flops, reads, stages, device_tflops, chunks, placement
    )


def u_transformer_case(
    microbatches: int, stages: int, device_tflops: float, chunks: int = 1, placement: str = "loop"
) -> Case:
    from hlopar.models.u_transformer import U_TRANSFORMER_CONFIGS

    cfg = U_TRANSFORMER_CONFIGS["2.1B"]
    mb, d = cfg.batch_size // microbatches, cfg.hidden_size
    flops, reads = [], []
    for i in range(cfg.num_layers):
        skip = cfg.skip_source(i)
        flops.append(_layer_flops(d, cfg.seq_len, mb * cfg.seq_len, 0 if skip is None else 2 * d * d))
        reads.append(([i - 1] if i else []) + ([] if skip is None else [skip]))
    return _case("u_transformer-2.1B", d, cfg.seq_len, mb, 4, flops, reads, stages, device_tflops, chunks, placement)


def run(microbatch_counts: list[int], stages: int, device_tflops: float, timeline: Path | None = None) -> list[dict]:
    rows = []
    for make in (gpt_case, u_transformer_case):
        for microbatches in microbatch_counts:
            plain = make(microbatches, stages, device_tflops)
            for name, schedule in SCHEDULES.items():
                if schedule.mesh_order is None:
                    case = plain
                else:  # two chunks per mesh
                    case = make(microbatches, stages, device_tflops, 2, schedule.placement)
                rows.append(_row(case, name, stages, microbatches, timeline))
    return rows


def _row(case: Case, name: str, stages: int, microbatches: int, timeline: Path | None) -> dict:
    """One schedule on one case, simulated with real transfers and with signals."""
    streams = build_streams(case.topology, name, microbatches)
    real = simulate(streams, case.costs, case.comm)
    bound = simulate(streams, case.costs, signal(case.comm))
    if timeline is not None:
        timeline.mkdir(parents=True, exist_ok=True)
        draw_timeline(Timeline.of(real), timeline / f"{case.model}-B{microbatches}-{name}.png")
    return {
        "model": case.model,
        "schedule": name,
        "stages": stages,
        "microbatches": microbatches,
        "time_s": real.iteration_time,
        "signal_time_s": bound.iteration_time,
        "bubble_fraction": real.bubble_fraction,
        "steady_time_s": real.steady_period,
        "steady_bubble_fraction": real.steady_bubble_fraction,
        "peak_memory_bytes": max(real.peak_memory.values()),
        "peak_stash_microbatches": peak_stash_microbatches(real, case.topology),
        "devices_per_mesh": HOSTS * DEVICES_PER_HOST // stages,
        "edges": [[e.src, e.dst, e.nbytes] for e in case.topology.edges],
        "forward_s": [c.forward for c in case.costs],
        "chunks": case.topology.chunks,
    }


def peak_stash_microbatches(result, topology) -> float:
    """The most activation stashes a mesh holds at once in the run, in microbatches of the
    mesh's layers (a mesh of v chunks holds a microbatch's stash when each chunk holds one):
    its live `stash` buffers' bytes at their peak over one microbatch's stash on the mesh.
    Transfer buffers and a split backward's carries are left out (the peak memory column
    has them)."""
    peaks = result.peak_live(lambda buffer: buffer.rpartition(":")[2].startswith("stash."))
    return max(
        (
            peak / sum(topology.activation_bytes[k] for k in topology.stages_on(mesh))
            for mesh, peak in peaks.items()
            if peak
        ),
        default=0.0,
    )


def table(rows: list[dict], memory: float = 80e9) -> str:
    header = [
        "model",
        "B",
        "schedule",
        "time s",
        "signal s",
        "signal / time",
        "vs 1f1b",
        "bubble",
        "peak stash GB/device",
        "peak stash, microbatches",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = {(r["model"], r["microbatches"]): r["time_s"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        key = (r["model"], r["microbatches"])
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    str(r["microbatches"]),
                    r["schedule"],
                    f"{r['time_s']:.3f}",
                    f"{r['signal_time_s']:.3f}",
                    f"{100 * r['signal_time_s'] / r['time_s']:.1f}%",
                    f"{base[key] / r['time_s']:.3f}x",
                    f"{100 * r['bubble_fraction']:.1f}%",
                    f"{r['peak_memory_bytes'] / r['devices_per_mesh'] / 1e9:.1f}",
                    f"{r['peak_stash_microbatches']:.3g}",
                ]
            )
            + " |"
        )
    notes = []
    for model, microbatches in base:
        row = next(r for r in rows if (r["model"], r["microbatches"]) == (model, microbatches))
        notes.append(
            f"{model}, B={microbatches}: forward s per stage "
            + ", ".join(f"{f:.3f}" for f in row["forward_s"])
            + "; edges per microbatch "
            + ", ".join(f"{s}->{t} {b / 1e6:.0f} MB" for s, t, b in row["edges"])
        )
    return "\n".join(
        lines + [""] + notes + [""] + verdicts(rows) + [""] + zero_bubble(rows) + [""] + auto_choice(rows, memory)
    )


def verdicts(rows: list[dict]) -> list[str]:
    """Per model and B, the issue's claims: eager-1F1B within 3% of the signal send/recv bound,
    and faster than 1F1B."""
    out = []
    by_key = {(r["model"], r["microbatches"], r["schedule"]): r for r in rows}
    for model, microbatches, schedule in by_key:
        if schedule != "eager-1f1b":
            continue
        eager, one = by_key[(model, microbatches, "eager-1f1b")], by_key.get((model, microbatches, "1f1b"))
        share = eager["signal_time_s"] / eager["time_s"]
        line = (
            f"{model}, B={microbatches}: eager-1f1b at {100 * share:.1f}% of the signal bound "
            f"(within 3%: {'yes' if share >= 0.97 else 'no'})"
        )
        if one is not None:
            line += f", {one['time_s'] / eager['time_s']:.2f}x over 1f1b"
        out.append(line)
    return out


def zero_bubble(rows: list[dict]) -> list[str]:
    """Per model and B, ZB-H1's simulated bubble next to 1F1B's and the paper's formulas (Qi et
    al., 2024: idle over compute (p-1)/3m against (p-1)/m when F, B and W cost the same, as
    here, backward = 2 forward and half of it W, and communication is free, which here it is
    not), written as this table's bubble, idle over the step: (p-1)/(3m+p-1), (p-1)/(m+p-1);
    then ZB-H2's bubble of back-to-back steps, 0 by the paper's formula once m >= 2p-1."""
    out = []
    by_key = {(r["model"], r["microbatches"], r["schedule"]): r for r in rows}
    for model, m, schedule in by_key:
        one = by_key.get((model, m, "1f1b"))
        if schedule != "zb-h1" or one is None:
            continue
        p = by_key[(model, m, schedule)]["stages"]
        out.append(
            f"{model}, B={m}: zb-h1 bubble {100 * by_key[(model, m, schedule)]['bubble_fraction']:.1f}% "
            f"(formula (p-1)/(3m+p-1) = {100 * (p - 1) / (3 * m + p - 1):.1f}%), 1f1b "
            f"{100 * one['bubble_fraction']:.1f}% (formula (p-1)/(m+p-1) = {100 * (p - 1) / (m + p - 1):.1f}%)"
        )
    for (model, m, schedule), row in by_key.items():
        if schedule == "zb-h2":
            p = row["stages"]
            out.append(
                f"{model}, B={m}: zb-h2 bubble of back-to-back steps {100 * row['steady_bubble_fraction']:.1f}% "
                f"(formula: 0 once m >= 2p-1 = {2 * p - 1}), one step alone "
                f"{100 * row['bubble_fraction']:.1f}%"
            )
        if schedule == "interleaved-1f1b":
            p, v = row["stages"], row["chunks"]
            out.append(
                f"{model}, B={m}: interleaved-1f1b (v={v}) bubble {100 * row['bubble_fraction']:.1f}% "
                f"(formula (p-1)/(vm+p-1) = {100 * (p - 1) / (v * m + p - 1):.1f}%, Narayanan et al.'s "
                f"(p-1)/(vm) of the compute)"
            )
        if schedule == "zb-v":
            p = row["stages"]
            out.append(
                f"{model}, B={m}: zb-v bubble of back-to-back steps {100 * row['steady_bubble_fraction']:.1f}% "
                f"(formula: 0 once m >= 2p = {2 * p}, F = B = W), one step alone {100 * row['bubble_fraction']:.1f}% "
                f"(formula (p-1)/(6m+p-1) = {100 * (p - 1) / (6 * m + p - 1):.1f}%)"
            )
    return out


def auto_choice(rows: list[dict], memory: float) -> list[str]:
    """Per model and B, what `schedule="auto"` picks on these fixed stages: the schedule of
    `PLANNED_SCHEDULES` (those of one stage per mesh on the 4 stages, interleaved-1f1b and
    zb-v on the same layers in 2 chunks per mesh) of least simulated step time (`time_s`, the
    barrier at the optimizer step, as `analysis.stages.pipeline_choice` ranks them; ties to
    the default schedule, then the registry's order, as there) whose peak stash per device
    fits `memory`, and its gain over eager-1f1b and 1f1b. (Stage construction also chooses
    the stages, the count and interleaved-1f1b's chunks, 2 to 4, with it; here they are fixed.)"""
    out = []
    by_key: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        if r["schedule"] in PLANNED_SCHEDULES:
            by_key.setdefault((r["model"], r["microbatches"]), {})[r["schedule"]] = r
    rank = {name: k for k, name in enumerate(sorted(PLANNED_SCHEDULES, key=lambda n: n != DEFAULT_SCHEDULE))}
    for (model, m), runs in by_key.items():
        fitting = [r for r in runs.values() if r["peak_memory_bytes"] / r["devices_per_mesh"] <= memory]
        if not fitting:
            out.append(f"{model}, B={m}: auto finds no schedule within {memory / 1e9:.0f} GB a device")
            continue
        best, *others = sorted(fitting, key=lambda r: (r["time_s"], rank[r["schedule"]]))
        refused = sorted(set(runs) - {r["schedule"] for r in fitting})
        gains = ", ".join(
            f"{runs[name]['time_s'] / best['time_s']:.3f}x over {name}" + (" (not fitting)" if name in refused else "")
            for name in ("eager-1f1b", "1f1b")
            if name in runs
        )
        out.append(
            f"{model}, B={m}: auto picks {best['schedule']} ({best['time_s']:.3f} s), {gains}"
            + (f"; runner-up {others[0]['schedule']} ({others[0]['time_s']:.3f} s)" if others else "")
            + (f"; over {memory / 1e9:.0f} GB a device: {', '.join(refused)}" if refused else "")
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--microbatches", default="16,64,256", help="comma-separated microbatch counts")
    parser.add_argument("--stages", type=int, default=4, choices=(1, 2, 4, 8))
    parser.add_argument("--device-tflops", type=float, default=10.0)
    parser.add_argument("--timeline", type=Path, help="write each simulated timeline as a PNG into this folder")
    parser.add_argument(
        "--memory-per-device",
        type=float,
        default=80e9,
        help="bytes of stash a device holds for auto (default 80e9, an A100 80 GB)",
    )
    args = parser.parse_args(argv)
    rows = run([int(b) for b in args.microbatches.split(",")], args.stages, args.device_tflops, args.timeline)
    print(json.dumps(rows, indent=1) if args.json else table(rows, args.memory_per_device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
