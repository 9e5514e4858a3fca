"""Where the shared corpus of programs (written by others) is: one setting for tests and tools.

`HLOPAR_CORPUS` names the folder; without it, `../shared/corpus` beside the repository. A
fresh clone has none: tests that read it carry the `corpus` marker and are skipped there
(`test/conftest.py`), tools say where they looked.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CORPUS_VARIABLE", "corpus_dir", "missing_reason"]

CORPUS_VARIABLE = "HLOPAR_CORPUS"
REPO_ROOT = Path(__file__).resolve().parent.parent


def corpus_dir() -> Path:
    """The corpus folder named by `HLOPAR_CORPUS`, or `../shared/corpus` beside the repository."""
    value = os.environ.get(CORPUS_VARIABLE)
    return Path(value).expanduser().resolve() if value else (REPO_ROOT.parent / "shared" / "corpus").resolve()


def missing_reason() -> str | None:
    """Why the corpus cannot be read (a skip reason), or None when it is there."""
    path = corpus_dir()
    return None if path.is_dir() else f"corpus not found at {path} (set {CORPUS_VARIABLE})"
