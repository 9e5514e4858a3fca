"""Writing an output file, as every hlopar tool does (`hlopar-opt -o`, pass reports `report=PATH`).

A regular file, or a path where nothing is yet, is written whole or not at all: into a
temporary file beside it, renamed over it when complete (a reader never sees half of it, and
a failure leaves the earlier file as it was). Anything else, a character device such as
`/dev/null` or `/dev/stdout`, a FIFO, a socket, is written into, as `mlir-opt` does: a rename
would replace the node by a regular file. A symbolic link is followed: its target is the
output, and the link stays.

Needs no jaxlib, so that a command line can check its output before the work starts.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile

__all__ = ["output_problem", "write_output"]


def write_output(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes `data` (str as UTF-8) to `path`; `-` is standard output. Raises `OSError`."""
    payload = data.encode() if isinstance(data, str) else data
    name = os.fspath(path)
    if name == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
        return
    if _is_special(name):
        with open(name, "wb") as out:
            out.write(payload)
        return
    target = os.path.realpath(name)
    handle, staging = tempfile.mkstemp(
        prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target)
    )
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(payload)
        os.chmod(staging, _mode_for(target))
        os.replace(staging, target)
    except BaseException:
        try:
            os.unlink(staging)
        except OSError:
            pass
        raise


def output_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be written as an output, or None: checked before any work is done."""
    name = os.fspath(path)
    if name == "-":
        return None
    if _is_special(name):
        return None if os.access(name, os.W_OK) else "cannot write output: permission denied"
    target = os.path.realpath(name)
    if os.path.isdir(target):
        return "cannot write output: is a directory"
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        return f"cannot write output: the directory '{directory}' does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cannot write output: the directory '{directory}' is not writable"
    return None


def _is_special(path: str) -> bool:
    """An existing node that is neither a regular file nor a directory (device, FIFO, socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _mode_for(path: str) -> int:
    """The permissions the output gets: the earlier file's, or a new file's under the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """This process's umask, read without setting it (`os.umask` sets it for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
