"""`--verify-diagnostics`: match produced diagnostics against `expected-*` comments.

The comment syntax is MLIR's: `// expected-error @+1 {{substring of the message}}`,
with `@above`, `@below`, `@+N`, `@-N` or `@unknown` to place it, and `expected-warning`,
`expected-note`, `expected-remark` alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlopar.ir.diagnostics import Diagnostic, SourceLocation

_EXPECTED = re.compile(
    r"expected-(error|warning|note|remark)\s*(?:@(above|below|unknown|[+-]\d+))?\s*(?:\d+\s*)?\{\{(.*?)\}\}"
)


@dataclass(frozen=True)
class Expectation:
    severity: str
    message: str
    line: int | None  # None for @unknown
    written_at: SourceLocation


def expectations_in(text: str, file: str) -> list[Expectation]:
    """The `expected-*` comments of a text whose lines are numbered from 1."""
    found = []
    for number, line in enumerate(text.split("\n"), start=1):
        if "expected-" not in line:
            continue
        for match in _EXPECTED.finditer(line):
            severity, where, message = match.groups()
            target: int | None = number
            if where == "unknown":
                target = None
            elif where == "above":
                target = number - 1
            elif where == "below":
                target = number + 1
            elif where:
                target = number + int(where)
            found.append(Expectation(severity, message, target, SourceLocation(file, number, match.start() + 1)))
    return found


def check_diagnostics(produced: list[Diagnostic], expected: list[Expectation], file: str) -> list[Diagnostic]:
    """The errors of a verify run: expectations not met and diagnostics nobody expected."""
    flat = [d for top in produced for d in _flatten(top)]
    unmatched = list(expected)
    problems = []
    for diagnostic in flat:
        match = next((e for e in unmatched if _matches(e, diagnostic, file)), None)
        if match is not None:
            unmatched.remove(match)
        else:
            problems.append(
                Diagnostic("error", f"unexpected {diagnostic.severity}: {diagnostic.message}", diagnostic.location)
            )
    for expectation in unmatched:
        problems.append(
            Diagnostic(
                "error",
                f'expected {expectation.severity} "{expectation.message}" was not produced',
                expectation.written_at,
            )
        )
    return problems


def _flatten(diagnostic: Diagnostic):
    yield Diagnostic(diagnostic.severity, diagnostic.message, diagnostic.location)
    for note in diagnostic.notes:
        # mlir-opt does not print the failing op when verifying diagnostics; its note is noise here.
        if not note.message.startswith("see current operation"):
            yield from _flatten(note)


def _matches(expectation: Expectation, diagnostic: Diagnostic, file: str) -> bool:
    if expectation.severity != diagnostic.severity or expectation.message not in diagnostic.message:
        return False
    location = diagnostic.location
    if expectation.line is None:
        return location is None or location.file != file
    return location is not None and location.file == file and location.line == expectation.line
