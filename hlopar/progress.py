"""What the first call of a parallelized function is doing, on stderr.

Its phases (lowering, planning, starting workers, compiling) take seconds to minutes, so the
user sees which one runs: on a terminal one line redrawn in place (a bar, the phase, the
time so far), elsewhere (logs, CI) one plain line per phase. Messages (the plan, timings)
print as lines above the bar.
"""

from __future__ import annotations

import sys
import time

__all__ = ["PHASES", "Progress"]

PHASES = ("lowering", "planning", "starting workers", "compiling")


class Progress:
    """`phase(name)` when a phase starts, `message(text)` for a line, `done()` at the end.
    Disabled, it prints nothing."""

    def __init__(self, enabled: bool = True, stream=None, width: int = 20):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.width = width
        self.start = time.monotonic()  # of the first phase since the last `done`
        self.current: str | None = None

    def _bar(self) -> str:
        k = PHASES.index(self.current) if self.current in PHASES else 0
        filled = self.width * k // len(PHASES)
        return (
            f"hlopar: [{'#' * filled}{'.' * (self.width - filled)}] {k + 1}/{len(PHASES)} {self.current} "
            f"({time.monotonic() - self.start:.1f} s)"
        )

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def phase(self, name: str) -> None:
        if self.current is None:
            self.start = time.monotonic()
        self.current = name
        if self.tty:
            self._write("\r\x1b[K" + self._bar())
        elif self.enabled:
            self._write(f"hlopar: {name}...\n")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        lines = "".join(f"hlopar: {line}\n" for line in text.splitlines())
        self._write("\r\x1b[K" + lines + self._bar() if self.tty and self.current else lines)

    def done(self) -> None:
        if self.tty and self.current:
            self._write("\r\x1b[K")
        self.current = None
