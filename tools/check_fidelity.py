#!/usr/bin/env python3
"""Do the collectives XLA compiles match the ones hlopar-auto-sharding predicted?

    python tools/check_fidelity.py [--mesh 2x4] [--preset cpu] [--options 'latency=0,0'] [PROGRAM ...]

PROGRAM is a zoo step (`MODEL:CONFIG`, default the zoo's tiny models), a StableHLO file
(`.mlir` text or bytecode, `.mlirbc`: `jax.jit(step).lower(...)`'s or `jax.export`'s, any
program of the corpus), or a JAX function of your own, `path/to/file.py:factory`, where
`factory()` returns a dict with `step` and `args` (as `tools/check_predictions.py` takes it;
only lowered here, never run).

For each program, the training step is lowered, imported and planned (with a report), the
planned module is compiled by stock jaxlib for 8 CPU devices, and the collectives of the
compiled HLO are compared with the plan's: the ops' own collectives (partial-sum
all-reduces) and the resharding collectives on edges (each conversion once: consumers that
share one are marked `reused` in the report). A collective is (kind, mesh axes, bytes per
device); XLA's combiner merges several into one tuple collective, whose elements are counted
one by one; the tuple form of an all-to-all (one operand per peer) counts as one. Replica
groups are read in all of XLA's syntaxes; groups that split a mesh axis are named as Shardy
names sub-axes (`y:(2)2`); a collective-permute is named after the axes along which it moves
data. XLA's CPU backend has no reduce-scatter (its partitioner's all-reduce + dynamic-slice
stays as it is; the GPU backend's ReduceScatterCreator fuses it), so a predicted
reduce-scatter compiled as an all-reduce of the same bytes and axes counts as matched, in a
column of its own. Prints, per model, the counts and the match rate
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hlopar.runtime.host_devices import use_host_devices  # noqa: E402

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

DEFAULT_MODELS = ["mlp:large-batch", "mlp:large-hidden", "mlp:large-both", "mlp:tiny", "gpt:tiny", "wide_resnet:tiny"]
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s64": 8,
    "s32": 4,
    "u32": 4,
    "s16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def shapes_bytes(text: str) -> list[int]:
    """Bytes of each array shape in an HLO shape (a tuple gives several)."""
    found = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in _DTYPE_BYTES:
            found.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return found


def replica_partition(line: str, devices: int) -> frozenset[frozenset[int]] | None:
    """The device groups of a collective, from any of XLA's replica_groups syntaxes: explicit
    lists, iota tiles (`[4,2]<=[2,4]T(1,0)`) and meshes with named (sub-)axes
    (`mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b','a':(1)2}`)."""
    match = re.search(
        r"replica_groups=(\{\{.*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
        r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\)(?:T\([\d,]+\))?\)?)? \{[^}]*\})",
        line,
    )
    if match is None:
        return None
    text = match.group(1)
    if text == "{}":
        return frozenset({frozenset(range(devices))})
    if text.startswith("{{"):
        return frozenset(frozenset(int(d) for d in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", text))
    if text.startswith("mesh["):
        return _mesh_groups(text)
    shape, iota, *perm = re.findall(r"\[([\d,]+)\]|T\(([\d,]+)\)", text)
    group_shape = [int(x) for x in shape[0].split(",")]
    ids = _iota_tile(iota[0], perm[0][1] if perm else None).reshape(group_shape)
    return frozenset(frozenset(int(d) for d in row) for row in ids)


def _iota_tile(reshape: str, transpose: str | None):
    """XLA's iota tile `[reshape]T(transpose)`: device ids, flattened."""
    import numpy as np

    dims = [int(x) for x in reshape.split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if transpose:
        ids = ids.transpose([int(x) for x in transpose.split(",")])
    return ids.reshape(-1)


def _mesh_groups(text: str) -> frozenset[frozenset[int]]:
    """Groups of `mesh[axes], device_ids=(...) {grouped axis refs}`; a ref `a:(pre)size` is
    the sub-axis of size `size` with `pre` devices more minor within axis `a`."""
    import numpy as np

    head, grouped_text = text.rsplit(" {", 1)
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", head.split("]")[0])]
    ids = np.arange(math.prod(size for _, size in axes))
    explicit = re.search(r"device_ids=\((.*)\)$", head)
    if explicit:
        tile = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", explicit.group(1).strip())
        ids = (
            _iota_tile(tile.group(1), tile.group(2))
            if tile
            else np.array([int(d) for d in re.findall(r"\d+", explicit.group(1))])
        )
    refs = [
        (name, int(pre) if pre else None, int(size) if size else None)
        for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", grouped_text)
    ]
    # Each axis cut where the sub-axes named begin and end: pieces (axis, pre, size), major first.
    pieces = []
    for name, size in axes:
        cuts = {1, size} | {c for n, pre, sub in refs if n == name and pre for c in (pre, pre * sub)}
        bounds = sorted(cuts, reverse=True)
        pieces += [(name, low, high // low) for high, low in zip(bounds, bounds[1:])]
    grouped = [
        i
        for name, pre, size in refs
        for i, (n, p, s) in enumerate(pieces)
        if n == name and (pre is None or (p, s) == (pre, size))
    ]
    rest = [i for i in range(len(pieces)) if i not in grouped]
    array = ids.reshape([s for _, _, s in pieces] or [1])
    moved = array.transpose(rest + grouped).reshape(-1, math.prod(pieces[i][2] for i in grouped))
    return frozenset(frozenset(int(d) for d in row) for row in moved)


def _groups(mesh_shape: list[int], grouped_axes: list[int]) -> frozenset[frozenset[int]]:
    """Devices (row-major over the mesh) that differ only along the grouped axes."""
    import numpy as np

    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    rest = [a for a in range(len(mesh_shape)) if a not in grouped_axes]
    moved = ids.transpose(rest + grouped_axes).reshape(
        -1, math.prod(mesh_shape[a] for a in grouped_axes) if grouped_axes else 1
    )
    return frozenset(frozenset(int(d) for d in row) for row in moved)


def axes_of(partition, mesh_shape: list[int], axis_names: list[str]) -> tuple[str, ...] | None:
    """The mesh axes whose groups are `partition`; failing that, axes and sub-axes of the mesh
    named the way Shardy writes them (`y:(2)2`: the size-2 part of `y` whose minor part has
    size 2)."""
    for count in range(len(axis_names) + 1):
        for subset in itertools.combinations(range(len(axis_names)), count):
            if _groups(mesh_shape, list(subset)) == partition:
                return tuple(axis_names[i] for i in subset)
    # Per axis: not in the group, whole, or one of its sub-axes (pre, size).
    options = [
        [None, (1, size)]
        + [
            (pre, sub)
            for pre in range(1, size)
            for sub in range(2, size)
            if size % (pre * sub) == 0 and pre * sub <= size and sub < size
        ]
        for size in mesh_shape
    ]
    for choice in itertools.product(*options):
        if all(c is None or c[1] == size for c, size in zip(choice, mesh_shape)):
            continue  # whole axes only: tried above
        if _sub_axis_groups(mesh_shape, choice) == partition:
            return tuple(
                name if c[1] == size else f"{name}:({c[0]}){c[1]}"
                for name, size, c in zip(axis_names, mesh_shape, choice)
                if c is not None
            )
    return None


def _sub_axis_groups(mesh_shape, choice) -> frozenset[frozenset[int]]:
    """Groups of devices that differ only in the chosen (pre, size) piece of each axis."""
    import numpy as np

    dims, grouped = [], []
    for size, piece in zip(mesh_shape, choice):
        pre, sub = piece or (1, 1)
        dims += [size // (pre * sub), sub, pre]
        if piece is not None:
            grouped.append(len(dims) - 2)
    ids = np.arange(math.prod(mesh_shape)).reshape(dims)
    rest = [a for a in range(len(dims)) if a not in grouped]
    moved = ids.transpose(rest + grouped).reshape(-1, math.prod(dims[a] for a in grouped))
    return frozenset(frozenset(int(d) for d in row) for row in moved)


def compiled_collectives(hlo: str, mesh_shape, axis_names) -> list[tuple[str, tuple[str, ...], int]]:
    found = []
    devices = math.prod(mesh_shape)
    for line in hlo.splitlines():
        match = _COLLECTIVE.match(line)
        if not match:
            continue
        shape_text, kind = match.group(1), match.group(2)
        if kind == "collective-permute":
            pairs = [
                tuple(int(d) for d in p.split(","))
                for p in re.findall(r"\{(\d+,\d+)\}", line.split("source_target_pairs=")[1].split("}}")[0] + "}")
            ]
            moved = _permuted_axes(pairs, mesh_shape, axis_names)
            if moved:
                found.append((kind, moved, shapes_bytes(shape_text)[0]))
            continue
        partition = replica_partition(line, devices)
        axes = axes_of(partition, mesh_shape, axis_names) if partition is not None else None
        sizes = shapes_bytes(shape_text)
        if match.group(3):  # async start: (operands..., results...) — keep the results half
            sizes = sizes[len(sizes) // 2 :]
        group = len(next(iter(partition))) if partition else 1
        if kind == "all-to-all" and "dimensions={" not in line and group > 1 and len(sizes) % group == 0:
            # The tuple form: one operand per peer, `group` chunks make one all-to-all
            sizes = [sum(sizes[i : i + group]) for i in range(0, len(sizes), group)]
        for nbytes in sizes:
            if kind == "reduce-scatter":
                nbytes *= group  # hlopar names a reduce-scatter by its input size
            found.append((kind, axes or ("?",), nbytes))
    return [c for c in found if c[1] != ()]


def _permuted_axes(pairs, mesh_shape, axis_names) -> tuple[str, ...]:
    """The mesh axes along which a collective-permute moves data (its source and target
    coordinates differ); () when every device keeps its own data."""
    import numpy as np

    moved = set()
    for src, dst in pairs:
        a, b = np.unravel_index(src, mesh_shape), np.unravel_index(dst, mesh_shape)
        moved.update(i for i in range(len(mesh_shape)) if a[i] != b[i])
    return tuple(axis_names[i] for i in sorted(moved))


def predicted_collectives(report: dict) -> list[tuple[str, tuple[str, ...], int]]:
    """The plan's collectives: each op's own, and each conversion on an edge once (consumers
    that read one converted value share its `sdy.sharding_constraint`: `reused` entries)."""
    texts = [c for op in report["ops"] for c in op["collectives"]]
    texts += [c for reshard in report.get("reshards", []) if not reshard.get("reused") for c in reshard["collectives"]]
    found = []
    for text in texts:
        match = re.match(r"([a-z-]+)\(([\d.]+) (\w+), \{?([^)}]*)\}?\)", text)
        kind, amount, unit, axes = match.groups()
        found.append((kind, tuple(a.strip() for a in axes.split(",")), round(float(amount) * _UNIT[unit])))
    return found


def _as_reported(nbytes: int) -> int:
    """Bytes rounded the way the report prints them (`format_bytes`), so both sides compare."""
    from hlopar.units import format_bytes

    amount, unit = format_bytes(nbytes).split()
    return round(float(amount) * _UNIT[unit])


@dataclass
class Fidelity:
    predicted: int
    compiled: int
    matched: int  # identical (kind, axes, bytes)
    matched_as_all_reduce: int  # a predicted reduce-scatter compiled as all-reduce (+ dynamic-slice)
    notes: list[str]

    @property
    def rate(self) -> float:
        most = max(self.predicted, self.compiled)
        return (self.matched + self.matched_as_all_reduce) / most if most else 1.0


def compare(predicted: list, compiled: list) -> Fidelity:
    """Matches the plan's collectives with XLA's, as multisets. XLA's CPU backend has no
    reduce-scatter: its partitioner emits all-reduce + dynamic-slice, which the GPU backend's
    ReduceScatterCreator turns back into a reduce-scatter; such pairs count as matched."""
    compiled = [(k, a, _as_reported(n)) for k, a, n in compiled]
    matched = Counter(predicted) & Counter(compiled)
    left_predicted = Counter(predicted) - matched
    left_compiled = Counter(compiled) - matched
    as_all_reduce = Counter()
    for (kind, axes, nbytes), count in left_predicted.items():
        if kind == "reduce-scatter":
            pair = min(count, left_compiled[("all-reduce", axes, nbytes)])
            as_all_reduce[(kind, axes, nbytes)] = pair
            left_compiled[("all-reduce", axes, nbytes)] -= pair
    left_predicted -= as_all_reduce
    left_compiled = +left_compiled
    notes = [
        f"  predicted, not compiled: {k}({n} B, {','.join(a)}) x{c}{_explain(k, a, n, left_compiled, compiled)}"
        for (k, a, n), c in sorted(left_predicted.items())
    ]
    notes += [
        f"  compiled, not predicted: {k}({n} B, {','.join(a)}) x{c}{_explain(k, a, n, left_predicted, predicted)}"
        for (k, a, n), c in sorted(left_compiled.items())
    ]
    return Fidelity(len(predicted), len(compiled), sum(matched.values()), sum(as_all_reduce.values()), notes)


def load_program(spec: str):
    """The module of a PROGRAM (module docstring): a zoo `MODEL:CONFIG`, a `.mlir`/`.mlirbc`
    file, or a `file.py:factory` whose step is lowered with its arguments."""
    import importlib.util

    import jax

    from hlopar.ir.module import load_module, parse_module
    from hlopar.models import get_train_step

    if spec.endswith((".mlir", ".mlirbc")):
        return load_module(spec)
    if ".py:" in spec:
        path, name = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if module_spec is None or module_spec.loader is None:
            raise SystemExit(f"{spec}: cannot import {path}")
        source = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(source)
        made = getattr(source, name)()
        return parse_module(jax.jit(made["step"]).lower(*made["args"]).as_text())
    model, _, config = spec.partition(":")
    return parse_module(get_train_step(model, config or "tiny").lower())


def fidelity(program: str, mesh: str = "2x4", preset: str = "cpu", options: str = "") -> Fidelity:
    """Plans a program (`load_program`), compiles it for the mesh's CPU devices and compares."""
    report, hlo = plan_and_compile(load_program(program), mesh, preset, options)
    compiled = compiled_collectives(hlo, report["mesh"]["shape"], report["mesh"]["axes"])
    return compare(predicted_collectives(report), compiled)


def plan(module, mesh: str = "2x4", preset: str = "cpu", options: str = "") -> dict:
    """Imports and plans `module` in place; returns the plan's report."""
    from hlopar.passes.base import PassContext
    from hlopar.passes.pipeline import Pipeline

    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "plan.json"
        pipeline = (
            f"builtin.module(hlopar-import,hlopar-auto-sharding{{mesh-shape={mesh} preset={preset} {options} "
            f"report={report_path}}})"
        )
        Pipeline.parse(pipeline, module.context).run(module, PassContext())
        return json.loads(report_path.read_text())


def plan_and_compile(module, mesh: str = "2x4", preset: str = "cpu", options: str = "") -> tuple[dict, str]:
    """Plans `module` in place (`plan`), compiles it for the mesh's CPU devices, and returns
    the plan's report and the compiled program's HLO text."""
    import jax

    from hlopar.codegen.spmd import compile_spmd

    report = plan(module, mesh, preset, options)
    executable = compile_spmd(module, jax.devices()[: math.prod(report["mesh"]["shape"])]).executable
    return report, executable.hlo_modules()[0].to_string()


def _explain(kind: str, axes, nbytes: int, other_side: Counter, other_all: list) -> str:
    """Known reasons for a mismatch, recognised from its pattern."""
    if any(":" in a for a in axes):
        return "  <- over a sub-axis of the mesh: XLA's own way of partitioning the op or conversion"
    if kind == "collective-permute" and any(k == kind and n == nbytes for k, _, n in other_side):
        return "  <- the same permute over other axes (which devices trade data is approximate on 3-D meshes)"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "models", nargs="*", default=DEFAULT_MODELS, help="MODEL:CONFIG of the zoo, a .mlir/.mlirbc, or file.py:factory"
    )
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--preset", default="v100-p3.16xlarge")
    parser.add_argument("--options", default="", help="more hlopar-auto-sharding options, e.g. latency=0,0")
    args = parser.parse_args()
    rows, all_notes = [], []
    for spec in args.models:
        result = fidelity(spec, args.mesh, args.preset, args.options)
        rows.append((spec, result))
        all_notes += [f"{spec}:"] + result.notes if result.notes else []
    print(f"{'model':<22} {'predicted':>9} {'compiled':>9} {'matched':>8} {'rs as ar':>8} {'rate':>7}")
    for spec, r in rows:
        print(f"{spec:<22} {r.predicted:>9} {r.compiled:>9} {r.matched:>8} {r.matched_as_all_reduce:>8} {r.rate:>7.1%}")
    total = Fidelity(
        *(sum(getattr(r, f) for _, r in rows) for f in ("predicted", "compiled", "matched", "matched_as_all_reduce")),
        [],
    )
    print(
        f"{'total':<22} {total.predicted:>9} {total.compiled:>9} {total.matched:>8} "
        f"{total.matched_as_all_reduce:>8} {total.rate:>7.1%}"
    )
    print("\n".join(all_notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
