"""What the first call of a parallelized function is doing, on stderr.

Its phases (lowering, planning, starting workers, compiling) take seconds to minutes, so the
user sees which one runs: on a terminal one line redrawn in place (a bar, the phase, the
time so far), elsewhere (logs, CI) one plain line per phase. Messages (the plan, timings)
print as lines above the bar.
"""

from __future__ import annotations

import sys
import time

__all__ = ["PHASES", "Breakdown", "Progress"]

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


class Breakdown:
    """Where the seconds of a first call went: its phases in order, each with its parts
    (`add`); `line()` says it in one line, as `parallelize(verbose=True)` prints it at the
    end of a first call (`ParallelizedFunction.first_call`)."""

    def __init__(self):
        self.phases: list[tuple[str, float, dict[str, float]]] = []
        self.compilations: dict[str, dict[str, int]] = {}  # executable -> compiled/loaded/reused, everywhere

    def add(self, name: str, seconds: float, parts: dict[str, float] | None = None) -> None:
        self.phases.append((name, seconds, dict(parts or {})))

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds, _ in self.phases)

    def seconds(self) -> dict[str, float]:
        """Phase -> seconds (a phase seen twice, summed)."""
        out: dict[str, float] = {}
        for name, seconds, _ in self.phases:
            out[name] = out.get(name, 0.0) + seconds
        return out

    def most_compilations(self) -> int:
        """The most times one executable was compiled, over the driver and its workers."""
        return max((c.get("compiled", 0) for c in self.compilations.values()), default=0)

    def line(self) -> str:
        parts = []
        for name, seconds, inner in self.phases:
            detail = ", ".join(f"{k} {v:.1f}" for k, v in inner.items() if v >= 0.05)
            parts.append(f"{name} {seconds:.1f}" + (f" ({detail})" if detail else ""))
        line = f"first call {self.total:.1f} s: " + "; ".join(parts)
        if self.compilations:
            counts = {how: sum(c.get(how, 0) for c in self.compilations.values()) for how in ("compiled", "loaded")}
            line += (
                f"; {len(self.compilations)} executable(s): {counts['compiled']} XLA compilation(s), "
                f"{counts['loaded']} load(s), at most {self.most_compilations()} compilation(s) of one"
            )
        return line
