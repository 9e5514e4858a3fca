""" "Did you mean" for a misspelled name (a pass, a pass option, a command-line option):
the closest known names by `difflib`'s similarity ratio, as a clause to append to an error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(name: str, known: Iterable[str], prefix: str = "", cutoff: float = 0.6) -> str:
    """'; did you mean 'x'?' (or 'x' or 'y') for the names of `known` close to `name`, else ''.
    Names are compared without `prefix` (e.g. the '--' every option has) and shown with it."""
    bare = [k[len(prefix) :] for k in known if k.startswith(prefix)]
    close = difflib.get_close_matches(
        name[len(prefix) :] if name.startswith(prefix) else name, bare, n=2, cutoff=cutoff
    )
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"'{prefix}{c}'" for c in close) + "?"
