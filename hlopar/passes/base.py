"""The pass base class: a dataclass whose fields are its options.

Options are written in MLIR pipeline syntax, `hlopar-x{mesh-shape=2x4 report=plan.json}`:
a field `mesh_shape` is the option `mesh-shape`, parsed according to its annotation and
checked against its bounds (`option(check=...)`, else by its type: `default_check`), both
when a pipeline is parsed and when a pass is built in code, before any work.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from jaxlib.mlir import ir

from hlopar.analysis.limits import check_count, check_number
from hlopar.ir.collector import paused_gc
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, source_location
from hlopar.ir.output import output_problem, write_output
from hlopar.ir.suggestions import did_you_mean


def option(
    default: Any,
    help: str,
    *,
    parse: typing.Callable[[str], Any] | None = None,
    check: typing.Callable[[Any], None] | None = None,
) -> Any:
    """Declares a pass option: a dataclass field with its help text and, if needed, a parser
    and a check. `check(value)` raises `ValueError` saying which bound the value passes and
    why (`analysis.limits`); without one, the value's type sets the bounds (`default_check`).
    None, for an optional option, is never checked."""
    return field(default=default, metadata={"help": help, "parse": parse, "check": check})


def report_option(help: str) -> Any:
    """Declares a `report` option: a path to write a JSON report to, or None. Checked with the
    options: where nothing can be written (no such directory, a directory) is an error before
    any work. A device or a pipe is written into; a file, replaced whole (`ir.output`)."""
    return option(None, help, check=_check_output_path)


def _check_output_path(path: str) -> None:
    problem = output_problem(path)
    if problem:
        raise ValueError(problem)


class OptionError(ValueError):
    """A pass option that does not exist or whose value does not parse."""


@dataclass
class PassContext:
    """What a running pass may use besides the module: where to send warnings, and where to
    hand its report over. `reports` is None unless the caller collects the passes' reports
    (the planning pipeline, `passes.planning`): then each pass's report is there under the
    pass's name, whether or not its `report` option names a file."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    reports: dict[str, dict] | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # pass name -> time it ran (`timed`), summed

    def timed(self, pass_: ModulePass, module: ir.Operation) -> None:
        """Runs `pass_` on `module` in this context (the cyclic collector paused, as a
        pipeline step runs it), its time added to `seconds`."""
        clock = time.perf_counter()
        try:
            with paused_gc():
                pass_.run(module, self)
        finally:
            self.seconds[pass_.name] = self.seconds.get(pass_.name, 0.0) + time.perf_counter() - clock

    def warn(self, op_or_location: Any, message: str) -> None:
        location = getattr(op_or_location, "location", op_or_location)
        self.diagnostics.append(Diagnostic("warning", message, source_location(location)))


