#!/usr/bin/env python3
"""Runs `hlopar-import` over every program of a corpus and prints the pass rate.

    python tools/run_corpus.py [CORPUS_DIR] [--sample N] [--pipeline P] [--verbose]

CORPUS_DIR defaults to `HLOPAR_CORPUS`, or `../shared/corpus` beside the repository (`hlopar.corpus`).

Each file (each `// -----` part, for files whose RUN line splits) is imported in a
forked child, printed, and the printed text parsed and verified again. Outcomes:

  ok               imported, and the output parses and verifies again
  rejected         jaxlib's own MLIR does not accept the program (a dialect it does not
                   ship such as quant, sdy syntax newer than its sdy, or a negative test
                   with `expected-error`), and hlopar says so with a located error
  FAILED           an error or crash in the pipeline, or output that does not parse again

Exit status 1 if anything FAILED.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hlopar.cli.opt_driver import split_input  # noqa: E402
from hlopar.corpus import CORPUS_VARIABLE, corpus_dir  # noqa: E402


def corpus_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".mlir", ".mlirbc") and p.is_file())


def sample(files: list[Path], count: int | None) -> list[Path]:
    """A fixed, evenly spread sample: the same files on every run."""
    if count is None or count >= len(files):
        return files
    step = len(files) / count
    return [files[int(i * step)] for i in range(count)]


def check_part(source: str | bytes, name: str, pipeline: str, compile_output: bool = False) -> tuple[str, str]:
    """(outcome, detail) for one program; runs in a forked child."""
    from hlopar.ir.context import make_context
    from hlopar.ir.diagnostics import DiagnosticError
    from hlopar.ir.module import parse_module, print_module
    from hlopar.passes.base import PassContext
    from hlopar.passes.pipeline import Pipeline

    try:
        module = parse_module(source, source_name=name)
    except DiagnosticError as error:
        # Not a program jaxlib's MLIR accepts: a clean, located error is the right answer.
        return "rejected", error.diagnostics[0].format(name)
    try:
        Pipeline.parse(pipeline, module.context).run(module, PassContext())
        printed = print_module(module)
    except DiagnosticError as error:
        return "FAILED", error.diagnostics[0].format(name)
    try:
        reparsed = parse_module(printed, source_name=f"{name} (output)", context=make_context(allow_unregistered=True))
    except DiagnosticError as error:
        return "FAILED", "output does not parse again: " + error.diagnostics[0].format(name)
    if compile_output:
        return _check_compiles(source, name, reparsed)
    return "ok", ""


def _check_compiles(source, name: str, output) -> tuple[str, str]:
    """The output must compile for its mesh's devices wherever the input compiles on one."""
    import jax

    from hlopar.codegen.spmd import compile_spmd, mesh_size
    from hlopar.ir.module import parse_module

    not_compilable = (jax.errors.JaxRuntimeError, ValueError)
    try:
        compile_spmd(parse_module(source, source_name=name), jax.devices()[:1])
    except not_compilable:  # the input does not compile here (GPU custom calls, no @main, ...)
        return "ok", ""
    try:
        compile_spmd(output, jax.devices()[: mesh_size(output)])
    except not_compilable as error:
        return "FAILED", f"{name}: the output does not compile: {str(error).splitlines()[0][:300]}"
    return "ok (compiled)", ""


def run_forked(
    source: str | bytes, name: str, pipeline: str, compile_output: bool = False, timeout: float = 600.0
) -> tuple[str, str]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            outcome, detail = check_part(source, name, pipeline, compile_output)
        except Exception as error:  # noqa: BLE001 - reported as a failure, not raised
            outcome, detail = "FAILED", f"internal error: {type(error).__name__}: {error}"
        os.write(write_end, f"{outcome}\n{detail}".encode())
        os._exit(0)
    os.close(write_end)
    timer = threading.Timer(timeout, os.kill, (pid, signal.SIGKILL))
    timer.start()
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    timed_out = not timer.is_alive()
    timer.cancel()
    if os.WIFSIGNALED(status):
        if timed_out and os.WTERMSIG(status) == signal.SIGKILL:
            return "FAILED", f"{name}: took more than {timeout:.0f} s"
        return "FAILED", f"{name}: crashed with signal {os.WTERMSIG(status)}"
    outcome, _, detail = message.partition("\n")
    return outcome, detail


def parts_of(path: Path) -> list[tuple[str | bytes, str]]:
    data = path.read_bytes()
    if data.startswith(b"ML\xefR"):
        return [(data, str(path))]
    text = data.decode("utf-8", errors="replace")
    run_lines = [line for line in text.splitlines()[:40] if "RUN:" in line]
    marker = "// -----" if any("split-input-file" in line for line in run_lines) else None
    return [(chunk.text, str(path)) for chunk in split_input(text, marker)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", type=Path, default=corpus_dir())
    parser.add_argument("--sample", type=int, default=None, help="check a fixed sample of N files")
    parser.add_argument("--pipeline", default="builtin.module(hlopar-import)")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every rejected part too")
    parser.add_argument("--part-timeout", type=float, default=600.0, help="seconds allowed per program")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also compile the output (on 8 CPU devices) wherever the input compiles on one",
    )
    args = parser.parse_args()
    if not args.corpus.is_dir():
        print(
            f"error: corpus directory not found: {args.corpus} (give CORPUS_DIR or set {CORPUS_VARIABLE})",
            file=sys.stderr,
        )
        return 2
    if args.compile:
        from hlopar.runtime.host_devices import use_host_devices

        use_host_devices(8)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # no per-process device banner
    import hlopar.passes.registry  # noqa: F401 - load jaxlib once, before forking

    files = sample(corpus_files(args.corpus), args.sample)
    start = time.perf_counter()
    by_folder: dict[str, Counter] = {}
    failures = []
    compiled = 0
    for path in files:
        folder = path.relative_to(args.corpus).parts[0]
        counts = by_folder.setdefault(folder, Counter())
        outcomes = [
            run_forked(source, name, args.pipeline, args.compile, args.part_timeout) for source, name in parts_of(path)
        ]
        file_outcome = (
            "FAILED"
            if any(o == "FAILED" for o, _ in outcomes)
            else ("ok" if all(o.startswith("ok") for o, _ in outcomes) else "rejected")
        )
        counts[file_outcome] += 1
        compiled += any(o == "ok (compiled)" for o, _ in outcomes)
        for outcome, detail in outcomes:
            if outcome == "FAILED" or (args.verbose and outcome == "rejected"):
                failures.append(f"{outcome}: {detail}")
    elapsed = time.perf_counter() - start
    for line in failures:
        print(line)
    total = Counter()
    print(f"\n{'folder':<22} {'files':>6} {'ok':>6} {'rejected':>9} {'FAILED':>7}")
    for folder, counts in sorted(by_folder.items()):
        total += counts
        print(f"{folder:<22} {sum(counts.values()):>6} {counts['ok']:>6} {counts['rejected']:>9} {counts['FAILED']:>7}")
    n = sum(total.values())
    print(f"{'total':<22} {n:>6} {total['ok']:>6} {total['rejected']:>9} {total['FAILED']:>7}")
    print(
        f"pass rate: {100.0 * (n - total['FAILED']) / max(n, 1):.2f}% of {n} files "
        f"({total['ok']} imported, {total['rejected']} cleanly rejected) in {elapsed:.1f} s"
    )
    if args.compile:
        print(
            f"compiled: {compiled} outputs compiled for their mesh (the other inputs do not compile on one CPU device)"
        )
    return 1 if total["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
