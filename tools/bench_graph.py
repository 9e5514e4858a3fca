"""Time parsing a module and building the graph view of its functions.

    python tools/bench_graph.py FILE [--func NAME] [--repeat N]

Prints the parse time, the view build time (best of --repeat runs) and the number of ops,
top-level and in total (nested ops included). Without --func every function of the
module is built; with it, only that one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxlib.mlir import ir

from hlopar.ir.context import make_context
from hlopar.ir.graph import FuncGraph, module_graphs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="MLIR text (.mlir) or bytecode (.mlirbc)")
    parser.add_argument("--func", default=None, help="build only this function (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="builds to time; the best is shown")
    args = parser.parse_args(argv)

    data = args.file.read_bytes()
    context = make_context(allow_unregistered=True)
    with context:
        start = time.perf_counter()
        module = ir.Module.parse(data if data.startswith(b"ML\xefR") else data.decode())
        parse_s = time.perf_counter() - start

        build_times = []
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            if args.func is None:
                graphs = list(module_graphs(module).values())
            else:
                graphs = [FuncGraph.from_module(module, args.func)]
            build_times.append(time.perf_counter() - start)

    top = sum(len(g.ops) for g in graphs)
    total = sum(g.num_ops for g in graphs)
    values = sum(len(g.values) for g in graphs)
    what = f"@{args.func}" if args.func else f"{len(graphs)} funcs"
    print(f"file:        {args.file}")
    print(f"parse:       {parse_s:.3f} s")
    print(f"build:       {min(build_times):.3f} s ({what}; best of {len(build_times)}, first {build_times[0]:.3f} s)")
    print(f"ops:         {top} top-level, {total} total")
    print(f"values:      {values}")
    if total:
        print(f"per op:      {min(build_times) / total * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
