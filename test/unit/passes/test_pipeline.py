"""The pass manager: option parsing, pipeline strings, mixing with upstream passes, diagnostics."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import pytest

from hlopar.ir.context import make_context
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import ModulePass, OptionError, PassContext, option
from hlopar.passes.pipeline import Instrumentation, Pipeline, PipelineError, parse_elements


@dataclass
class ExamplePass(ModulePass):
    name = "example"
    summary = "a pass to test option parsing"

    mesh_shape: tuple[int, ...] = option((1,), "mesh shape")
    axis_names: tuple[str, ...] = option(("x",), "axis names")
    time_limit: float = option(10.0, "seconds")
    schedule: Literal["gpipe", "1f1b"] = option("1f1b", "schedule")
    report: str | None = option(None, "report path")
    verbose: bool = option(False, "print more")
    count: int = option(2, "a count of at least 2", check=lambda n: _at_least_two(n))
    low: int = option(0, "bounds that must be ordered")
    high: int = option(9, "bounds that must be ordered")

    def check_options(self) -> None:
        if self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")


def _at_least_two(n: int) -> None:
    if n < 2:
        raise ValueError(f"at least 2, got {n}")


def test_options_parse_by_type():
    parsed = ExamplePass.from_options(
        "mesh-shape=2x4 axis-names=x,y time-limit=2.5 schedule=gpipe report='a b.json' verbose"
    )
    assert parsed == ExamplePass((2, 4), ("x", "y"), 2.5, "gpipe", "a b.json", True)
    assert (
        parsed.pipeline_text()
        == "example{mesh-shape=2x4 axis-names=x,y time-limit=2.5 schedule=gpipe report=a b.json verbose=true}"
    )
    assert ExamplePass.from_options("") == ExamplePass()


@pytest.mark.parametrize(
    "text, message",
    [
        ("nope=1", "has no option 'nope'"),
        ("schedule=eager", "expected one of gpipe, 1f1b"),
        ("mesh-shape=2xq", "invalid value '2xq'"),
        ("time-limit", "needs a value"),
        ("verbose=maybe", "expected true or false"),
        ("mesh-shape=2x", "invalid value '2x': expected integers joined by x or commas"),
        ("mesh-shape=2,,4", "expected integers joined by x or commas"),
        ("mesh-shape=-2x4", "invalid value '-2x4': expected an integer >= 0, got -2"),
        ("mesh-shape=100000000000000000000", "is more than 2,147,483,647, the most hlopar takes for a count"),
        ("time-limit=-5", "invalid value '-5': expected a number >= 0, got -5"),
        ("time-limit=inf", "expected a finite number, got inf"),
        ("count=0", "option 'count' of pass 'example': invalid value '0': at least 2, got 0"),
        ("low=3 high=2", "pass 'example': low 3 is above high 2"),
    ],
)
def test_bad_options_are_explained(text, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        ExamplePass.from_options(text)


def test_bounds_hold_when_a_pass_is_built_in_code():
    """The option's check and the pass's `check_options` run in the constructor too."""
    with pytest.raises(OptionError, match=re.escape("option 'count' of pass 'example': invalid value '1': at least 2")):
        ExamplePass(count=1)
    with pytest.raises(OptionError, match="low 5 is above high 4"):
        ExamplePass(low=5, high=4)
    assert ExamplePass(report=None).report is None  # None is never checked


def test_pipeline_elements_nest_and_keep_their_text():
    (anchor,) = parse_elements(
        "builtin.module(hlopar-import{inline=false}, canonicalize,func.func(cse,canonicalize{max-iterations=2}))"
    )
    assert anchor.name == "builtin.module"
    assert [e.text for e in anchor.nested] == [
        "hlopar-import{inline=false}",
        "canonicalize",
        "func.func(cse,canonicalize{max-iterations=2})",
    ]
    assert anchor.nested[2].nested[1].options == "max-iterations=2"


@pytest.mark.parametrize(
    "text, message",
    [
        ("builtin.module(canonicalize", "expected ')'"),
        ("builtin.module(frobnicate)", "unknown pass or pipeline 'frobnicate'"),
        ("builtin.module(func.func(hlopar-import))", "runs on the whole module"),
        ("builtin.module(hlopar-import(cse))", "takes no nested pipeline"),
        ("builtin.module(hlopar-import{x=1})", "has no option 'x'"),
        ("builtin.module(cse,,cse)", "expected a pass name"),
    ],
)
def test_bad_pipelines_are_explained(text, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        Pipeline.parse(text, make_context())


def test_mixed_pipeline_runs_with_ir_printing_and_timing():
    import io

    module = parse_module(
        "func.func private @g(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
        "  %0 = stablehlo.add %a, %a : tensor<2xf32>\n  return %0 : tensor<2xf32>\n}\n"
        "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
        "  %0 = call @g(%a) : (tensor<2xf32>) -> tensor<2xf32>\n"
        "  %1 = call @g(%a) : (tensor<2xf32>) -> tensor<2xf32>\n"
        "  %2 = stablehlo.multiply %0, %1 : tensor<2xf32>\n  return %2 : tensor<2xf32>\n}\n"
    )
    printed, timings = io.StringIO(), []
    pipeline = Pipeline.parse(
        "builtin.module(hlopar-import{canonicalize=false},func.func(cse),symbol-dce)", module.context
    )
    pipeline.run(module, PassContext(), Instrumentation(print_ir_after_all=printed, timings=timings))
    text = print_module(module)
    assert text.count("stablehlo.add") == 1  # inlined twice, then CSE'd into one
    assert "@g" not in text
    assert [name for name, _ in timings] == ["hlopar-import{canonicalize=false}", "func.func(cse)", "symbol-dce"]
    assert printed.getvalue().count("// -----// IR Dump After") == 3


@dataclass
class FailingPass(ModulePass):
    name = "failing"
    summary = "fails at the first multiply"

    def run(self, module, context):
        for op in module.regions[0].blocks[0].operations[0].regions[0].blocks[0].operations:
            if op.operation.name == "stablehlo.multiply":
                self.fail(op, "cannot handle multiply")


def test_pass_failures_are_located_at_the_op():
    module = parse_module(
        "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
        "  %0 = stablehlo.multiply %a, %a : tensor<2xf32>\n  return %0 : tensor<2xf32>\n}\n",
        source_name="in.mlir",
    )
    with pytest.raises(DiagnosticError) as error:
        FailingPass().run(module, PassContext())
    assert error.value.diagnostics[0].format() == "in.mlir:2:8: error: failing: cannot handle multiply"


@dataclass
class CollectorPass(ModulePass):
    """Records whether Python's cyclic collector ran beside it; fails when asked to."""

    name = "collector"
    summary = "records gc.isenabled()"
    fail_now: bool = option(False, "raise after recording")

    seen = []

    def run(self, module, context):
        import gc

        CollectorPass.seen.append(gc.isenabled())
        if self.fail_now:
            self.fail(module, "asked to fail")


@pytest.mark.parametrize("fail_now", [False, True])
def test_passes_run_with_the_cyclic_collector_paused_and_leave_it_as_they_found_it(fail_now):
    """Planning makes hundreds of thousands of small objects freed by reference counting; a
    full collection rescans them all (docs/performance.md: 6.4 s of 63 s on GPT-39B 8 x 8).
    Every hlopar pass runs with the collector paused, from a pipeline and from a context's
    `timed`, and the collector is back on after it, whether the pass ends or fails."""
    import gc

    from hlopar.passes.pipeline import Step

    module = parse_module("func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n  return %a : tensor<2xf32>\n}\n")
    assert gc.isenabled()
    CollectorPass.seen.clear()
    runs = (
        lambda: Pipeline([Step("collector", hlopar_pass=CollectorPass(fail_now))]).run(module, PassContext()),
        lambda: PassContext().timed(CollectorPass(fail_now), module),
    )
    for run in runs:
        if fail_now:
            with pytest.raises(DiagnosticError):
                run()
        else:
            run()
        assert gc.isenabled()
    assert CollectorPass.seen == [False, False]
