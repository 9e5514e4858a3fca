"""A Ray cluster of hlopar's own on this machine, started quietly and safely.

Plain `ray.init()` does four things a library should not do to its user: it joins the cluster
that `/tmp/ray/ray_current_cluster` names, even a dead or foreign one; it starts its processes
from the caller's process with a Python `preexec_fn`, i.e. it forks the (JAX-threaded) process
and runs Python in the child, which JAX rightly warns "will likely lead to a deadlock"; it
warns about token authentication; and it forwards every worker's output to the driver (gloo's
"[Gloo] Rank 0 is connected" lines among them).

So `start` runs `ray start --head --block` in a child process that `subprocess` starts with no
Python code between fork and exec (no at-fork handler runs: nothing to warn about), in a fresh
temporary directory (its address file, sockets and logs live there, never in /tmp/ray), on a
free port, with token authentication and a token made here (the variables `RAY_AUTH_MODE`,
`RAY_AUTH_TOKEN`; no file in ~/.ray): Ray listens on the machine's address (it replaces
127.0.0.1 by it), but only this process and its children hold the token. No dashboard, no
usage report. The
child ends when this process is gone and takes the cluster with it;
`stop`, registered at exit, ends it and removes the directory. The driver connects with
`log_to_driver` off: the workers' output stays in `<dir>/session_latest/logs/worker-*`;
`HLOPAR_RAY_LOG_TO_DRIVER=1` streams it to this process's terminal instead (docs/runtime.md).

A cluster that dies under this process: `ray start --block` ends the whole cluster (GCS,
raylet, workers) as soon as any of its processes dies, and a driver left connected to a
dead GCS is ended by Ray's C++ code 60 s later (`gcs_rpc_server_reconnect_timeout_s`: "Failed
to connect to GCS within 60 seconds ... The program will terminate"), with no Python
exception and no `atexit`. So `connect` watches the head process (a thread polling it every
0.2 s): when it ends without `stop`, the driver disconnects (`ray.shutdown()`, about 5 s on
this project's machine), which keeps the process alive, and `lost()` says why; the mesh
workers' waits (`ray_runtime.RayRuntime._gather`) look at it every second and raise
`WorkerError`, and the next `connect` starts a new cluster. A cluster given by address is
not watched: its head node's death ends a connected driver the same way, 60 s later, and
nothing in Python can prevent it (docs/runtime.md, "Faults").

Workers run at the driver's priority: Ray starts its workers at niceness 15 (its
`worker_niceness`, so that its own daemons stay responsive), which on a machine with any
other load starves the mesh workers, whose executables are the whole computation, against
every process at niceness 0 (`jax.jit` in the driver among them): the "shard" plan of the
GPT of `tools/bench_runtime.py` ran 1.18x its own executable run in the driver at load 7 to
20. `RAY_worker_niceness` is set to 0 for the head node started here, unless the caller set it.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Launched",
    "LocalRay",
    "connect",
    "connection",
    "current",
    "disconnected",
    "launch",
    "log_to_driver",
    "lost",
    "prestart",
    "start",
]

LOG_TO_DRIVER_VARIABLE = "HLOPAR_RAY_LOG_TO_DRIVER"
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# Runs in the child: a thread ends it (and so the cluster) when its parent, this process,
# is gone (os.getppid changes), whichever of the parent's threads started it; then Ray's own
# command line runs.
_HEAD = (
    "import os, signal, sys, threading, time\n"
    "parent = int(sys.argv[1])\n"
    "def watch():\n"
    "    while os.getppid() == parent:\n"
    "        time.sleep(1)\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "threading.Thread(target=watch, daemon=True).start()\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv = ['ray'] + sys.argv[2:]\n"
    "main()\n"
)


def log_to_driver() -> bool:
    """Whether workers' output is streamed to the driver (`HLOPAR_RAY_LOG_TO_DRIVER=1`)."""
    return os.environ.get(LOG_TO_DRIVER_VARIABLE, "") not in ("", "0")


