"""How hlopar's command-line tools fail: one `file:line:col: error:` line per diagnostic and
exit status 1, never a Python traceback, even when jaxlib's C++ crashes.

`run_isolated` runs the work in a forked child (when the platform forks and
`HLOPAR_NO_FORK` is unset): a crash inside jaxlib (its verifier dies with SIGFPE on some
invalid programs) kills the child, and the parent reports it as an error on the input. The
child dies with the parent: SIGTERM or SIGINT to the parent ends the child first (then the
caller cleans up, status 143 or 130), and SIGKILL of the parent kills the child through
`processes.die_with_parent`; no process is left planning.
`run_guarded` turns exceptions into messages: `DiagnosticError`s print their diagnostics,
anything else prints one "internal error" line (`HLOPAR_DEBUG=1` re-raises it instead).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from hlopar.processes import die_with_parent


def run_isolated(work: Callable[[], int], input_name: str) -> int:
    """`work()`'s exit status, run guarded in a forked child where possible."""
    if os.environ.get("HLOPAR_NO_FORK") or not hasattr(os, "fork"):
        return run_guarded(work, input_name)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            die_with_parent(parent)
            status = run_guarded(work, input_name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        _, wait_status = os.waitpid(pid, 0)
    except (KeyboardInterrupt, _Terminated) as stop:  # the child ends first, then the caller's cleanup runs
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return 130 if isinstance(stop, KeyboardInterrupt) else 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    if os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        sys.stderr.write(
            f"{input_name}: error: jaxlib's MLIR crashed ({name}) while processing this input; "
            f"the input is likely invalid in a way its verifier does not check\n"
        )
        return 1
    return os.WEXITSTATUS(wait_status)


class _Terminated(Exception):
    """SIGTERM reached the parent of `run_isolated`'s child."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def run_guarded(work: Callable[[], int], input_name: str) -> int:
    """`work()`'s exit status; errors become messages on stderr and status 1."""
    from hlopar.ir.diagnostics import DiagnosticError

    try:
        return work()
    except DiagnosticError as error:
        for diagnostic in error.diagnostics:
            sys.stderr.write(diagnostic.format(input_name) + "\n")
        return 1
    except BrokenPipeError:
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 - the CLI never shows a traceback
        if os.environ.get("HLOPAR_DEBUG"):
            raise
        sys.stderr.write(
            f"{input_name}: error: internal error in hlopar: {type(error).__name__}: {error} "
            f"(run with HLOPAR_DEBUG=1 HLOPAR_NO_FORK=1 for the traceback)\n"
        )
        return 1
