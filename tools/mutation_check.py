#!/usr/bin/env python3
"""Do the tests fail when the answer is wrong? Deliberate bugs, each in a copy of the tree.

    .venv/bin/python tools/mutation_check.py [--only NAME ...] [--no-order] [--rev REV] [--baseline] [--no-lit]

Each mutation is a textual patch (search -> replace, the search text must occur exactly once,
or the tool stops) on the source files of a fresh copy of the tree in a temporary folder (the
files `git ls-files` lists, as they are in the working tree; with `--rev`, as they are in that
commit). The default suite then runs there, `pytest -x -q` with this tree's virtual
environment, `PYTHONPATH` and the working folder set to the copy (the tool checks that the
copy's `hlopar` is the one imported), and `lit` over `test/lit` for mutations in a pass. A
mutation is caught when either fails.

With `--order` (the default), the test files most likely to catch a mutation run first (`-x`
stops at the first failure), then the rest of the default suite; `--no-order` runs the
default suite as it comes. `--baseline` runs every mutation's first tests on the unmutated
copy (they must pass, or a "caught" proves nothing). Prints a table:
mutation | caught? | first failing test | seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"


@dataclass(frozen=True)
class Mutation:
    """A deliberate bug: `edits` are (search, replace) pairs on `path`; `first` the tests
    (files or node ids) that should catch it, run before the rest of the suite."""

    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    first: tuple[str, ...]
    lit: bool = False  # the mutation is in a pass: lit runs too
    why: str = field(default="", compare=False)


MUTATIONS = (
    Mutation(
        "update-sign",
        "hlopar/codegen/fragments.py",
        (
            (
                "            func_dialect.ReturnOp([mapping.get(v, v) for v in terminator.operands])\n    return module\n",
                "            func_dialect.ReturnOp([mapping.get(v, v) for v in terminator.operands])\n"
                "    text = str(module)\n"
                '    if "_update" in str(fragment.attributes["origin"]) and "stablehlo.subtract" in text:\n'
                '        head, _, tail = text.rpartition("stablehlo.subtract")\n'
                '        module = ir.Operation.parse(head + "stablehlo.add" + tail, context=fragment.context)\n'
                "    return module\n",
            ),
        ),
        ("test/unit/passes/mpmd_program/test_train_steps.py",),
        why="an update fragment adds its last parameter's step instead of subtracting it",
    ),
    Mutation(
        "restore-stale",
        "hlopar/runtime/ray_worker.py",
        (
            (
                "            value = self.kept[(self.last, r)]\n",
                "            value = self.kept.get((self.last - 1, r), self.kept[(self.last, r)])\n",
            ),
        ),
        ("test/unit/runtime/test_ray_runtime.py::test_a_killed_worker_raises_and_the_next_call_restarts",),
        why="save writes the state of the step before the last one",
    ),
    Mutation(
        "dropped-result",
        "test/support/oracles/sequential_mpmd.py",
        (
            (
                "        return [values[i] for i in self.results]\n",
                "        return [values[i] for i in self.results][:-1]\n",
            ),
        ),
        ("test/unit/passes/mpmd_program/test_mpmd_program.py", "test/unit/passes/mpmd_program/test_train_steps.py"),
        why="the MPMD runner returns one result less",
    ),
    Mutation(
        "shard-order",
        "hlopar/runtime/local_transfer.py",
        (
            (
                "    for logical, index in all_device_slices(transfer.shape, transfer.dst.sharding, transfer.dst.mesh).items():\n",
                "    slices = all_device_slices(transfer.shape, transfer.dst.sharding, transfer.dst.mesh)\n"
                "    for logical, index in zip(slices, list(slices.values())[::-1]):\n",
            ),
        ),
        ("test/unit/runtime/test_reshard_executor.py", "test/integration/zoo/test_pipeline_numerics.py"),
        why="a planned transfer puts the destination's shards back in reverse order",
    ),
    Mutation(
        "microbatch-mean-twice",
        "test/support/oracles/microbatched.py",
        (
            (
                "        results = self.update.run([arguments[i] for i in split.update_args] + sums)\n",
                "        results = self.update.run([arguments[i] for i in split.update_args]\n"
                "                                  + [s / split.microbatches for s in sums])\n",
            ),
        ),
        ("test/unit/passes/split_microbatches/test_microbatched_numerics.py",),
        why="the sums over microbatches (already means over the global batch) are divided by B again",
    ),
    Mutation(
        "stash-freed-early",
        "hlopar/analysis/schedules/instructions.py",
        (
            (
                '        self._free(f"stash.{m}", self.topology.activation_bytes[k], last)\n',
                '        self._free(f"stash.{m + 1}", self.topology.activation_bytes[k], last)\n',
            ),
        ),
        ("test/unit/analysis/schedules/test_sched_instructions.py", "test/unit/runtime/test_pipelined_executor.py"),
        why="after microbatch m's backward, the schedule frees the stash of microbatch m + 1",
    ),
    Mutation(
        "collective-axes-swapped",
        "hlopar/analysis/auto_sharding/strategies.py",
        (
            (
                '    collectives = tuple(Collective("all-reduce", axes, nbytes) for axes in reductions for nbytes in result_bytes)\n',
                '    collectives = tuple(Collective("all-reduce", tuple({"x": "y", "y": "x"}.get(a, a) for a in axes), nbytes)\n'
                "                        for axes in reductions for nbytes in result_bytes)\n",
            ),
        ),
        ("test/unit/analysis/auto_sharding/test_fidelity.py", "test/unit/analysis/auto_sharding/test_strategies.py"),
        lit=True,
        why="the plan's all-reduce of a split contraction names the other mesh axis",
    ),
    Mutation(
        "chlo-left",
        "hlopar/passes/import_program.py",
        (('            upstream.append("func.func(chlo-legalize-to-stablehlo)")\n', "            pass\n"),),
        ("test/unit/passes/test_import.py",),
        lit=True,
        why="the import leaves chlo ops as they are",
    ),
)


def copy_tree(destination: Path, rev: str | None) -> None:
    """The repository's tracked files (working tree, or commit `rev`) into `destination`."""
    if rev:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
        return
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    for name in listed.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    text = path.read_text()
    for search, replace in mutation.edits:
        count = text.count(search)
        if count != 1:
            raise SystemExit(
                f"mutation {mutation.name}: the search text occurs {count} times in {mutation.path} "
                f"(expected once): {search.splitlines()[0].strip()!r}"
            )
        text = text.replace(search, replace)
    path.write_text(text)


