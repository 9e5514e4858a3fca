#!/usr/bin/env python3
"""Times the roles analysis of a training step (which results are new state, the loss, the
batch, each op's role), on the zoo's GPT-1.3B by default.

    python tools/bench_roles.py [--model gpt --config 1.3B] [--repeat 3]

The step is exported from the zoo and imported (`hlopar-import`, as every planning pass
sees it); then `step_io.state_pairs`, `training_roles.classify` and `step_io.batch_arguments` are timed on
its graph view (best of --repeat). They run in every planning pass that needs roles, so
they must stay small next to planning itself (seconds on this model).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--config", default="1.3B")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from hlopar.analysis.step_io import batch_arguments, state_pairs
    from hlopar.analysis.training_roles import classify
    from hlopar.ir.graph import FuncGraph
    from hlopar.ir.module import parse_module
    from hlopar.models import get_train_step
    from hlopar.passes.base import PassContext
    from hlopar.passes.import_program import ImportPass

    module = parse_module(get_train_step(args.model, args.config).lower())
    ImportPass().run(module, PassContext())
    graph = FuncGraph.from_module(module)
    print(
        f"model: {args.model} {args.config}: {len(graph.ops)} top-level ops, {len(graph.args)} arguments, "
        f"{len(graph.results)} results"
    )
    for name, call in (
        ("state_pairs", lambda: state_pairs(graph)),
        ("classify", lambda: classify(graph)),
        ("batch_arguments", lambda: batch_arguments(graph)),
    ):
        times = []
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            found = call()
            times.append(time.perf_counter() - start)
        what = (
            f"{len(found)} pairs"
            if name == "state_pairs"
            else f"loss = result {found.loss_result}"
            if name == "classify"
            else f"batch = arguments {list(found)}"
        )
        print(f"{name:<16} {min(times):.3f} s (best of {len(times)}): {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
