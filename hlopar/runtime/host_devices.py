"""Local CPU devices for JAX: how many, and enough threads for their collectives.

XLA's CPU client runs the programs of all its devices on one pool of max(cores, devices)
threads (`NPROC`, when set, stands for the core count; measured with jaxlib 0.10). A device
runs independent thunks at once, and a collective holds its thread until every peer has
arrived. With exactly as many threads as devices, one device holding two threads in two
independent collectives leaves some other device without a thread to reach either, and the
process aborts on a rendezvous timeout: AlphaFold planned on a 4x2 mesh did so on a 2-core
machine in 3 of 4 runs (docs/performance.md). Twice as many threads as devices leaves room
for that; idle threads cost nothing, and XLA sizes its parallel loops by the cores, not the
pool.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def host_device_environment(devices: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that give a JAX process `devices` CPU devices and a thread pool that
    cannot starve them, leaving what `environ` (default: this process's) already sets."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    updates = {}
    if DEVICE_COUNT_FLAG not in flags:
        updates["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={devices}".strip()
    if "NPROC" not in environ:
        updates["NPROC"] = str(max(os.cpu_count() or 1, 2 * devices))
    return updates


def use_host_devices(devices: int) -> None:
    """Sets them in this process; call before JAX creates its CPU client."""
    os.environ.update(host_device_environment(devices))
