"""`parallelize`'s plan cache: bundles on disk, keyed by what made them.

Under `$HLOPAR_CACHE_DIR` (default `~/.cache/hlopar`), `plans/<key>/` holds a bundle
(`codegen.bundle`, docs/codegen.md) and `options.json`; the key is a hash of the program
text, the cluster, the options, jax's version and `CACHE_VERSION`. A bundle is written
beside its place and renamed there, so a reader never sees half of one. `executables/`
holds the plans' compiled executables (`codegen.executable_cache`), keyed by what they
compile, so that a plan read from the cache compiles nothing either. Both are kept under
`$HLOPAR_CACHE_MAX_BYTES` (4 GiB by default), least recently used first out
(`codegen.cache_size`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax

from hlopar.codegen.bundle import write_bundle
from hlopar.codegen.cache_size import prune
from hlopar.codegen.pipeline_program import PipelineProgram

__all__ = ["CACHE_VERSION", "cache_root", "cached_bundle", "executables_dir", "is_cached", "write_cached"]

CACHE_VERSION = "hlopar-plan-v17"  # bumped when the planner's output changes


def cache_root() -> Path:
    return Path(os.environ.get("HLOPAR_CACHE_DIR") or Path.home() / ".cache" / "hlopar")


def executables_dir() -> Path:
    """Where `parallelize` keeps compiled executables (`codegen.executable_cache`)."""
    return cache_root() / "executables"


def cached_bundle(text: str, cluster: dict, options: dict) -> Path:
    """Where the bundle of this program, cluster (`Cluster.key()`) and options is cached."""
    key = hashlib.sha256(
        json.dumps(
            {"version": CACHE_VERSION, "jax": jax.__version__, "text": text, "cluster": cluster, "options": options},
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]
    return cache_root() / "plans" / key


def is_cached(bundle: Path) -> bool:
    return (bundle / "pipeline.json").is_file() and (bundle / "program.mlir").is_file()


def write_cached(
    bundle: Path,
    program: PipelineProgram,
    module_text: str,
    plan: dict,
    schedule,
    options: dict,
    cluster: dict,
    executables=None,
) -> None:
    """Writes the bundle beside its place and renames it there (readers never see half of
    one); `executables`: `write_bundle`'s."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hlopar-plan-", dir=bundle.parent))
    try:
        write_bundle(staging, program, module_text, plan, schedule, executables=executables)
        (staging / "options.json").write_text(json.dumps({"options": options, "cluster": cluster}, indent=1))
        try:
            os.rename(staging, bundle)
        except OSError:  # another process cached the same plan first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    prune((bundle.parent, executables_dir()), keep=(bundle,))
