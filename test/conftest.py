"""Every test (test/unit, test/integration) sees 8 CPU devices, as the plans under test need
several devices, and a thread pool their collectives cannot starve (`hlopar.runtime.host_devices`).
The helpers tests share are in test/support, on `sys.path` through pyproject's pytest `pythonpath`.

Tests that read the shared corpus carry the `corpus` marker and find it through
`hlopar.corpus.corpus_dir()` (`HLOPAR_CORPUS`, default `../shared/corpus`); where it is
absent they are skipped with the reason "corpus not found at <path> (set HLOPAR_CORPUS)".

The plan and executable caches (`HLOPAR_CACHE_DIR`) are the session's own, in a temporary
folder removed at its end, unless the caller set one: no test reads what an earlier run left
in `~/.cache/hlopar` or leaves anything there.

`ray_cluster` (module scope): a local Ray of hlopar's own, started as `parallelize` starts it
(`runtime.local_ray`: no fork of the test process, never another cluster on the machine), and a
plan cache of the module's own. The cluster is the session's: started by the first module that
asks for it (a start costs about 10 s on CI's 2 cores, once instead of once per module) and
started again only where a module left it dead or disconnected (the dead-raylet test kills it;
a module may connect elsewhere). At each module's end a garbage collection lets go of the
workers of the functions that module left unclosed.

Strict skips (`HLOPAR_STRICT_SKIPS=1`, set by `.ci/run` for the run that has the corpus): a
test skipped for any reason but one that a CI machine may truly lack fails instead, so that
nothing is skipped silently. The reasons allowed (`ALLOWED_SKIPS`, matched in the reason,
case-insensitive): a GPU, CUDA, NCCL, ROCm or TPU; several hosts. The corpus is not among
them. Expected failures (`xfail`) are not skips and are left alone.
"""

import atexit
import os
import re
import shutil
import tempfile

import pytest

from hlopar.corpus import missing_reason
from hlopar.runtime.host_devices import use_host_devices

use_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "HLOPAR_CACHE_DIR" not in os.environ:
    os.environ["HLOPAR_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="hlopar-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

ALLOWED_SKIPS = re.compile(r"\b(gpus?|cuda|nccl|rocm|tpus?|several hosts)\b", re.IGNORECASE)


@pytest.fixture(scope="session")
def _session_ray():
    """The session's local Ray (`ray_cluster`), stopped at the session's end."""
    held = {}
    yield held
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if held.get("local") is not None:
        held["local"].stop()


@pytest.fixture(scope="module")
def ray_cluster(_session_ray, tmp_path_factory):
    import gc

    import ray

    from hlopar.runtime import local_ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HLOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("hlopar-cache")))
        local = _session_ray.get("local")
        if local is None or local.lost is not None or not ray.is_initialized() or local_ray.current() is not local:
            if ray.is_initialized():
                ray.shutdown()
            local_ray.disconnected()
            if local is not None:
                local.stop()
            local = _session_ray["local"] = local_ray.connect(None, 4)
        try:
            yield local
        finally:
            gc.collect()


def pytest_collection_modifyitems(config, items):
    reason = missing_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("corpus") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("HLOPAR_STRICT_SKIPS") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not ALLOWED_SKIPS.search(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under HLOPAR_STRICT_SKIPS=1 for a reason CI must not have: {reason}"
