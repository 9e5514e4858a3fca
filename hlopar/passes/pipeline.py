"""Pipeline strings in MLIR syntax, mixing hlopar passes with jaxlib's upstream passes.

`builtin.module(hlopar-import,canonicalize,func.func(cse))`: each top-level element is a
step. hlopar passes run in Python on the module; every other element (a pass or a nested
pipeline) is handed to an MLIR `PassManager` of its own, so that IR printing, timing and
verification happen per step for both kinds alike.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from jaxlib.mlir import ir, passmanager

from hlopar.ir.collector import paused_gc
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.ir.suggestions import did_you_mean
from hlopar.passes.base import ModulePass, OptionError, PassContext
from hlopar.passes.registry import HLOPAR_PASSES

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_UNKNOWN_UPSTREAM = re.compile(r"'([^']+)' does not refer to a registered pass")


class PipelineError(DiagnosticError):
    """A pipeline string that does not parse or names an unknown pass or option."""

    def __init__(self, message: str):
        super().__init__([Diagnostic("error", message)])


@dataclass(frozen=True)
class PipelineElement:
    """One parsed element: `name{options}(nested, ...)`, with its source text."""

    name: str
    options: str | None
    nested: tuple[PipelineElement, ...] | None
    text: str

    def names(self):
        yield self.name
        for child in self.nested or ():
            yield from child.names()


def parse_elements(text: str) -> tuple[PipelineElement, ...]:
    """Parses a comma-separated list of pipeline elements (MLIR textual pipeline syntax)."""
    parser = _ElementParser(text)
    elements = parser.element_list()
    parser.skip_space()
    if parser.pos != len(text):
        parser.error("expected ',' or end of pipeline")
    return elements


class _ElementParser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def error(self, message: str):
        raise PipelineError(f"pass pipeline:1:{self.pos + 1}: {message} in '{self.text}'")

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def element_list(self) -> tuple[PipelineElement, ...]:
        elements = [self.element()]
        self.skip_space()
        while self.pos < len(self.text) and self.text[self.pos] == ",":
            self.pos += 1
            elements.append(self.element())
            self.skip_space()
        return tuple(elements)

    def element(self) -> PipelineElement:
        self.skip_space()
        start = self.pos
        match = _NAME.match(self.text, self.pos)
        if not match:
            self.error("expected a pass name")
        self.pos = match.end()
        options = nested = None
        if self.pos < len(self.text) and self.text[self.pos] == "{":
            options = self.braced()
        self.skip_space()
        if self.pos < len(self.text) and self.text[self.pos] == "(":
            self.pos += 1
            self.skip_space()
            nested = () if self.text.startswith(")", self.pos) else self.element_list()
            self.skip_space()
            if not self.text.startswith(")", self.pos):
                self.error("expected ')'")
            self.pos += 1
        return PipelineElement(match.group(), options, nested, self.text[start : self.pos].strip())

    def braced(self) -> str:
        depth, start, quote = 0, self.pos, None
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    self.pos += 1
                    return self.text[start + 1 : self.pos - 1]
            self.pos += 1
        self.error("unterminated '{'")


@dataclass
class Step:
    """A runnable step: an hlopar pass, or upstream MLIR pipeline text."""

    name: str
    hlopar_pass: ModulePass | None = None
    upstream_text: str | None = None

    def run(self, module: ir.Operation, context: PassContext) -> None:
        if self.hlopar_pass is not None:
            with paused_gc():
                self.hlopar_pass.run(module, context)
            return
        manager = passmanager.PassManager.parse(f"builtin.module({self.upstream_text})", context=module.context)
        try:
            manager.run(module)
        except ir.MLIRError as error:
            raise DiagnosticError.from_mlir_error(error) from None


@dataclass
class Instrumentation:
    """What to observe while a pipeline runs: IR after each step, per-step wall time."""

    print_ir_after_all: TextIO | None = None
    print_ir: Callable[[ir.Operation], str] | None = None
    timings: list[tuple[str, float]] | None = None
    verify_each: bool = True


@dataclass
class Pipeline:
    steps: list[Step] = field(default_factory=list)

    @staticmethod
    def parse(text: str, context: ir.Context) -> Pipeline:
        """Parses and validates a pipeline; unknown passes and bad options raise `PipelineError`."""
        text = text.strip()
        if not text:
            return Pipeline()
        elements = parse_elements(text)
        if len(elements) == 1 and elements[0].name == "builtin.module" and elements[0].nested is not None:
            if elements[0].options is not None:
                raise PipelineError("'builtin.module' takes no options")
            elements = elements[0].nested
        return Pipeline([_step_for(element, context) for element in elements])

    def run(self, module: ir.Operation, context: PassContext, instrumentation: Instrumentation | None = None) -> None:
        instrumentation = instrumentation or Instrumentation()
        for step in self.steps:
            start = time.perf_counter()
            step.run(module, context)
            if instrumentation.verify_each and step.hlopar_pass is not None:
                verify(module, after=step.name)
            if instrumentation.timings is not None:
                instrumentation.timings.append((step.name, time.perf_counter() - start))
            if instrumentation.print_ir_after_all is not None:
                printed = (instrumentation.print_ir or str)(module)
                instrumentation.print_ir_after_all.write(
                    f"// -----// IR Dump After {step.name} //----- //\n{printed}\n\n"
                )


def verify(module: ir.Operation, *, after: str | None = None) -> None:
    """Runs the MLIR verifier; failures become diagnostics that say which step broke the IR."""
    try:
        module.verify()
    except ir.MLIRError as error:
        diagnostics = DiagnosticError.from_mlir_error(error).diagnostics
        if after:
            diagnostics = (Diagnostic("error", f"the IR is invalid after '{after}'"),) + diagnostics
        raise DiagnosticError(diagnostics) from None


def _step_for(element: PipelineElement, context: ir.Context) -> Step:
    pass_class = HLOPAR_PASSES.get(element.name)
    if pass_class is not None:
        if element.nested is not None:
            raise PipelineError(f"'{element.name}' is a pass, not an op anchor; it takes no nested pipeline")
        try:
            return Step(element.text, hlopar_pass=pass_class.from_options(element.options or ""))
        except OptionError as error:
            raise PipelineError(str(error)) from None
    nested_hlopar = [name for name in element.names() if name in HLOPAR_PASSES]
    if nested_hlopar:
        raise PipelineError(f"'{nested_hlopar[0]}' runs on the whole module: put it at the top level of the pipeline")
    try:
        passmanager.PassManager.parse(f"builtin.module({element.text})", context=context)
    except ir.MLIRError as error:
        raise PipelineError(_explain_upstream_error(element, str(error))) from None
    except ValueError as error:  # some binding versions raise ValueError for pipeline text
        raise PipelineError(_explain_upstream_error(element, str(error))) from None
    return Step(element.text, upstream_text=element.text)


def _explain_upstream_error(element: PipelineElement, message: str) -> str:
    unknown = _UNKNOWN_UPSTREAM.search(message)
    if unknown:
        return (
            f"unknown pass or pipeline '{unknown.group(1)}'{did_you_mean(unknown.group(1), HLOPAR_PASSES)} "
            f"(hlopar passes: {', '.join(sorted(HLOPAR_PASSES))}; "
            f"other names must be passes registered in jaxlib's MLIR)"
        )
    detail = message.splitlines()[-1] if message else ""
    detail = re.sub(r"^.*?error: ", "", detail)
    return f"invalid pipeline element '{element.text}': {detail}"
