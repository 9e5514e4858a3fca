#!/usr/bin/env python3
"""Do the collectives XLA compiles match the ones hlopar-auto-sharding predicted?

    python tools/check_fidelity.py [--mesh 2x4] [--preset cpu] [--options 'latency=0,0'] [MODEL:CONFIG ...]

For each zoo model, the training step is lowered, imported and planned (with a report), the
planned module is compiled by stock jaxlib for 8 CPU devices, and the collectives of the
compiled HLO are compared with the plan's: the ops' own collectives (partial-sum
all-reduces) and the resharding collectives on edges. A collective is (kind, mesh axes,
bytes per device); XLA's combiner merges several into one tuple collective, whose elements
are counted one by one. Prints, per model, the counts and the match rate
matched / max(predicted, compiled), then every unmatched collective.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_MODELS = ["mlp:large-batch", "mlp:large-hidden", "mlp:large-both", "mlp:tiny", "gpt:tiny", "wide_resnet:tiny"]
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVE = re.compile(r"^\s*%\S+ = (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(")
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def shapes_bytes(text: str) -> list[int]:
    """Bytes of each array shape in an HLO shape (a tuple gives several)."""
    found = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in _DTYPE_BYTES:
            found.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return found


def replica_partition(line: str, devices: int) -> frozenset[frozenset[int]] | None:
    """The device groups of a collective, from any of XLA's replica_groups syntaxes."""
    match = re.search(r"replica_groups=(\{\{.*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|mesh\[[^\]]*\] \{[^}]*\})", line)
    if match is None:
        return None
    text = match.group(1)
    if text == "{}":
        return frozenset({frozenset(range(devices))})
    if text.startswith("{{"):
        return frozenset(frozenset(int(d) for d in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", text))
    if text.startswith("mesh["):
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", text.split("]")[0])]
        grouped = set(re.findall(r"'([^']+)'", text.split("{", 1)[1]))
        return _groups([size for _, size in axes], [i for i, (name, _) in enumerate(axes) if name in grouped])
    import numpy as np

    shape, iota, *perm = re.findall(r"\[([\d,]+)\]|T\(([\d,]+)\)", text)
    group_shape = [int(x) for x in shape[0].split(",")]
    reshape = [int(x) for x in iota[0].split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose([int(x) for x in perm[0][1].split(",")])
    ids = ids.reshape(group_shape)
    return frozenset(frozenset(int(d) for d in row) for row in ids)


def _groups(mesh_shape: list[int], grouped_axes: list[int]) -> frozenset[frozenset[int]]:
    """Devices (row-major over the mesh) that differ only along the grouped axes."""
    import numpy as np

    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    rest = [a for a in range(len(mesh_shape)) if a not in grouped_axes]
    moved = ids.transpose(rest + grouped_axes).reshape(-1, math.prod(mesh_shape[a] for a in grouped_axes) if grouped_axes else 1)
    return frozenset(frozenset(int(d) for d in row) for row in moved)


def axes_of(partition, mesh_shape: list[int], axis_names: list[str]) -> tuple[str, ...] | None:
    for count in range(len(axis_names) + 1):
        for subset in itertools.combinations(range(len(axis_names)), count):
            if _groups(mesh_shape, list(subset)) == partition:
                return tuple(axis_names[i] for i in subset)
    return None


def compiled_collectives(hlo: str, mesh_shape, axis_names) -> list[tuple[str, tuple[str, ...], int]]:
    found = []
    devices = math.prod(mesh_shape)
    for line in hlo.splitlines():
        match = _COLLECTIVE.match(line)
        if not match:
            continue
        shape_text, kind = match.group(1), match.group(2)
        partition = replica_partition(line, devices)
        axes = axes_of(partition, mesh_shape, axis_names) if partition is not None else None
        sizes = shapes_bytes(shape_text)
        if match.group(3):  # async start: (operands..., results...) — keep the results half
            sizes = sizes[len(sizes) // 2:]
        group = len(next(iter(partition))) if partition else 1
        for nbytes in sizes:
            if kind == "reduce-scatter":
                nbytes *= group  # hlopar names a reduce-scatter by its input size
            found.append((kind, axes or ("?",), nbytes))
    return [c for c in found if c[1] != ()]


def predicted_collectives(report: dict) -> list[tuple[str, tuple[str, ...], int]]:
    texts = [c for op in report["ops"] for c in op["collectives"]]
    texts += [c for reshard in report.get("reshards", []) for c in reshard["collectives"]]
    found = []
    for text in texts:
        match = re.match(r"([a-z-]+)\(([\d.]+) (\w+), \{?([^)}]*)\}?\)", text)
        kind, amount, unit, axes = match.groups()
        found.append((kind, tuple(a.strip() for a in axes.split(",")), round(float(amount) * _UNIT[unit])))
    return found


def check(model: str, config: str, mesh: str, preset: str, options: str) -> tuple[int, int, int, list[str]]:
    import jax

    from hlopar.codegen.spmd import compile_spmd
    from hlopar.ir.module import parse_module
    from hlopar.models import get_train_step
    from hlopar.passes.base import PassContext
    from hlopar.passes.pipeline import Pipeline

    module = parse_module(get_train_step(model, config).lower())
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "plan.json"
        pipeline = f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={mesh} preset={preset} {options} report={report_path}}})"
        Pipeline.parse(pipeline, module.context).run(module, PassContext())
        report = json.loads(report_path.read_text())
    mesh_shape = report["mesh"]["shape"]
    executable = compile_spmd(module, jax.devices()[: math.prod(mesh_shape)]).executable
    compiled = compiled_collectives(executable.hlo_modules()[0].to_string(), mesh_shape, report["mesh"]["axes"])
    predicted = predicted_collectives(report)
    unmatched_predicted = Counter(predicted) - Counter(compiled)
    unmatched_compiled = Counter(compiled) - Counter(predicted)
    matched = sum((Counter(predicted) & Counter(compiled)).values())
    notes = [f"  predicted, not compiled: {k}({n} B, {','.join(a)}) x{c}{_explain(k, a, n, unmatched_compiled, compiled)}"
             for (k, a, n), c in unmatched_predicted.items()]
    notes += [f"  compiled, not predicted: {k}({n} B, {','.join(a)}) x{c}{_explain(k, a, n, unmatched_predicted, predicted)}"
              for (k, a, n), c in unmatched_compiled.items()]
    return len(predicted), len(compiled), matched, notes


