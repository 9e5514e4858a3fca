"""Hashes computed once for the frozen values that key the planner's caches.

A dataclass's generated `__hash__` rebuilds and hashes the tuple of its fields on every call;
the cost model keys its caches on meshes, layouts, rules and tensor shapes millions of times
per plan of a large model. A class sets `__hash__ = cached_hash` and `__getstate__ =
state_without_hash` in its body: the hash is kept in the instance (one per process: a
string's hash differs between processes, so a pickle leaves it out and the receiver computes
its own).
"""

from __future__ import annotations

__all__ = ["cached_hash", "state_without_hash"]

_KEY = "_cached_hash"


def cached_hash(self) -> int:
    """The hash of the instance's dataclass fields, computed once."""
    state = self.__dict__
    found = state.get(_KEY)
    if found is None:
        found = hash(tuple([state[name] for name in type(self).__dataclass_fields__]))
        state[_KEY] = found
    return found


def state_without_hash(self) -> dict:
    state = self.__dict__
    if _KEY not in state:
        return state
    return {k: v for k, v in state.items() if k != _KEY}
