"""Diagnostics as mlir-opt prints them: `file:line:col: error: message`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from jaxlib.mlir import ir

# A `"file":line:col` inside a printed location; callsite and fused locations print
# their innermost file location first, name locations wrap it.
_FILE_LINE_COL = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):(\d+)')
_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]")

_SEVERITIES = {
    ir.DiagnosticSeverity.ERROR: "error",
    ir.DiagnosticSeverity.WARNING: "warning",
    ir.DiagnosticSeverity.NOTE: "note",
    ir.DiagnosticSeverity.REMARK: "remark",
}


@dataclass(frozen=True)
class SourceLocation:
    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def source_location(location: ir.Location | None) -> SourceLocation | None:
    """The file position of an MLIR location, or None when it has none."""
    if location is None:
        return None
    matches = list(_FILE_LINE_COL.finditer(str(location)))
    if not matches:
        return None
    # A call stack (JAX's callsite locations) names the innermost frame first: the first frame
    # outside installed packages (a Flax layer's source) is the user's line.
    match = next((m for m in matches if not _INSTALLED.search(m.group(1))), matches[0])
    return SourceLocation(match.group(1), int(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # error | warning | note | remark
    message: str
    location: SourceLocation | None = None
    notes: tuple[Diagnostic, ...] = field(default=())

    def format(self, default_file: str = "-") -> str:
        where = str(self.location) if self.location else default_file
        lines = [f"{where}: {self.severity}: {self.message}"]
        lines += [note.format(default_file) for note in self.notes]
        return "\n".join(lines)

    def reworded(self, reword: Callable[[str], str]) -> Diagnostic:
        """The same diagnostic with `reword` applied to its message and its notes' (a tool
        naming the passes' options as its own flags)."""
        return replace(self, message=reword(self.message), notes=tuple(n.reworded(reword) for n in self.notes))

    @staticmethod
    def from_mlir(info) -> Diagnostic:
        """Converts an `ir.DiagnosticInfo` (or a live `ir.Diagnostic`)."""
        return Diagnostic(
            severity=_SEVERITIES.get(info.severity, "error"),
            message=info.message,
            location=source_location(info.location),
            notes=tuple(Diagnostic.from_mlir(n) for n in info.notes),
        )


def error_at(op_or_location, message: str) -> Diagnostic:
    """An error diagnostic placed at an op (or a location)."""
    location = getattr(op_or_location, "location", op_or_location)
    return Diagnostic("error", message, source_location(location))


class DiagnosticError(Exception):
    """Raised with one or more diagnostics; the CLI prints them and exits 1."""

    def __init__(self, diagnostics: list[Diagnostic] | tuple[Diagnostic, ...]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.format() for d in self.diagnostics))

    def reworded(self, reword: Callable[[str], str]) -> DiagnosticError:
        return DiagnosticError([d.reworded(reword) for d in self.diagnostics])

    @staticmethod
    def from_mlir_error(error: ir.MLIRError) -> DiagnosticError:
        diagnostics = [Diagnostic.from_mlir(d) for d in error.error_diagnostics]
        if not diagnostics:
            diagnostics = [Diagnostic("error", str(error))]
        return DiagnosticError(diagnostics)