def _explain(kind: str, axes, nbytes: int, other_side: Counter, other_all: list) -> str:
    """Known reasons for a mismatch, recognised from the pattern on the other side."""
    swapped = {"all-reduce": "reduce-scatter", "reduce-scatter": "all-reduce"}.get(kind)
    if swapped and other_side.get((swapped, axes, nbytes)):
        return "  <- XLA's CPU backend decomposes reduce-scatter into all-reduce + dynamic-slice"
    if kind == "all-gather" and (kind, axes, nbytes) in other_all:
        return "  <- XLA reuses one all-gather for several consumers of the same value (CSE); the ILP charges each use"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, help="MODEL:CONFIG from the zoo")
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--preset", default="v100-p3.16xlarge")
    parser.add_argument("--options", default="", help="more hlopar-auto-sharding options, e.g. latency=0,0")
    args = parser.parse_args()
    rows, all_notes = [], []
    for spec in args.models:
        model, _, config = spec.partition(":")
        predicted, compiled, matched, notes = check(model, config or "tiny", args.mesh, args.preset, args.options)
        rate = matched / max(predicted, compiled) if max(predicted, compiled) else 1.0
        rows.append((spec, predicted, compiled, matched, rate))
        all_notes += [f"{spec}:"] + notes if notes else []
    print(f"{'model':<22} {'predicted':>9} {'compiled':>9} {'matched':>8} {'rate':>7}")
    for spec, predicted, compiled, matched, rate in rows:
        print(f"{spec:<22} {predicted:>9} {compiled:>9} {matched:>8} {rate:>7.1%}")
    total_p, total_c, total_m = (sum(r[i] for r in rows) for i in (1, 2, 3))
    total_rate = total_m / max(total_p, total_c) if max(total_p, total_c) else 1.0
    print(f"{'total':<22} {total_p:>9} {total_c:>9} {total_m:>8} {total_rate:>7.1%}")
    print("\n".join(all_notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
