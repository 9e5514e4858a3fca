"""hlopar's cache on disk stays under `$HLOPAR_CACHE_MAX_BYTES` (`codegen/cache_size.py`):
least recently used entries out first, what was just written or is in use kept, dead
staging leftovers removed; a plan read from the cache counts as used."""

from __future__ import annotations

import os
import time

import jax
import pytest

import hlopar
from hlopar.codegen.cache_size import DEFAULT_MAX_BYTES, max_cache_bytes, prune
from hlopar.models import get_train_step

HOUR = 3600.0


def _entry(path, size: int, age_s: float, folder: bool = False):
    if folder:
        path.mkdir(parents=True)
        (path / "a").write_bytes(b"x" * (size // 2))
        (path / "b").write_bytes(b"x" * (size - size // 2))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_the_least_recently_used_go_first_until_the_rest_fits(tmp_path):
    plans, executables = tmp_path / "plans", tmp_path / "executables"
    oldest = _entry(plans / "p1", 400, 5 * HOUR, folder=True)
    old = _entry(executables / "e1", 300, 4 * HOUR)
    newer = _entry(plans / "p2", 300, 3 * HOUR, folder=True)
    kept = _entry(plans / "p3", 500, 6 * HOUR, folder=True)  # the oldest, but just written
    recent = _entry(executables / "e2", 200, 10)  # in use a few seconds ago
    dead = _entry(plans / ".hlopar-plan-x", 50, 2 * 86400, folder=True)
    live = _entry(executables / ".executable-y", 50, 30)  # another process writing now
    removed = prune((plans, executables), keep=(kept,), limit=1100)
    # 1700 bytes of entries: the two least recent that may go (700) bring them to 1000 <= 1100.
    assert sorted(removed) == sorted([oldest, old, dead])
    assert all(p.exists() for p in (newer, kept, recent, live))
    assert not any(p.exists() for p in (oldest, old, dead))
    assert prune((plans, executables), keep=(), limit=None) == []  # unlimited: stale staging only


def test_nothing_goes_when_everything_is_kept_or_recent(tmp_path):
    kept = _entry(tmp_path / "plans" / "p", 1000, HOUR, folder=True)
    recent = _entry(tmp_path / "executables" / "e", 1000, 1)
    assert prune((tmp_path / "plans", tmp_path / "executables", tmp_path / "missing"), keep=(kept,), limit=10) == []
    assert kept.exists() and recent.exists()


@pytest.mark.parametrize(
    "value, expected", [(None, DEFAULT_MAX_BYTES), ("1MiB", 2**20), ("2048", 2048), ("0", None), ("unlimited", None)]
)
def test_the_limit_is_a_size(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("HLOPAR_CACHE_MAX_BYTES", raising=False)
    else:
        monkeypatch.setenv("HLOPAR_CACHE_MAX_BYTES", value)
    assert max_cache_bytes() == expected


def test_a_bad_limit_says_what_is_wrong(monkeypatch):
    monkeypatch.setenv("HLOPAR_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="HLOPAR_CACHE_MAX_BYTES: invalid size 'lots'"):
        max_cache_bytes()


def test_parallelize_keeps_its_cache_under_the_limit(tmp_path, monkeypatch):
    """Planning writes a plan and its executables, and prunes: an old plan goes, the plan
    read again is touched (the last to go)."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HLOPAR_CACHE_MAX_BYTES", "1")  # everything that may go, goes
    stale = _entry(tmp_path / "plans" / "stale", 100, 5 * HOUR, folder=True)
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
    cluster = hlopar.Cluster.local(1, 8)
    planned = hlopar.parallelize(step.step, cluster=cluster, method="shard", verbose=False).plan(*args)[0]
    assert not stale.exists() and planned.bundle.exists()
    stamp = time.time() - 5 * HOUR
    os.utime(planned.bundle, (stamp, stamp))
    again = hlopar.parallelize(step.step, cluster=cluster, method="shard", verbose=False).plan(*args)[0]
    assert again.cached and time.time() - planned.bundle.stat().st_mtime < 60
