"""What `hlopar-opt` does with one input: split, parse, run the pipeline, print."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

from jaxlib.mlir import ir

from hlopar.cli.verify_diagnostics import check_diagnostics, expectations_in
from hlopar.ir.context import HLOPAR_DIALECT, make_context
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.ir.module import is_bytecode, module_bytecode, parse_module, print_module, read_source
from hlopar.passes.base import PassContext
from hlopar.passes.pipeline import Instrumentation, Pipeline


@dataclass
class OptResult:
    ok: bool
    output: bytes
    diagnostics: list[Diagnostic]
    timing_report: str = ""


@dataclass(frozen=True)
class Chunk:
    """A part of a split input; `text` keeps the original line numbers (leading newlines)."""

    text: str


def split_input(text: str, marker: str | None) -> list[Chunk]:
    """Splits at lines that are exactly the marker, keeping each part's line numbers."""
    if marker is None:
        return [Chunk(text)]
    chunks, start, lines = [], 0, text.split("\n")
    for number, line in enumerate(lines + [marker]):
        if line.strip() == marker:
            chunks.append(Chunk("\n" * start + "\n".join(lines[start:number])))
            start = number + 1
    return chunks


@dataclass
class OptDriver:
    pipeline: str = ""
    split_marker: str | None = None
    verify_diagnostics: bool = False
    print_ir_after_all: bool = False
    timing: bool = False
    debug_info: bool = False
    generic: bool = False
    bytecode: bool = False
    verify_each: bool = True
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def process_file(self, path: str) -> OptResult:
        start = time.perf_counter()
        Pipeline.parse(self.pipeline, make_context())  # bad pipelines fail before reading input
        data = read_source(path)
        if is_bytecode(data):
            chunks: list[Chunk | bytes] = [data]
        else:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DiagnosticError([Diagnostic("error", f"not UTF-8 text nor MLIR bytecode: {error}")]) from None
            chunks = split_input(text, self.split_marker)
        outputs, diagnostics, ok = [], [], True
        for chunk in chunks:
            output, produced = self._process_chunk(chunk, path)
            if self.verify_diagnostics:
                source = chunk.text if isinstance(chunk, Chunk) else ""
                problems = check_diagnostics(produced, expectations_in(source, path), path)
                diagnostics += problems
                ok = ok and not problems
            else:
                diagnostics += produced
                ok = ok and output is not None
            if output is not None:
                outputs.append(output)
        report = self._timing_report(time.perf_counter() - start) if self.timing else ""
        if self.bytecode:
            return OptResult(ok, outputs[0] if len(outputs) == 1 else b"", diagnostics, report)
        separator = "\n// -----\n" if self.split_marker else ""
        return OptResult(ok, separator.join(outputs).encode(), diagnostics, report)

    def _process_chunk(self, chunk: Chunk | bytes, path: str) -> tuple[bytes | str | None, list[Diagnostic]]:
        source = chunk if isinstance(chunk, bytes) else chunk.text
        context = make_context(allow_unregistered=isinstance(source, str) and f"{HLOPAR_DIALECT}." in source)
        pass_context = PassContext()
        handler = context.attach_diagnostic_handler(_collector(pass_context.diagnostics))
        try:
            start = time.perf_counter()
            module = parse_module(source, source_name=path, context=context)
            self.timings["Parser"] += time.perf_counter() - start
            step_times: list[tuple[str, float]] = []
            instrumentation = Instrumentation(
                print_ir_after_all=sys.stderr if self.print_ir_after_all else None,
                print_ir=self._print,
                timings=step_times,
                verify_each=self.verify_each,
            )
            Pipeline.parse(self.pipeline, context).run(module, pass_context, instrumentation)
            for name, seconds in step_times:
                self.timings[name] += seconds
            start = time.perf_counter()
            output = module_bytecode(module) if self.bytecode else self._print(module) + "\n"
            self.timings["Output"] += time.perf_counter() - start
            return output, pass_context.diagnostics
        except DiagnosticError as error:
            return None, pass_context.diagnostics + list(error.diagnostics)
        finally:
            handler.detach()

    def _print(self, module: ir.Operation) -> str:
        return print_module(module, debug_info=self.debug_info, generic=self.generic)

    def _timing_report(self, total: float) -> str:
        rule = "===" + "-" * 73 + "==="
        lines = [
            rule,
            " " * 25 + "... Execution time report ...",
            rule,
            f"  Total Execution Time: {total:.4f} seconds",
            "",
            "  ----Wall Time----  ----Name----",
        ]
        for name, seconds in self.timings.items():
            lines.append(f"  {seconds:10.4f} ({100 * seconds / total:5.1f}%)  {name}")
        lines.append(f"  {total:10.4f} (100.0%)  Total")
        return "\n".join(lines) + "\n"


def _collector(sink: list[Diagnostic]):
    """A diagnostic handler that keeps warnings and remarks MLIR emits outside errors."""

    def handle(diagnostic) -> bool:
        if diagnostic.severity != ir.DiagnosticSeverity.ERROR:
            sink.append(Diagnostic.from_mlir(diagnostic))
        return True

    return handle
