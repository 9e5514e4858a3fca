"""Python's cyclic garbage collector, paused while hlopar builds and reads its big graphs.

Building a `FuncGraph`, analysing a training step and planning it make hundreds of thousands
of small objects (values, ops, strategies, ILP nodes, cost tuples) and free almost none of
them through cycles: reference counting frees what is dropped. The cyclic collector would
rescan the growing heap again and again for nothing: on GPT-39B's stage construction
(8 x 8), 24 full collections took 6.4 s of 63 s, and pausing it changed the peak memory by
less than 1% (docs/performance.md, "The garbage collector paused while passes run").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Runs the block with the cyclic collector off; turns it back on after, if it was on
    (nested pauses leave it off until the outermost ends)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
