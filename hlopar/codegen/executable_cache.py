"""Each executable of a plan compiled once, then loaded wherever it runs.

Planning compiles every executable the plan runs, to read its memory (`memory_check`); the
runtime runs those same executables, not fresh compilations of the same modules:

- in this process (`runtime.in_process`) the loaded executable is handed over as it is:
  an `ExecutableCache` keeps, by key, each executable it compiled or loaded;
- a Ray worker of this machine receives its mesh's executables serialized (`shipment`,
  in its `WorkerProgram`) and loads them; a worker of another host finds no executable
  under its own key (the host is part of it on CPU) and compiles, as does a worker of a
  mesh spanning hosts (its executable is one multi-process program);
- on disk, `<directory>/<key>` (`parallelize`'s `$HLOPAR_CACHE_DIR/executables`): a plan
  read from the plan cache in a new process loads its executables from there.

The key is what jax's persistent compilation cache hashes (`jax._src.cache_key.get`: the
module, jaxlib's version, the backend's platform and version, the XLA flags, the compile
options), less what differs between a driver and its workers on one machine and not in
the executable: the device ids (the assignment made logical, as jax makes it between GPU
processes; a serialized executable is loaded onto any devices of its kind and count) and
the size of the process's CPU client (`--xla_force_host_platform_device_count`, which jax
leaves out too); with the devices' kind and count and, on CPU, the host's name (XLA:CPU
compiles for the host's instruction set). An executable that calls host callbacks (Python
functions of this process) is kept in this process only.

The bytes shipped or written are always those XLA made when it compiled the executable:
the ones it was loaded from where it was loaded (`serialized`). XLA:CPU (jaxlib 0.10) cannot
serialize a loaded executable again: the bytes come out without the kernels' code (41 of
75 KB for the tiny MLP's update), they load, and the first call fails with "NOT_FOUND:
Function <fusion> not found". A new signature's plan whose fragment was on disk (an
optimizer update reads no batch) shipped such bytes, and its worker failed at its first
step (`tools/repro_reserialize.py` shows it without hlopar).

A worker that cannot load what it was shipped (bytes another XLA refuses) compiles it.
`HLOPAR_LOAD_EXECUTABLES=0` turns shipping and the disk off (`loading_enabled`): every
process compiles what it runs.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib
from jax.extend import backend
from jaxlib.mlir import ir

from hlopar.codegen.cache_size import touch
from hlopar.codegen.executables import DeviceExecutable, compile_executable, load_executable
from hlopar.codegen.spmd import compile_options, serialize_spmd
from hlopar.ir.host_callbacks import host_callbacks as find_host_callbacks
from hlopar.ir.module import parse_module, print_module

__all__ = [
    "COMPILED",
    "LOADED",
    "LOAD_VARIABLE",
    "REUSED",
    "Compilation",
    "ExecutableCache",
    "executable_key",
    "loading_enabled",
]

COMPILED, LOADED, REUSED = "compiled", "loaded", "reused"
LOAD_VARIABLE = "HLOPAR_LOAD_EXECUTABLES"


def loading_enabled() -> bool:
    """Whether serialized executables are written, shipped and loaded (module docstring):
    unless `HLOPAR_LOAD_EXECUTABLES=0`."""
    return os.environ.get(LOAD_VARIABLE, "1") != "0"


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def executable_key(text: str, devices: Sequence[jax.Device]) -> str:
    """The key of module `text` compiled for `devices` (module docstring)."""
    options = compile_options(range(len(devices)))
    options.executable_build_options.debug_options.xla_force_host_platform_device_count = 0
    client = backend.get_backend()
    flags = sorted(f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] != _DEVICE_COUNT_FLAG)
    parts = [
        text.encode(),
        jaxlib.__version__.encode(),
        jax.__version__.encode(),
        client.platform.encode(),
        client.platform_version.encode(),
        " ".join(flags).encode(),
        options.SerializeAsString(),
        " ".join(d.device_kind for d in devices).encode(),
        socket.gethostname().encode() if client.platform == "cpu" else b"",
    ]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(frozen=True)
class Compilation:
    """How one executable came to be: compiled, loaded (from bytes: shipped or on disk) or
    reused (held by this cache already), and in how many seconds. `refused`: why bytes found
    for it did not load (then it was compiled)."""

    name: str
    how: str
    seconds: float
    refused: str = ""


class ExecutableCache:
    """Executables by key: held in this process, read from `shipped` (key -> serialized
    executable) or `directory`, else compiled (and written to `directory`). `host_callbacks`:
    the lowering's Python functions, compiled into executables whose module calls one.
    `events` says what each request did (`counts`); `serialized` holds, by key, the bytes
    each held executable was loaded from or serialized to (never a loaded one serialized
    again: module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        shipped: Mapping[str, bytes] | None = None,
        host_callbacks: Sequence = (),
    ):
        self.directory = Path(directory) if directory is not None and loading_enabled() else None
        self.shipped = dict(shipped or {})
        self.host_callbacks = list(host_callbacks)
        self.held: dict[str, DeviceExecutable] = {}
        self.serialized: dict[str, bytes] = {}
        self.events: list[Compilation] = []
        self.seconds = 0.0  # wall time spent answering requests (compilations at once overlap)

    def executable(
        self, module: ir.Operation | str, devices: Sequence[jax.Device], name: str = "", *, load: bool = True
    ) -> DeviceExecutable:
        """`module` (or its text) compiled for `devices`: held, loaded or compiled (class
        docstring). `load=False`: bytes are not loaded (a mesh spanning hosts)."""
        return self.executables([(module, devices, name)], load=load)[0]

    def executables(
        self, requests: Sequence[tuple[ir.Operation | str, Sequence[jax.Device], str]], *, load: bool = True
    ) -> list[DeviceExecutable]:
        """Each (module or its text, devices, name) as `executable` answers it, one event
        each in order; the compilations among them run at once, in threads (XLA compiles
        without holding the GIL; what reads the modules, MLIR, holds it), as many as the
        machine's cores."""
        began = time.perf_counter()
        wanted = []  # (name, key, parsed module, devices, callbacks)
        for module, devices, name in requests:
            text = module if isinstance(module, str) else print_module(module)
            key = executable_key(text, devices)
            parsed = parse_module(text) if isinstance(module, str) else module
            callbacks = bool(self.host_callbacks) and bool(find_host_callbacks(parsed))
            if callbacks:  # this process's functions: never written, shipped or read back
                key += "+callbacks:" + ",".join(str(id(f)) for f in self.host_callbacks)
            wanted.append((name or key[:12], key, parsed, devices, callbacks))
        made: dict[str, tuple[str, float, str]] = {}  # key -> how, seconds, refused
        compile_now = {}
        for _, key, parsed, devices, callbacks in wanted:
            if key in self.held or key in made or key in compile_now:
                continue
            clock = time.perf_counter()
            serialized = None if callbacks or not load else self._bytes(key)
            refused = ""
            if serialized is not None:
                try:
                    self.held[key] = load_executable(parsed, devices, serialized)
                    self.serialized[key] = serialized
                    made[key] = (LOADED, time.perf_counter() - clock, "")
                    continue
                except (RuntimeError, ValueError) as error:  # bytes another XLA made, torn: compile
                    refused = f"{type(error).__name__}: {error}"
            compile_now[key] = (parsed, devices, self.host_callbacks if callbacks else (), refused)
        for key, (executable, seconds) in _compiled_at_once(compile_now).items():
            self.held[key] = executable
            made[key] = (COMPILED, seconds, compile_now[key][3])
            if not compile_now[key][2]:
                self._write(key)
        out = []
        for name, key, *_ in wanted:
            how, seconds, refused = made.pop(key, (REUSED, 0.0, ""))
            self.events.append(Compilation(name, how, seconds, refused))
            out.append(self.held[key])
        self.seconds += time.perf_counter() - began
        return out

    def shipment(self, texts: Iterable[str], devices: Sequence[jax.Device]) -> dict[str, bytes]:
        """The serialized executables of these module texts for `devices` (this process's,
        as many as a worker's and of their kind) that this cache holds or has on disk, by
        key: what a worker of this machine loads instead of compiling."""
        out = {}
        if not loading_enabled():
            return out
        for text in dict.fromkeys(texts):
            key = executable_key(text, devices)
            serialized = self._serialized(key) if key in self.held else self._bytes(key)
            if serialized is not None:
                out[key] = serialized
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        """Per executable name: how many times it was compiled, loaded and reused."""
        out: dict[str, dict[str, int]] = {}
        for event in self.events:
            row = out.setdefault(event.name, {COMPILED: 0, LOADED: 0, REUSED: 0})
            row[event.how] += 1
        return out

    def _serialized(self, key: str) -> bytes:
        """The bytes of held executable `key`: those it was loaded from, else serialized once
        (it was compiled here)."""
        if key not in self.serialized:
            self.serialized[key] = serialize_spmd(self.held[key].spmd)
        return self.serialized[key]

    def _bytes(self, key: str) -> bytes | None:
        if key in self.shipped:
            return self.shipped[key]
        if self.directory is None:
            return None
        try:
            data = (self.directory / key).read_bytes()
        except OSError:
            return None
        touch(self.directory / key)  # used: the last to go when the cache is pruned
        return data

    def _write(self, key: str) -> None:
        """Beside its place, then renamed there: a reader never sees half of one. Best
        effort: a cache that cannot be written only costs compilations later."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(prefix=".executable-", dir=self.directory)
            with os.fdopen(handle, "wb") as out:
                out.write(self._serialized(key))
            os.replace(staging, self.directory / key)
        except OSError:
            pass


def _compiled_at_once(
    jobs: Mapping[str, tuple[ir.Operation, Sequence[jax.Device], Sequence, str]],
) -> dict[str, tuple[DeviceExecutable, float]]:
    """key -> (its module compiled, the seconds it took), for jobs (key -> module, devices,
    host callbacks, ...): in threads where there are several (`ExecutableCache.executables`),
    those with host callbacks in this thread."""

    def one(key: str) -> tuple[DeviceExecutable, float]:
        module, devices, callbacks, _ = jobs[key]
        clock = time.perf_counter()
        return compile_executable(module, devices, callbacks), time.perf_counter() - clock

    threaded = [k for k, job in jobs.items() if not job[2]]
    out = {k: one(k) for k, job in jobs.items() if job[2]}
    # Not in a multi-process jax runtime: there jaxlib 0.10.2's compile, called from two
    # threads at once, failed iterating its device list ("iter() returned non-iterator of
    # type 'ifrt_device_iterator'", a worker of a mesh across hosts, test_ray_runtime.py).
    if len(threaded) > 1 and (os.cpu_count() or 1) > 1 and jax.process_count() == 1:
        with ThreadPoolExecutor(min(len(threaded), os.cpu_count() or 1), thread_name_prefix="hlopar-compile") as pool:
            out.update(zip(threaded, pool.map(one, threaded)))
    else:
        out.update((k, one(k)) for k in threaded)
    return out
