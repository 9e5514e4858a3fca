#!/usr/bin/env python3
"""Write a model zoo training step as StableHLO: a thin command-line front of `hlopar.models`.

    python tools/export_model.py --list
    python tools/export_model.py gpt 1.3B -o gpt-1.3b.mlir
    python tools/export_model.py moe tiny -o -                  # text to stdout
    python tools/export_model.py wide_resnet 1B --bytecode -o wrn-1b.mlirbc
    python tools/export_model.py gpt tiny --debug-info -o -     # with op locations

The module is ``jax.jit(step).lower(*abstract_args())`` with abstract shapes only, so even the
largest configurations lower in seconds without allocating their parameters. An unknown model
or configuration exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="export_model.py",
        description="Lower a model zoo training step to StableHLO (.mlir text or .mlirbc).",
    )
    p.add_argument("model", nargs="?", help="model family, e.g. gpt (see --list)")
    p.add_argument("config", nargs="?", help="configuration name, e.g. 1.3B (see --list)")
    p.add_argument("-o", "--output", default="-", help="output file, '-' for stdout (default)")
    p.add_argument("--list", action="store_true", help="print models and their configurations")
    p.add_argument("--bytecode", action="store_true", help="write MLIR bytecode instead of text")
    p.add_argument("--debug-info", action="store_true", help="keep op locations (layer scopes)")
    return p


def _list(out) -> None:
    from hlopar.models import MODELS

    for name, family in MODELS.items():
        print(f"{name}: {' '.join(family.configs)}", file=out)


def _write_bytecode(text: str, path: str) -> None:
    from jaxlib.mlir import ir

    from hlopar.ir.context import make_context

    with make_context():
        module = ir.Module.parse(text)
        with open(path, "wb") as f:
            module.operation.write_bytecode(f)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        _list(sys.stdout)
        return 0
    if not args.model or not args.config:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: a model and a configuration are required (or --list)", file=sys.stderr)
        return 2
    if args.bytecode and args.output == "-":
        print(f"{parser.prog}: error: --bytecode needs an output file (-o FILE)", file=sys.stderr)
        return 2

    from hlopar.models import UnknownModelError, count_ops, get_train_step

    try:
        train_step = get_train_step(args.model, args.config)
    except UnknownModelError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    text = train_step.lower(debug_info=args.debug_info)
    seconds = time.perf_counter() - start

    try:
        if args.bytecode:
            _write_bytecode(text, args.output)
        elif args.output == "-":
            sys.stdout.write(text)
        else:
            with open(args.output, "w") as f:
                f.write(text)
    except OSError as e:
        print(f"{parser.prog}: error: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 1

    if args.output != "-":
        print(
            f"{train_step.name}: {train_step.param_count():,} parameters, "
            f"{count_ops(text):,} ops, lowered in {seconds:.2f} s -> {args.output}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
