"""Loading and printing modules: MLIR text, MLIR bytecode and StableHLO portable artifacts.

A module is handled as its `builtin.module` operation (`ir.Operation`): that is what
`Operation.parse` returns with a source name (so diagnostics say `file:line:col`), and
what `PassManager.run` accepts.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import stablehlo

from hlopar.ir.context import HLOPAR_DIALECT, make_context
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, source_location

_BYTECODE_MAGIC = b"ML\xefR"
# Portable artifacts are VHLO bytecode whose producer string names StableHLO.
_PORTABLE_PRODUCER = b"StableHLO_v"
_UNREGISTERED = re.compile(r"unregistered dialect|Dialect `\w+' not found")
_MISSING_DIALECT_MESSAGE = "dialect '{}' is not available in jaxlib's MLIR; hlopar cannot process programs that use it"


def is_bytecode(data: bytes) -> bool:
    return data.startswith(_BYTECODE_MAGIC)


def parse_module(
    source: str | bytes,
    *,
    source_name: str = "-",
    context: ir.Context | None = None,
) -> ir.Operation:
    """Parses text, bytecode or a portable artifact into a verified `builtin.module` op.

    Raises `DiagnosticError` with `file:line:col` diagnostics for bad input. Without a
    context, a fresh one is made, allowing unregistered ops only when the text names
    hlopar's dialect; any other unknown dialect is still an error.
    """
    if isinstance(source, bytes) and not is_bytecode(source):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DiagnosticError(
                [Diagnostic("error", f"{source_name}: neither MLIR text (UTF-8) nor MLIR bytecode: {error}")]
            ) from None
    if context is None:
        needs_hlopar = isinstance(source, str) and f"{HLOPAR_DIALECT}." in source
        context = make_context(allow_unregistered=needs_hlopar)
    try:
        with context:
            if isinstance(source, bytes):
                module = _parse_bytecode(source)
            else:
                module = _parse_text(source, source_name)
    except ir.MLIRError as error:
        raise _explain_missing_dialects(DiagnosticError.from_mlir_error(error), source) from None
    if module.name != "builtin.module":
        raise DiagnosticError(
            [
                Diagnostic(
                    "error",
                    f"expected 'builtin.module' at top level, found '{module.name}'",
                    source_location(module.location),
                )
            ]
        )
    if context.allow_unregistered_dialects:
        _reject_foreign_unregistered_ops(module)
    return module


def find_main(module: ir.Operation) -> ir.Operation | None:
    """The module's `func.func @main`, or None."""
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main":
            return op.operation
    return None


def main_func(module: ir.Operation) -> ir.Operation:
    """The module's `func.func @main`; `ValueError` when it has none."""
    main = find_main(module)
    if main is None:
        raise ValueError("the module has no @main")
    return main


def planned_functions(module: ir.Operation) -> list[ir.Operation]:
    """`@main` when there is one (the rest are its callees), else every public function."""
    public = []
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name != "func.func":
            continue
        if ir.StringAttr(op.operation.attributes["sym_name"]).value == "main":
            return [op.operation]
        visibility = op.operation.attributes["sym_visibility"] if "sym_visibility" in op.operation.attributes else None
        if visibility is None or ir.StringAttr(visibility).value == "public":
            public.append(op.operation)
    return public


def run_function_pass(module: ir.Operation, funcs: list[ir.Operation], pass_name: str) -> None:
    """Runs an upstream function pass on some functions only (the others may not satisfy it)."""
    for func in funcs:
        manager = passmanager.PassManager.parse(f"func.func({pass_name})", context=module.context)
        try:
            manager.run(func)
        except ir.MLIRError as error:
            raise DiagnosticError.from_mlir_error(error) from None


def read_source(path: str | Path) -> bytes:
    """The bytes of a file, or of standard input for `-`."""
    name = str(path)
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as error:
        raise DiagnosticError([Diagnostic("error", f"cannot read '{name}': {error.strerror}")]) from None


def load_module(path: str | Path, *, context: ir.Context | None = None) -> ir.Operation:
    """Reads and parses a file (`-` reads standard input)."""
    return parse_module(read_source(path), source_name=str(path), context=context)


def print_module(module: ir.Operation, *, debug_info: bool = False, generic: bool = False) -> str:
    """The module as text, like mlir-opt prints it (no locations unless asked)."""
    return module.get_asm(enable_debug_info=debug_info, print_generic_op_form=generic)


def module_bytecode(module: ir.Operation) -> bytes:
    import io

    buffer = io.BytesIO()
    module.write_bytecode(buffer)
    return buffer.getvalue()


