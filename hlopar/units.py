"""How hlopar prints quantities: one way everywhere (reports, schedules, errors)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(nbytes: float) -> str:
    """`512 B`, `4.0 KiB`, `1.5 MiB`, ...: binary units, as devices' memories are sized."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.1f} {unit}"
