"""The processes hlopar forks end with the process that forked them.

A forked child (the command lines' isolated worker, `cli.guard.run_isolated`) or a spawned
worker (stage construction's layer-ILP pool, `analysis.stages.ilp_pool`) calls `die_with_parent()` first:
on Linux the kernel then sends it SIGKILL when its parent dies, however the parent died
(SIGTERM from `timeout`, SIGINT, SIGKILL, a crash), so that no child keeps planning, and
holding memory, with no one to read its result. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Makes this (forked) process receive SIGKILL when `parent`, the pid that forked it, dies.
    Call it in the child right after the fork; if the parent is already gone, exits at once."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl: nothing will signal us
        os._exit(1)