def environment(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HLOPAR_CORPUS", str(ROOT.parent / "shared" / "corpus"))  # the copy has nothing beside it
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(tree: Path, env: dict[str, str]) -> None:
    """The copy's `hlopar` is the one the tests import (not the main tree's editable install)."""
    found = subprocess.run(
        [str(VENV_BIN / "python"), "-c", "import hlopar; print(hlopar.__file__)"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the copy in {tree} imports hlopar from {found}: the check would test the main tree")


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def pytest(tree: Path, env: dict[str, str], arguments: list[str]) -> tuple[bool, str]:
    """(failed?, first failing test) of `pytest -x -q` in the copy."""
    command = [str(VENV_BIN / "pytest"), "-x", "-q", "-rfE", "-p", "no:cacheprovider", *arguments]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode in (0, 5):  # 5: nothing collected (e.g. only heavy tests named)
        return False, ""
    found = FAILED.search(result.stdout)
    return True, found.group(1) if found else f"pytest exit {result.returncode}: {result.stdout[-300:]}"


def lit(tree: Path, env: dict[str, str]) -> tuple[bool, str]:
    result = subprocess.run(
        [str(VENV_BIN / "lit"), "-q", "test/lit"], cwd=tree, env=env, capture_output=True, text=True
    )
    if result.returncode == 0:
        return False, ""
    failed = re.findall(r"^\s+hlopar :: (\S+)", result.stdout, re.MULTILINE)
    if not failed:
        return True, "lit failed"
    more = (
        f" (and {len(failed) - 1} more: {', '.join(failed[1:4])}{', ...' if len(failed) > 4 else ''})"
        if len(failed) > 1
        else ""
    )
    return True, f"lit: {failed[0]}{more}"


def run_one(
    mutation: Mutation | None,
    first: tuple[str, ...],
    order: bool,
    rev: str | None,
    whole_suite: bool = True,
    with_lit: bool = True,
) -> tuple[bool, str, float]:
    clock = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hlopar-mutation-") as folder:
        tree = Path(folder)
        copy_tree(tree, rev)
        if mutation is not None:
            apply(mutation, tree)
        env = environment(tree)
        check_import(tree, env)
        if mutation is not None and mutation.lit and with_lit:
            caught, where = lit(tree, env)
            if caught:
                return True, where, time.monotonic() - clock
        rest: list[str] = []
        if order and first:
            caught, where = pytest(tree, env, list(first))
            if caught or not whole_suite:
                return caught, where, time.monotonic() - clock
            for item in first:  # the rest of the default suite
                rest.append(f"--deselect={item}" if "::" in item else f"--ignore={item}")
        if not whole_suite:
            return False, "", time.monotonic() - clock
        caught, where = pytest(tree, env, rest)
        return caught, where, time.monotonic() - clock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument(
        "--order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each mutation's likeliest tests first (default: on)",
    )
    parser.add_argument("--rev", help="copy the files of this commit instead of the working tree")
    parser.add_argument(
        "--baseline", action="store_true", help="first run every mutation's first tests on the unmutated copy"
    )
    parser.add_argument(
        "--lit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run lit for mutations in a pass (default: on; --no-lit: pytest alone)",
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)

    known = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:<24} {m.path}: {m.why}")
        return 0
    unknown = [n for n in args.only or () if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.only] if args.only else list(MUTATIONS)

    rows = []
    if args.baseline:
        first = tuple(dict.fromkeys(t for m in chosen for t in m.first))
        failed, where, seconds = run_one(None, first, True, args.rev, whole_suite=False)
        rows.append(("(none: baseline)", "FAILED" if failed else "passes", where, seconds))
        print(f"baseline: {'FAILED at ' + where if failed else 'passes'} ({seconds:.0f} s)", flush=True)
    for mutation in chosen:
        caught, where, seconds = run_one(mutation, mutation.first, args.order, args.rev, with_lit=args.lit)
        rows.append((mutation.name, "yes" if caught else "NO", where, seconds))
        print(f"{mutation.name}: {'caught by ' + where if caught else 'NOT CAUGHT'} ({seconds:.0f} s)", flush=True)

    print("\n| mutation | failed? | first failing test | seconds |\n|---|---|---|---|")
    for name, caught, where, seconds in rows:
        print(f"| {name} | {caught} | {where or '-'} | {seconds:.0f} |")
    missed = [name for name, caught, _, _ in rows if caught == "NO"]
    baseline_failed = any(caught == "FAILED" for _, caught, _, _ in rows)
    return 1 if missed or baseline_failed else 0


if __name__ == "__main__":
    sys.exit(main())
