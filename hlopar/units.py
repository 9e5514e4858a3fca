"""How hlopar prints and parses quantities: one way everywhere (reports, schedules, errors, options)."""

from __future__ import annotations

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def format_bytes(nbytes: float) -> str:
    """`512 B`, `4.0 KiB`, `1.5 MiB`, ...: binary units, as devices' memories are sized."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.1f} {unit}"


def parse_bytes(text: str) -> float:
    """`16GiB`, `500MB`, `1e9` → bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit '{unit}' (use B, KB, MB, GB, KiB, MiB, GiB)")
    return float(number) * _UNITS[unit]