_ALIAS_OR_TRIVIA = re.compile(r"\s*($|//|[#!][\w.$-]*\s*=)")
_ALIAS = re.compile(r"\s*[#!][\w.$-]*\s*=")


def _parse_text(text: str, source_name: str) -> ir.Operation:
    try:
        parsed = ir.Operation.parse(text, source_name=source_name).operation
        if parsed.name == "builtin.module":
            return parsed
    except ir.MLIRError as error:
        if "single top-level operation" not in str(error):
            raise
    return ir.Operation.parse(_wrap_in_module(text), source_name=source_name).operation


def _wrap_in_module(text: str) -> str:
    """Wraps several top-level ops in `module { }` as mlir-opt does, keeping line numbers.

    Alias definitions (`!t = ...`, `#a = ...`) must stay outside the module: they move,
    all on one line, in front of `module {`, and their own lines are left blank. The
    opening brace takes the place of a blank or comment line before the first op when
    there is one (else line 1 shifts right); the closing one goes after the last op.
    """
    lines = text.split("\n")
    aliases = [i for i, line in enumerate(lines) if _ALIAS.match(line) and not _continues(lines, i)]
    hoisted = " ".join(lines[i].strip() for i in aliases)
    for i in aliases:
        lines[i] = ""
    op_lines = [i for i, line in enumerate(lines) if not _ALIAS_OR_TRIVIA.match(line)]
    if not op_lines:
        return text
    first, last = op_lines[0], op_lines[-1]
    lines.insert(last + 1, "}")
    spare = [i for i in range(first) if not lines[i].strip() or lines[i].lstrip().startswith("//")]
    if spare:
        lines[spare[-1]] = f"{hoisted} module {{"
    else:
        lines[first] = f"{hoisted} module {{ {lines[first]}"
    return "\n".join(lines)


def _continues(lines: list[str], index: int) -> bool:
    """Whether a line that looks like an alias is really inside an op (an attribute dict)."""
    previous = next(
        (line for line in reversed(lines[:index]) if line.strip() and not line.lstrip().startswith("//")), ""
    )
    return previous.rstrip().endswith(("{", ",", "("))


def _parse_bytecode(data: bytes) -> ir.Operation:
    context = ir.Context.current
    if _PORTABLE_PRODUCER in data[:64]:
        parsed = stablehlo.deserialize_portable_artifact(context, data)
    else:
        parsed = ir.Module.parse(data)
    # Detach from the ir.Module wrapper so the op owns itself like a parsed text module.
    return parsed.operation.clone()


def _explain_missing_dialects(error: DiagnosticError, source: str | bytes) -> DiagnosticError:
    """Names the dialect jaxlib lacks instead of MLIR's generic advice."""
    lines = source.splitlines() if isinstance(source, str) else []
    explained = []
    for diagnostic in error.diagnostics:
        if _UNREGISTERED.search(diagnostic.message):
            dialect = _dialect_named_in(diagnostic, lines)
            if dialect:
                diagnostic = replace(diagnostic, message=_MISSING_DIALECT_MESSAGE.format(dialect))
        explained.append(diagnostic)
    return DiagnosticError(explained)


def _dialect_named_in(diagnostic: Diagnostic, lines: list[str]) -> str | None:
    for pattern in (r'`[!#]"(\w+)"<', r"Dialect `(\w+)' not found"):
        match = re.search(pattern, diagnostic.message)
        if match:
            return match.group(1)
    loc = diagnostic.location
    if loc and 0 < loc.line <= len(lines):
        line = lines[loc.line - 1]
        match = re.match(r'"?([A-Za-z_]\w*)\.', line[loc.col - 1 :]) or re.search(r'"([A-Za-z_]\w*)\.[\w.]+"', line)
        if match:
            return match.group(1)
    return None


def _reject_foreign_unregistered_ops(module: ir.Operation) -> None:
    """With unregistered ops allowed for hlopar's dialect, nothing else may be unknown."""
    context = module.context
    foreign: list[Diagnostic] = []

    def check(op: ir.Operation) -> ir.WalkResult:
        name = op.name
        if not name.startswith(HLOPAR_DIALECT + ".") and not context.is_registered_operation(name):
            message = _MISSING_DIALECT_MESSAGE.format(name.split(".", 1)[0])
            foreign.append(Diagnostic("error", message, source_location(op.location)))
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    module.walk(check)
    if foreign:
        raise DiagnosticError(foreign)