@dataclass
class LocalRay:
    """A running head node: its `ray start` process, directory and address."""

    process: subprocess.Popen
    directory: Path
    address: str
    lost: str | None = None  # why the cluster ended under this process (module docstring)
    stopping: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None

    def watch(self) -> None:
        """Starts the thread that disconnects this driver when the cluster dies (module docstring)."""
        self.watcher = threading.Thread(target=self._watch, name="hlopar-ray-watch", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        import ray

        while self.process.poll() is None:
            if self.stopping.wait(0.2):
                return
        if self.stopping.is_set():
            return
        self.lost = (
            f"the local Ray cluster of this process ended (its `ray start` exited with status "
            f"{self.process.returncode}: one of its processes, the raylet or the GCS, died; see "
            f"{self.directory / 'ray-start.log'} and {self.directory / 'session_latest' / 'logs'})"
        )
        if ray.is_initialized():
            ray.shutdown()  # else Ray's C++ code ends this process 60 s later

    def stop(self, timeout: float = 30.0) -> None:
        """Disconnects this driver and ends the head node (its processes go with it)."""
        import ray

        self.stopping.set()
        if ray.is_initialized():
            ray.shutdown()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def start(num_cpus: int, timeout: float = 120.0) -> LocalRay:
    """Starts a head node of `num_cpus` CPUs (module docstring); raises RuntimeError, naming
    its log, if it is not up within `timeout` seconds."""
    return launch(num_cpus).ready(timeout)


@dataclass
class Launched:
    """A head node's `ray start`, started and not yet waited for (`ready`)."""

    process: subprocess.Popen
    directory: Path

    def ready(self, timeout: float = 120.0) -> LocalRay:
        """The head node once up; raises RuntimeError, naming its log, if it is not up within
        `timeout` seconds."""
        process, directory = self.process, self.directory
        address_file = directory / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while not address_file.exists() or not address_file.read_text().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                if process.poll() is None:
                    process.kill()
                raise RuntimeError(f"the local Ray cluster did not start (see {directory / 'ray-start.log'})")
            time.sleep(0.05)
        return LocalRay(process, directory, address_file.read_text().strip())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def launch(num_cpus: int) -> Launched:
    """Starts a head node's `ray start` and returns at once (module docstring)."""
    directory = Path(tempfile.mkdtemp(prefix="hlopar-ray-"))
    _authentication(os.environ)
    log = open(directory / "ray-start.log", "wb")  # noqa: SIM115 (the head process writes it for its whole life)
    command = [
        sys.executable,
        "-c",
        _HEAD,
        str(os.getpid()),
        "start",
        "--head",
        "--block",
        f"--temp-dir={directory}",
        "--port=0",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]  # GPUs: detected
    with log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),  # noqa: SIM112 (Ray spells it so)
            },
        )
    return Launched(process, directory)


def _prestarted() -> LocalRay | None:
    """`prestart`'s cluster once up, or None (none launched, or it ended meanwhile: a new one
    is started instead)."""
    if not _launched:
        return None
    launched = _launched.pop()
    try:
        return launched.ready()
    except RuntimeError:
        launched.stop()
        return None


def prestart(num_cpus: int) -> None:
    """Launches the local cluster that the next `connect(None, ...)` would start, so that it
    comes up while this process does other work (`parallelize` plans meanwhile); nothing
    where this process is connected or one is launched already."""
    import ray

    if _launched or ray.is_initialized():
        return
    launched = launch(num_cpus)
    atexit.register(launched.stop)
    _launched.append(launched)


def _authentication(environ) -> None:
    """Token authentication with a fresh token, unless the user chose Ray's settings. Ray
    reads the mode into its config when it is imported: that config is read again, as
    `ray.init` itself does when it turns token authentication on."""
    if any(name in environ for name in _AUTH_VARIABLES):
        return
    environ["RAY_AUTH_MODE"] = "token"
    environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    from ray._raylet import Config

    Config.initialize("")


# Ray's connection is the process's: the local cluster this process connected to last, and
# every address it connected to (`connection`).
_connected: list[LocalRay] = []
_connections: list[str] = []
_launched: list[Launched] = []  # `prestart`'s, which the next local `connect` takes


def connect(address: str | None, num_cpus: int) -> LocalRay | None:
    """This process connected to Ray: to `address`, or to a local cluster started here with
    `num_cpus` CPUs (returned; stopped at exit; watched, module docstring). Ray's own log
    lines stay at warnings."""
    import ray

    local = None
    if address is None:
        local = _prestarted() or start(num_cpus)
        atexit.register(local.stop)
        address = local.address
    _connected[:] = [local] if local is not None else []
    _connections.append(address)
    ray.init(address=address, log_to_driver=log_to_driver(), logging_level=logging.WARNING, configure_logging=True)
    if local is not None:
        local.watch()
    return local


def current() -> LocalRay | None:
    """The local cluster this process connected to last (dead or alive), or None."""
    return _connected[0] if _connected else None


def disconnected(timeout: float = 60.0) -> None:
    """Returns once this process is disconnected from a local cluster that died under it
    (`ray.shutdown()` takes seconds), so that `connect` can start another; at once if none died."""
    local = current()
    if local is not None and local.lost is not None and local.watcher is not None:
        local.watcher.join(timeout)


def connection() -> int:
    """How many times this process connected (a runtime started under another connection
    holds nothing in this one)."""
    return len(_connections)


def lost() -> str | None:
    """Why the local cluster this process connected to last died under it, or None (module docstring)."""
    local = current()
    return local.lost if local is not None else None