@dataclass
class ModulePass:
    """Base of hlopar's passes. Subclasses set `name`, `summary` and implement `run`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in self.option_fields():
            value = getattr(self, f.name)
            try:
                _check(f, hints[f.name], value)
            except ValueError as error:
                raise OptionError(
                    f"option '{self.option_name(f)}' of pass '{self.name}': invalid value "
                    f"'{_format_value(value)}': {error}"
                ) from None
        try:
            self.check_options()
        except ValueError as error:
            raise OptionError(f"pass '{self.name}': {error}") from None

    def check_options(self) -> None:
        """Checks that involve several options (e.g. hosts x devices per host); raises `ValueError`."""

    def run(self, module: ir.Operation, context: PassContext) -> None:
        raise NotImplementedError

    def wants_report(self, context: PassContext) -> bool:
        """Whether anyone reads this run's report: a `report` option's file, or the context."""
        return getattr(self, "report", None) is not None or context.reports is not None

    def emit_report(
        self, module: ir.Operation, context: PassContext, report: dict, *, indent: int = 1, end: str = "\n"
    ) -> None:
        """Hands the report over: to the context, as JSON reads it back (plain lists and
        string keys), where it collects reports; to the `report` option's file where it names
        one (`json.dumps(report, indent=indent) + end`)."""
        text = json.dumps(report, indent=indent)
        if context.reports is not None:
            context.reports[self.name] = json.loads(text)
        path = getattr(self, "report", None)
        if path is not None:
            try:
                write_output(path, text + end)
            except OSError as error:
                self.fail(module, f"cannot write the report to '{path}': {error.strerror}")

    def fail(self, op_or_location: Any, message: str) -> typing.NoReturn:
        """Stops the pipeline with an error located at an op."""
        location = getattr(op_or_location, "location", op_or_location)
        raise DiagnosticError([Diagnostic("error", f"{self.name}: {message}", source_location(location))])

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def option_name(cls, f: dataclasses.Field) -> str:
        return f.name.replace("_", "-")

    @classmethod
    def from_options(cls, text: str) -> ModulePass:
        """Builds the pass from the text between braces in a pipeline string."""
        hints = typing.get_type_hints(cls)
        by_name = {cls.option_name(f): f for f in cls.option_fields()}
        values: dict[str, Any] = {}
        try:
            words = shlex.split(text)
        except ValueError as error:
            raise OptionError(f"pass '{cls.name}': malformed options '{{{text}}}': {error}") from None
        for word in words:
            key, has_value, raw = word.partition("=")
            if key not in by_name:
                known = ", ".join(sorted(by_name)) or "none"
                raise OptionError(
                    f"pass '{cls.name}' has no option '{key}'{did_you_mean(key, by_name)} (options: {known})"
                )
            f = by_name[key]
            if not has_value:
                if hints[f.name] is not bool:
                    raise OptionError(f"option '{key}' of pass '{cls.name}' needs a value")
                raw = "true"
            try:
                if raw in ("", "none") and _optional_inner(hints[f.name]) is not hints[f.name]:
                    values[f.name] = None
                    continue
                values[f.name] = (f.metadata.get("parse") or _parser_for(hints[f.name]))(raw)
                _check(f, hints[f.name], values[f.name])
            except (ValueError, TypeError) as error:
                raise OptionError(f"option '{key}' of pass '{cls.name}': invalid value '{raw}': {error}") from None
        return cls(**values)

    def pipeline_text(self) -> str:
        """This pass with its non-default options, in pipeline syntax."""
        parts = []
        for f in self.option_fields():
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{self.option_name(f)}={_format_value(value)}")
        return self.name + ("{" + " ".join(parts) + "}" if parts else "")

    @classmethod
    def help_lines(cls) -> list[str]:
        hints = typing.get_type_hints(cls)
        lines = [f"  {cls.name:<34} {cls.summary}"]
        for f in cls.option_fields():
            default = "" if f.default is None else f" (default: {_format_value(f.default)})"
            lines.append(
                f"      {cls.option_name(f)}=<{_type_name(hints[f.name])}>  {f.metadata.get('help', '')}{default}"
            )
        return lines


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "on", "yes"):
        return True
    if lowered in ("false", "0", "off", "no"):
        return False
    raise ValueError("expected true or false")


def parse_count_or_auto(text: str) -> int | None:
    """`auto` → None (the pass chooses), else a positive count."""
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise ValueError("expected a positive number or auto")
    return value


def parse_int_tuple(text: str) -> tuple[int, ...]:
    """`2x4`, `2,4` or `[2, 4]` → (2, 4); `2x`, `2,,4` and `x4` are errors."""
    body = text.strip()
    if body[:1] in ("[", "(") and body[-1:] == {"[": "]", "(": ")"}[body[0]]:
        body = body[1:-1]
    parts = re.split(r"\s*[x,]\s*", body.strip())
    if not all(re.fullmatch(r"[+-]?\d+", p) for p in parts):
        raise ValueError("expected integers joined by x or commas, such as 2x4")
    return tuple(int(p) for p in parts)


def parse_str_tuple(text: str) -> tuple[str, ...]:
    body = text.strip().strip("[]()")
    return tuple(p.strip().strip("'\"") for p in body.split(",") if p.strip())


def default_check(annotation: Any, value: Any) -> None:
    """The bounds an option has by its type: an int (or each of a tuple's) in 0..2^31-1, a
    float finite and >= 0. Options that need others declare a `check`."""
    inner = _optional_inner(annotation)
    if typing.get_origin(inner) is tuple:
        for item in value:
            default_check(typing.get_args(inner)[0], item)
    elif inner is int:
        check_count(value)
    elif inner is float:
        check_number(value)


def _check(f: dataclasses.Field, annotation: Any, value: Any) -> None:
    if value is None and _optional_inner(annotation) is not annotation:
        return
    (f.metadata.get("check") or (lambda v: default_check(annotation, v)))(value)


def _optional_inner(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return annotation


def _parser_for(annotation: Any) -> typing.Callable[[str], Any]:
    inner = _optional_inner(annotation)
    optional = inner is not annotation
    if inner is bool:
        base = parse_bool
    elif inner in (int, float, str, Path):
        base = inner
    elif typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)

        def base(text: str) -> str:
            if text not in choices:
                raise ValueError(f"expected one of {', '.join(map(str, choices))}")
            return text
    elif typing.get_origin(inner) is tuple and typing.get_args(inner)[0] is int:
        base = parse_int_tuple
    elif typing.get_origin(inner) is tuple and typing.get_args(inner)[0] is str:
        base = parse_str_tuple
    else:
        raise TypeError(f"no parser for option type {annotation}")
    if not optional:
        return base
    return lambda text: None if text in ("", "none") else base(text)


def _type_name(annotation: Any) -> str:
    inner = _optional_inner(annotation)
    if typing.get_origin(inner) is Literal:
        return "|".join(map(str, typing.get_args(inner)))
    if typing.get_origin(inner) is tuple:
        return f"{typing.get_args(inner)[0].__name__}x..."
    return getattr(inner, "__name__", str(inner))


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "x".join(map(str, value)) if all(isinstance(v, int) for v in value) else ",".join(map(str, value))
    return str(value)
