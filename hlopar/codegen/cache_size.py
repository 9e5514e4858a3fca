"""hlopar's cache on disk kept under a size: the least recently used entries go first.

`parallelize` caches plans (`plans/<key>/`, `codegen.plan_cache`) and compiled executables
(`executables/<key>`, `codegen.executable_cache`) under `$HLOPAR_CACHE_DIR`. Every new
program, cluster, option or jax version adds entries, and nothing else removes them; a
machine that trains for months would fill its disk. So, after each write, the entries of
both folders are summed and, above `$HLOPAR_CACHE_MAX_BYTES` (a size such as `4GiB`, the
default; `0` or `unlimited`: no limit), the least recently used are removed until the rest
fits, as ccache and jax's own compilation cache (`jax_compilation_cache_max_size`) bound
theirs. An entry's time is its modification time, which a read renews (`touch`). What was
just written is kept even if it alone is over the limit, and so is anything used in the
last minute (another process may be reading it). Leftovers of writes that died half way
(hidden staging entries) older than a day are removed with the rest. Removal is best
effort: an entry another process holds open or removes first is skipped.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from hlopar.units import parse_bytes

__all__ = ["DEFAULT_MAX_BYTES", "max_cache_bytes", "prune", "touch"]

DEFAULT_MAX_BYTES = 4 * 2**30
RECENT_S = 60.0  # entries used this recently stay whatever the size
STALE_STAGING_S = 86400.0  # a hidden staging entry older than this belongs to a dead write


def max_cache_bytes() -> int | None:
    """`$HLOPAR_CACHE_MAX_BYTES` (module docstring); None: unlimited."""
    text = os.environ.get("HLOPAR_CACHE_MAX_BYTES", "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    if text.lower() in ("0", "unlimited", "none"):
        return None
    try:
        return int(parse_bytes(text))
    except ValueError as error:
        raise ValueError(f"HLOPAR_CACHE_MAX_BYTES: invalid size {text!r}: {error}") from None


def touch(path: Path) -> None:
    """Marks a cache entry as used now (best effort: a read-only cache keeps its times)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(folders: Iterable[Path], keep: Iterable[Path] = (), limit: int | None = None) -> list[Path]:
    """Removes the least recently used entries of `folders` until they fit in `limit` bytes
    (default `max_cache_bytes()`), never those in `keep` nor any used in the last minute;
    stale staging leftovers go regardless. Returns what was removed."""
    limit = max_cache_bytes() if limit is None else limit
    now = time.time()
    kept = {Path(p).resolve() for p in keep}
    entries, removed = [], []
    for folder in folders:
        try:
            children = list(Path(folder).iterdir())
        except OSError:
            continue
        for path in children:
            stamp = _modified(path)
            if stamp is None:
                continue
            if path.name.startswith("."):
                if now - stamp > STALE_STAGING_S and _remove(path):
                    removed.append(path)
                continue
            entries.append((stamp, _size(path), path))
    if limit is None:
        return removed
    total = sum(size for _, size, _ in entries)
    for stamp, size, path in sorted(entries, key=lambda entry: entry[0]):
        if total <= limit:
            break
        if path.resolve() in kept or now - stamp < RECENT_S:
            continue
        if _remove(path):
            removed.append(path)
            total -= size
    return removed


def _modified(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _size(path: Path) -> int:
    if not path.is_dir():
        try:
            return path.stat().st_size
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _remove(path: Path) -> bool:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        return True
    except OSError:
        return False
