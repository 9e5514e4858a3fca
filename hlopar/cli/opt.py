"""`hlopar-opt`: mlir-opt for hlopar. Reads a module, runs a pipeline, prints the result.

The parent process only parses arguments and forks: the work happens in a child
(`cli.guard.run_isolated`), so that a crash inside jaxlib's C++ (its verifier dies with
SIGFPE on some invalid programs) becomes an error message and exit status 1 rather than a
dead process. `-o FILE` is written only when everything succeeded (`ir.output`: a regular
file is replaced by a rename, a device or a pipe written into).
"""

from __future__ import annotations

import argparse
import sys

from hlopar.cli.arguments import ArgumentParser
from hlopar.cli.guard import run_isolated
from hlopar.ir.output import output_problem, write_output


class _OptArgumentParser(ArgumentParser):
    def format_help(self) -> str:
        # The pass list needs jaxlib; build it only when help is asked for.
        from hlopar.passes.registry import passes_help

        self.epilog = passes_help()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _OptArgumentParser(
        prog="hlopar-opt",
        description="Parse StableHLO/sdy/mpmd modules, run hlopar and MLIR passes, print the result.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", nargs="?", default="-", help="input .mlir/.mlirbc file, or - for stdin (default)")
    parser.add_argument("-o", dest="output", default="-", help="output file (default: stdout)")
    parser.add_argument(
        "--pass-pipeline",
        "-p",
        default="",
        metavar="PIPELINE",
        help="pipeline in MLIR syntax, e.g. 'builtin.module(hlopar-import,canonicalize)'",
    )
    parser.add_argument(
        "--split-input-file",
        nargs="?",
        const="// -----",
        default=None,
        metavar="MARKER",
        help="split the input at '// -----' lines and process each part on its own",
    )
    parser.add_argument(
        "--verify-diagnostics",
        action="store_true",
        help="check diagnostics against expected-error/warning/note/remark comments",
    )
    parser.add_argument(
        "--mlir-print-ir-after-all", action="store_true", help="print the IR to stderr after every step"
    )
    parser.add_argument(
        "--mlir-timing", action="store_true", help="print the wall time of parsing, each step and printing"
    )
    parser.add_argument("--mlir-print-debuginfo", action="store_true", help="print locations")
    parser.add_argument("--mlir-print-op-generic", action="store_true", help="print ops in generic form")
    parser.add_argument("--emit-bytecode", action="store_true", help="write MLIR bytecode instead of text")
    parser.add_argument(
        "--no-verify-each", dest="verify_each", action="store_false", help="skip the verifier after each hlopar pass"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = output_problem(args.output)
    if problem:
        sys.stderr.write(f"{args.output}: error: {problem}\n")
        return 1
    return run_isolated(lambda: _run(args), args.input)


def _run(args: argparse.Namespace) -> int:
    from hlopar.cli.opt_driver import OptDriver

    driver = OptDriver(
        pipeline=args.pass_pipeline,
        split_marker=args.split_input_file,
        verify_diagnostics=args.verify_diagnostics,
        print_ir_after_all=args.mlir_print_ir_after_all,
        timing=args.mlir_timing,
        debug_info=args.mlir_print_debuginfo,
        generic=args.mlir_print_op_generic,
        bytecode=args.emit_bytecode,
        verify_each=args.verify_each,
    )
    result = driver.process_file(args.input)
    for diagnostic in result.diagnostics:
        sys.stderr.write(diagnostic.format(args.input) + "\n")
    if result.timing_report:
        sys.stderr.write(result.timing_report)
    if not result.ok:
        return 1
    try:
        write_output(args.output, result.output)
    except BrokenPipeError:
        raise
    except OSError as error:
        sys.stderr.write(f"{args.output}: error: cannot write output: {error.strerror}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
