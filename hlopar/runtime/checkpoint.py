"""Saves of the training state: where they go, how they are committed, how they are checked.

Pure logic over files and plain data (no IR, no jax, no Ray); the runtimes write the parts
(`ray_worker.MeshWorker.save`, `in_process.InProcessRuntime.save`) and `hlopar.api`'s
`save`/`restore` drive it. A save is a directory:

- `<worker>.npz`, one part per worker, named as `mesh_processes.worker_layout` names the
  mesh's workers: its kept results `r<k>` (whole), or on a mesh spanning hosts `r<k>.shape`
  and `r<k>@<device>` (its devices' shards), and `__hlopar__`, the part's own record (the
  save, step and plan it belongs to, as JSON), which says where a stray part came from;
  or, with `parts_format` "orbax", `<worker>/`, an Orbax item (`orbax_format`: the same
  results keyed by the output leaf each is, `keys`; the writer is imported only then);
- `manifest.json`: `format`, `version`, `parts_format`, the plan's key, the save's id and
  step, which mesh holds which result, the workers, the shape and dtype of every result of
  the plan, and per part its file (or item directory), size, SHA-256 (of a directory: of
  its files' relative paths and bytes) and arrays (shape and dtype).

Saving (`save`) is atomic and harmless: the target is checked first (`check_target`: absent,
empty, or an earlier save of this plan; anything else only with `overwrite=True`); the parts
are written into a staging directory beside it (`.<name>.saving-*`, same file system), each
read back and checksummed by its writer and checked again here; only then is the manifest
written and the staging directory renamed over the target (the earlier save, moved aside
first, is removed after). Any failure removes the staging directory and raises
`CheckpointError` naming the target and the cause; the target is as it was.

Restoring (`read_manifest`) checks everything before anything is read into the workers:
the manifest (JSON, format, version), the plan, the results' shapes and dtypes, and per part
its presence, size, checksum, and the shapes and dtypes of its arrays (read from the `.npy`
headers; an Orbax item's as its manifest records them, which its checksum guards). The
first problem raises `CheckpointError` naming the file and what is wrong.

`PeriodicSaves` is `parallelize(checkpoint_every=...)`'s schedule: which call's results to
save, one save written at a time in a thread, the last ones kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "PendingSave",
    "PeriodicSaves",
    "check_target",
    "load_part",
    "part_arrays",
    "peek",
    "read_manifest",
    "save",
    "write_part",
]

FORMAT = "hlopar-save"
VERSION = 2  # 1: parts and manifest without checksums (before issue 25)
MANIFEST = "manifest.json"
RECORD = "__hlopar__"  # a part's own record (JSON in a 0-d string array)


class CheckpointError(RuntimeError):
    """A save that could not be written, or a save that cannot be restored; the message
    names the path and the cause. The workers and their state are as they were, unless
    `workers_lost` (a worker died while it wrote its part)."""

    def __init__(self, message: str, *, workers_lost: bool = False):
        super().__init__(message)
        self.workers_lost = workers_lost


Shapes = Sequence[tuple[Sequence[int], str]]  # per result of the plan: its shape and dtype


# --------------------------------------------------------------------------- writing


def check_target(target: Path, plan: str, overwrite: bool = False) -> None:
    """Refuses a target that holds anything but an earlier save of `plan` (or nothing),
    unless `overwrite`."""
    if overwrite or not os.path.lexists(target):
        return
    if not target.is_dir() or target.is_symlink():
        what = "is a symbolic link" if target.is_symlink() else "is a file"
        raise CheckpointError(
            f"cannot save to {target}: it {what}, not a directory of an earlier save; not "
            "replaced (save(..., overwrite=True) replaces it)"
        )
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return
    manifest = _json(target / MANIFEST) if MANIFEST in entries else None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise CheckpointError(
            f"cannot save to {target}: it holds files that are not an hlopar save ({shown}); not "
            "replaced (save(..., overwrite=True) replaces the directory and all it holds)"
        )
    if manifest.get("plan") != plan:
        raise CheckpointError(
            f"cannot save to {target}: it holds a save of another plan ({manifest.get('plan')}), "
            f"not this step's ({plan}); not replaced (save(..., overwrite=True) replaces it)"
        )
    parts = {p.get("file") for p in (manifest.get("parts") or {}).values() if isinstance(p, dict)}
    if manifest.get("version") != VERSION:  # an earlier format: its parts by worker name
        parts = {f"{w}.npz" for w in manifest.get("workers") or {}}
    stray = [e for e in entries if e != MANIFEST and e not in parts]
    if stray:
        raise CheckpointError(
            f"cannot save to {target}: besides an earlier save of this plan it holds other files "
            f"({', '.join(stray[:5])}); not replaced (save(..., overwrite=True) replaces the "
            "directory and all it holds)"
        )


def save(
    target: str | os.PathLike,
    *,
    plan: str,
    shapes: Shapes,
    step: int,
    write: Callable[[Path, dict], Mapping],
    overwrite: bool = False,
    format: str = "npz",
    keys: Sequence[str] = (),
) -> Path:
    """Writes a save to `target` atomically (module docstring). `write(staging, record)`
    has the runtime write its parts into `staging` (each part's `record` given to
    `write_part`) and returns `{"results": {k: mesh}, "workers": {name: mesh}, "parts":
    {name: what write_part returned}}`; it raises `CheckpointError` (or `OSError`) for what
    failed. `format`: "npz" (hlopar's) or "orbax" (`orbax_format`: `keys`, per result, the
    output leaf it is)."""
    pending = PendingSave.begin(target, plan=plan, step=step, overwrite=overwrite, format=format, keys=keys)
    with pending.failing():
        written = write(pending.staging, pending.record)
    return pending.commit(written, shapes)


class PendingSave:
    """A save begun: its target checked, its staging directory made (`begin`); the parts are
    written there, then `commit` renames it to the target. Any failure, inside `failing()` or
    in `commit`, removes the staging directory and raises `CheckpointError` naming the target."""

    def __init__(self, target: Path, staging: Path | None, record: dict):
        self.target, self.staging, self.record = target, staging, record

    @classmethod
    def begin(
        cls,
        target: str | os.PathLike,
        *,
        plan: str,
        step: int,
        overwrite: bool = False,
        format: str = "npz",
        keys: Sequence[str] = (),
    ) -> PendingSave:
        if format not in ("npz", "orbax"):
            raise ValueError(f"format must be 'npz' or 'orbax', got {format!r}")
        target = Path(target)
        check_target(target, plan, overwrite)
        record = {"save": uuid.uuid4().hex, "step": step, "plan": plan, "parts_format": format}
        if format == "orbax":
            record["keys"] = list(keys)
        pending = cls(target, None, record)
        with pending.failing():
            above = next(p for p in (target.parent, *target.parent.parents) if os.path.lexists(p))
            if not above.is_dir():
                raise CheckpointError(f"{above} is not a directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            pending.staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
            os.chmod(pending.staging, 0o755)
        return pending

    @contextlib.contextmanager
    def failing(self):
        """Errors inside: the staging directory removed, `CheckpointError` naming the target."""
        try:
            yield
        except (CheckpointError, OSError, ImportError) as error:
            self.abandon()
            cause = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
            lost = getattr(error, "workers_lost", False)
            raise CheckpointError(
                f"cannot save to {self.target}: {cause}; nothing was written (the partial save is "
                f"removed, {self.target} is as it was)"
                + ("; the workers stopped, and their state with them" if lost else ", and the workers keep the state"),
                workers_lost=lost,
            ) from error
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def commit(self, written: Mapping, shapes: Shapes, *, recheck: bool = True) -> Path:
        """Checks the parts `written` describes (their size, and with `recheck` their
        checksum again: each writer has read its part back and checksummed it), writes the
        manifest, renames the staging directory to the target."""
        with self.failing():
            staging = self.staging
            parts = written["parts"]
            for part in parts.values():  # as each writer found it: checked again here
                _check_part(staging / part["file"], part, recheck)
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                **self.record,
                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "results": {str(k): mesh for k, mesh in written["results"].items()},
                "workers": dict(written["workers"]),
                "shapes": [[list(s), str(d)] for s, d in shapes],
                "parts": dict(parts),
            }
            with open(staging / MANIFEST, "w") as f:
                f.write(json.dumps(manifest, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            _replace(staging, self.target)
            self.staging = None
        return self.target


def _replace(staging: Path, target: Path) -> None:
    """Renames `staging` to `target`; what was there is renamed aside first, and removed after."""
    aside = None
    if os.path.lexists(target):
        aside = target.with_name(f".{target.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(target, aside)
    try:
        os.rename(staging, target)
    except OSError:
        if aside is not None:
            os.rename(aside, target)
        raise
    _sync_directory(target.parent)
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink()


def _sync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_part(directory: str | os.PathLike, name: str, arrays: Mapping[str, np.ndarray], record: Mapping) -> dict:
    """Writes one worker's part, flushed to disk, and reads it back: its file, size,
    SHA-256 and arrays, for the manifest. `record["parts_format"]` "npz": `<name>.npz`
    (`arrays` and the part's `record`); "orbax": the Orbax item `<name>/`
    (`orbax_format.write_item`, keyed by `record["keys"]`)."""
    if record.get("parts_format") == "orbax":
        from hlopar.runtime.orbax_format import write_item

        if any("@" in k or "." in k for k in arrays):
            raise CheckpointError(
                "a mesh spanning hosts holds shards, which hlopar does not yet save in Orbax's "
                "format (save(..., format='npz') does)"
            )
        keys = record["keys"]
        write_item(directory, name, {keys[int(k[1:])]: a for k, a in arrays.items()})
        path = Path(directory) / name
        found = {k: [list(np.shape(a)), str(np.asarray(a).dtype)] for k, a in arrays.items()}
    else:
        path = Path(directory) / f"{name}.npz"
        with open(path, "wb") as f:
            np.savez(f, **{RECORD: np.array(json.dumps({**record, "worker": name}))}, **arrays)
            f.flush()
            os.fsync(f.fileno())
        found = part_arrays(path)
        wanted = {k: [list(np.shape(a)), str(np.asarray(a).dtype)] for k, a in arrays.items()}
        if found != wanted:
            raise CheckpointError(f"{path}: read back, it holds {found}, not what was written ({wanted})")
    size, digest = _digest(path)
    return {"file": path.name, "size": size, "sha256": digest, "arrays": found}


def load_part(path: Path, keys: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """A part's arrays (its record left out): of an `.npz`, or of an Orbax item (a
    directory; `keys`: per result, its key there)."""
    if path.is_dir():
        from hlopar.runtime.orbax_format import read_item

        number = {k: r for r, k in enumerate(keys)}
        return {f"r{number[k]}": v for k, v in read_item(path).items()}
    with np.load(path) as data:
        return {key: np.array(data[key]) for key in data.files if key != RECORD}


def sharded_result(data: Mapping[str, np.ndarray], r: int, sharding, plan_id: Mapping) -> object:
    """Result `r` of a mesh spanning hosts, from its per-device shards in `data` (`r<r>.shape`,
    `r<r>@<plan device id>`, as its workers save them), laid out as `sharding` on the devices
    this process addresses (`plan_id`: device -> the plan's id of it). Raises
    `CheckpointError` where a shard is not the plan's shape."""
    import jax

    shape = tuple(int(n) for n in data[f"r{r}.shape"])
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        shard = data[f"r{r}@{plan_id[device]}"]
        want = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
        if shard.shape != want:
            raise CheckpointError(
                f"result {r}'s shard on device {plan_id[device]} is {shard.shape}, the plan's is {want}"
            )
        shards.append(jax.device_put(shard, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def part_arrays(path: Path) -> dict[str, list]:
    """The arrays of a part (its record left out) as `{key: [shape, dtype]}`, from their
    `.npy` headers (nothing else is read)."""
    out = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            key = member.removesuffix(".npy")
            if key == RECORD:
                continue
            with archive.open(member) as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            out[key] = [list(shape), str(dtype)]
    return out


def _digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of a file, or of a directory's files (their relative paths and bytes,
    in sorted order)."""
    sha = hashlib.sha256()
    size = 0
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file != path:
            sha.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
                size += len(chunk)
    return size, sha.hexdigest()


def _check_part(path: Path, part: Mapping, recheck: bool = True) -> None:
    if not path.exists():
        raise CheckpointError(f"{path.name} was not written")
    if recheck:
        size, digest = _digest(path)
    else:
        files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file()]
        size, digest = sum(f.stat().st_size for f in files), part["sha256"]
    if size != part["size"] or digest != part["sha256"]:
        raise CheckpointError(
            f"{path.name} changed after its worker wrote it ({size} bytes, SHA-256 "
            f"{digest[:12]}...; its worker wrote {part['size']} bytes, {part['sha256'][:12]}...)"
        )


# --------------------------------------------------------------------------- reading


def read_manifest(directory: str | os.PathLike, *, plan: str, shapes: Shapes, workers: Mapping[str, str]) -> dict:
    """The manifest of the save in `directory`, once it and every part of `workers` (name
    -> mesh) are checked against the plan (module docstring); else `CheckpointError`."""
    directory = Path(directory)

    def bad(where: Path | str, what: str):
        return CheckpointError(
            f"cannot restore from {directory}: {where}: {what}; nothing was restored (the live state is as it was)"
        )

    if not directory.is_dir():
        raise bad(directory, "no such directory" if not os.path.lexists(directory) else "not a directory")
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise bad(path, "missing (not an hlopar save, or one whose writing did not finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad(path, f"not a readable JSON manifest ({type(error).__name__}: {error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT and "plan" not in manifest:
        raise bad(path, "not an hlopar save's manifest")
    if manifest.get("version") != VERSION:
        raise bad(
            path,
            f"written in save format version {manifest.get('version', 1)} (this hlopar reads "
            f"{VERSION}, whose parts carry checksums); save it again with this hlopar",
        )
    if manifest.get("plan") != plan:
        raise bad(path, f"saved from another plan ({manifest.get('plan')}), not this step's ({plan})")
    want = [[list(s), str(d)] for s, d in shapes]
    if manifest.get("shapes") != want:
        raise bad(path, f"its results' shapes and dtypes {manifest.get('shapes')} are not the plan's {want}")
    parts = manifest.get("parts")
    if not isinstance(parts, dict):
        raise bad(path, "lists no parts")
    results = manifest.get("results") or {}
    for name, mesh in workers.items():
        part = parts.get(name)
        if not isinstance(part, dict) or not {"file", "size", "sha256", "arrays"} <= set(part):
            raise bad(path, f"lists no part of worker {name}")
        file = directory / str(part["file"])
        item = manifest.get("parts_format") == "orbax"
        if not (file.is_dir() if item else file.is_file()):
            raise bad(
                file,
                "missing"
                if not os.path.lexists(file)
                else f"not {'a directory (an Orbax item)' if item else 'a file'}",
            )
        size, digest = _digest(file)
        if size != part["size"] or digest != part["sha256"]:
            raise bad(
                file,
                _stray(file, manifest)
                or (
                    f"empty (the manifest says {part['size']} bytes)"
                    if size == 0
                    else f"{size} bytes, the manifest says {part['size']} (truncated or overwritten)"
                    if size != part["size"]
                    else "damaged: its SHA-256 is not the one the manifest records"
                ),
            )
        try:
            found = part["arrays"] if item else part_arrays(file)  # an item's: as its checksum guards them
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise bad(file, f"unreadable ({type(error).__name__}: {error})") from None
        if found != part["arrays"]:
            raise bad(file, f"holds arrays {found}, the manifest lists {part['arrays']}")
        for k, (shape, dtype) in enumerate(want):
            if results.get(str(k)) != mesh:
                continue
            problem = _result_problem(found, k, shape, dtype)
            if problem:
                raise bad(file, problem)
    return manifest


def _result_problem(found: Mapping[str, list], k: int, shape: list, dtype: str) -> str | None:
    """What is wrong with result k in a part's arrays (whole, or a spanning mesh's shards), or None."""
    if f"r{k}" in found:
        got = found[f"r{k}"]
        return None if got == [shape, dtype] else (f"result {k} is {got[1]}{got[0]}, the plan's is {dtype}{shape}")
    shards = [v for key, v in found.items() if key.startswith(f"r{k}@")]
    if f"r{k}.shape" not in found or not shards:
        return f"holds no result {k}"
    wrong = [v for v in shards if v[1] != dtype or len(v[0]) != len(shape) or any(n > m for n, m in zip(v[0], shape))]
    return f"result {k}'s shards {wrong} do not fit the plan's {dtype}{shape}" if wrong else None


def _stray(file: Path, manifest: Mapping) -> str | None:
    """Where a part that is not the one the manifest records comes from, if its own record
    says it is another save's (else None: damaged)."""
    record = None
    try:
        with np.load(file) as data:
            record = json.loads(str(data[RECORD])) if RECORD in data.files else None
    except Exception:  # unreadable: damaged
        pass
    if isinstance(record, dict) and record.get("save") != manifest.get("save"):
        where = "another plan's save" if record.get("plan") != manifest.get("plan") else "another save of this plan"
        return (
            f"a part of {where} (step {record.get('step')}, save {str(record.get('save'))[:8]}), not of this "
            f"one (step {manifest.get('step')}, save {str(manifest.get('save'))[:8]})"
        )
    return None


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def peek(directory: str | os.PathLike) -> dict | None:
    """The manifest of an hlopar save in `directory`, unchecked; None if there is none."""
    manifest = _json(Path(directory) / MANIFEST)
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


# --------------------------------------------------------------------------- saves every N calls


class PeriodicSaves:
    """`parallelize(checkpoint_every=every, checkpoint_dir=directory)`: after every `every`-th
    call a save into `directory/<call>` is begun (`due`) and finished in a thread (`run`),
    the calls going on meanwhile; a save still being written when the next is due delays
    that one to the next call (never the step). The last `keep` saves are kept; a failed
    save is warned about (`HloparWarning`) and leaves the earlier ones. `latest`: the last
    save committed."""

    def __init__(self, directory: Path, every: int, keep: int = 2, warn: Callable[[str], None] = print):
        self.directory, self.every, self.keep, self.warn = Path(directory), every, keep, warn
        self.calls = 0
        self.owed = False  # a save was due while the one before was still being written
        self.thread = None
        self.latest: Path | None = None
        self.errors: list[str] = []
        self.committed: list[Path] = []  # the last `keep`
        self.seconds: list[float] = []  # per save committed: from its start to its commit

    def due(self) -> Path | None:
        """Counts a call; the target of the save due after it, or None."""
        self.calls += 1
        if self.calls % self.every == 0:
            self.owed = True
        if not self.owed or self.busy():
            return None
        self.owed = False
        return self.directory / str(self.calls)

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run(self, job: Callable[[], Path], on_commit: Callable[[Path], None] = lambda path: None) -> None:
        import threading

        started = time.perf_counter()

        def work():
            try:
                path = job()
            except Exception as error:  # noqa: BLE001 - warned about, the calls go on
                self.failed(error)
                return
            self.seconds.append(time.perf_counter() - started)
            self.latest = path
            self.committed.append(path)
            on_commit(path)
            while len(self.committed) > self.keep:
                shutil.rmtree(self.committed.pop(0), ignore_errors=True)

        self.thread = threading.Thread(target=work, name="hlopar-checkpoint", daemon=True)
        self.thread.start()

    def failed(self, error: Exception) -> None:
        self.errors.append(str(error))
        self.warn(f"checkpoint_every: {error}")

    def wait(self, timeout: float | None = None) -> Path | None:
        """Waits for the save being written (if any); the last save committed."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.latest
