"""Saves cost nothing when they fail, restores check before they touch anything, and saves
in Orbax's format read in plain Orbax and back (issue 25, items 1 to 3; `runtime/checkpoint.py`,
`runtime/orbax_format.py`).

A save that fails (a read-only directory, a path under a file, a worker's part failing
half-way, over an earlier save) raises `CheckpointError` naming the path and the cause; the
earlier save is intact (the same bytes, and it restores), and the workers keep the state: the
next step from it equals single-device JAX's. A target holding anything but an earlier save
of this plan (a file, a directory of other files) is refused unless `overwrite=True`. A
restore from a save with a part truncated, emptied, bit-flipped, deleted, of the wrong
shape, from a later save of the plan or from another plan's save, or a manifest that is not
JSON or of another plan, raises naming the file and what is wrong, and the live state
stays.

`save(format="orbax")` writes an Orbax item per worker that plain Orbax restores into
arrays equal to the live state (and `jax.jit` on one device steps on); a checkpoint plain
Orbax wrote of the step's outputs restores into hlopar. `checkpoint_every` saves in the
background; on Ray, after a worker dies, the next call names the checkpoint to resume from,
and restoring it resumes.

Both runtimes: the zoo's tiny MLP run in this process ("shard" on one host of 8 devices)
and on Ray as a pipeline of two workers (2 hosts x 4 devices, one worker per mesh); one
compiled function per runtime for the module, the corruptions parametrized over one save."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import jax
import pytest
import ray
from numerics import assert_step_close, assert_trees_equal

import hlopar
from hlopar.models import get_train_step
from hlopar.runtime import checkpoint
from hlopar.runtime.checkpoint import CheckpointError
from hlopar.runtime.ray_runtime import RayRuntime

ONE_HOST = hlopar.Cluster.local(1, 8, device_kind="cpu")
TWO_HOSTS = hlopar.Cluster.local(2, 4, device_kind="cpu")
RTOL, UPDATE_MAX_RTOL = 1e-5, 1e-4


class Trained:
    """A parallelized step that has run, its live state (the last step's results, which a
    save writes), an earlier save (`saved`, made after the first step) and a later one
    (`later`, after the second)."""

    def __init__(self, step, parallel, batch, first, live, saved: Path, later: Path):
        self.step, self.parallel, self.batch = step, parallel, batch
        self.first, self.live = first, live
        self.saved, self.later = saved, later

    def check_live(self) -> None:
        """The live state survived: the next step from it equals single-device JAX's."""
        state = jax.device_get(self.live[:2])
        out = self.parallel(self.live[0], self.live[1], self.batch)
        assert_step_close(
            jax.tree_util.tree_leaves(out),
            self.step.jitted_step(*state, self.batch),
            state[0],
            rtol=RTOL,
            update_max_rtol=UPDATE_MAX_RTOL,
        )
        self.live = out  # the last step's results: what a save writes

    def check_saved(self, directory: Path | None = None) -> None:
        """The earlier save restores to the first step's state (which is then the live one)."""
        self.live = self.parallel.restore(directory or self.saved)
        assert_trees_equal(jax.device_get(self.live), jax.device_get(self.first))


@pytest.fixture(scope="module", params=["process", "ray"])
def trained(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "ray":
            request.getfixturevalue("ray_cluster")
        else:
            patch.setenv("HLOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("hlopar-cache")))
        step = get_train_step("mlp", "tiny")
        params = step.init(jax.random.PRNGKey(0))
        args = (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))
        options = (
            dict(cluster=ONE_HOST, method="shard", runtime="process")
            if request.param == "process"
            else dict(cluster=TWO_HOSTS, num_microbatches=2, schedule="1f1b", runtime="ray")
        )
        parallel = hlopar.parallelize(step.step, batch_argnums=(2,), verbose=False, **options)
        directory = tmp_path_factory.mktemp(f"saves-{request.param}")
        try:
            first = parallel(*args)
            saved = parallel.save(directory / "saved")
            jax.device_get(first)
            live = parallel(first[0], first[1], args[2])
            later = parallel.save(directory / "later")  # a later save of the same plan: the second step's
            if request.param == "ray":
                assert sorted(parallel.runtime.actors) == ["m0", "m1"]
            yield Trained(step, parallel, args[2], first, live, saved, later)
        finally:
            parallel.close()


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def leftovers(parent: Path) -> list[str]:
    """Staging or set-aside directories a save left behind."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- saving


def test_a_save_over_an_earlier_one_and_its_format(trained, tmp_path):
    target = tmp_path / "state"
    shutil.copytree(trained.saved, target)
    trained.parallel.save(target)  # an earlier save of this plan: replaced
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["format"] == "hlopar-save" and manifest["version"] == checkpoint.VERSION
    assert set(manifest["parts"]) == set(trained.parallel.runtime.worker_meshes())
    assert sorted(p.name for p in target.iterdir()) == sorted(
        ["manifest.json", *(p["file"] for p in manifest["parts"].values())]
    )
    assert leftovers(tmp_path) == []
    assert_trees_equal(jax.device_get(trained.parallel.restore(target)), jax.device_get(trained.live))
    trained.live = trained.parallel.restore(target)  # kept again, as a new step's
    trained.check_live()


def read_only(directory: Path):
    """Makes `directory` refuse new files even to root (`chattr +i`); returns the undo, or
    None where this file system has no such attribute."""
    directory.mkdir()
    directory.chmod(0o555)
    probe = directory / "probe"
    try:
        probe.touch()
    except PermissionError:
        return lambda: directory.chmod(0o755)
    probe.unlink()
    done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
    if done.returncode != 0:
        directory.chmod(0o755)
        return None
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_a_save_into_a_read_only_directory_or_under_a_file(trained, tmp_path):
    undo = read_only(tmp_path / "read-only")
    targets = [tmp_path / "file" / "state"]
    (tmp_path / "file").write_text("a file, not a directory\n")
    if undo is not None:
        targets.insert(0, tmp_path / "read-only" / "state")
    try:
        for target in targets:
            with pytest.raises(
                CheckpointError,
                match=rf"cannot save to {target}: .*(PermissionError|Operation not "
                r"permitted|/file is not a directory).*nothing was written.*the workers keep the state",
            ):
                trained.parallel.save(target)
            assert not target.exists()
    finally:
        if undo is not None:
            undo()
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "read-only") == []
    trained.check_live()


def break_writes(reason: str):
    """A `checkpoint.write_part` that writes half a part and fails (a full disk)."""

    def half_then_fail(directory, name, arrays, record):
        path = Path(directory) / f"{name}.npz"
        path.write_bytes(b"PK\x03\x04" + bytes(64))
        raise OSError(errno.ENOSPC, reason, str(path))

    return half_then_fail


def test_a_save_failing_half_way_over_an_earlier_one(trained, tmp_path, monkeypatch):
    target = tmp_path / "state"
    shutil.copytree(trained.saved, target)
    before = files(target)
    runtime = trained.parallel.runtime
    if isinstance(runtime, RayRuntime):
        # The second worker's part fails half-way; the first one's is written.
        def patch(worker, fail):
            from hlopar.runtime import checkpoint as module

            module.__dict__.setdefault("real_write_part", module.write_part)
            module.write_part = fail or module.real_write_part

        ray.get(runtime.actors["m1"].__ray_call__.remote(patch, break_writes("No space left on device")))
        expected = r"the worker of mesh m1 could not write its part: OSError: \[Errno 28\] No space left on device"
    else:
        monkeypatch.setattr(checkpoint, "write_part", break_writes("No space left on device"))
        expected = r"OSError: \[Errno 28\] No space left on device"
    try:
        with pytest.raises(CheckpointError, match=rf"cannot save to {target}: {expected}.*nothing was written"):
            trained.parallel.save(target)
    finally:
        if isinstance(runtime, RayRuntime):
            ray.get(runtime.actors["m1"].__ray_call__.remote(patch, None))
        monkeypatch.undo()
    assert files(target) == before and leftovers(tmp_path) == []
    assert runtime.alive
    trained.check_live()
    trained.check_saved(target)


def test_a_target_holding_other_things_is_refused_unless_overwrite(trained, tmp_path):
    (tmp_path / "a-file").write_text("mine\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "m0.npz").write_bytes(b"the user's own m0.npz")
    (mine / "notes.txt").write_text("mine too\n")
    other_plan = tmp_path / "other-plan"
    shutil.copytree(trained.saved, other_plan)
    manifest = json.loads((other_plan / "manifest.json").read_text())
    (other_plan / "manifest.json").write_text(json.dumps({**manifest, "plan": "another"}))
    extra = tmp_path / "extra"
    shutil.copytree(trained.saved, extra)
    (extra / "notes.txt").write_text("mine\n")
    cases = [
        (tmp_path / "a-file", "it is a file"),
        (mine, r"files that are not an hlopar save \(m0.npz, notes.txt\)"),
        (other_plan, r"a save of another plan \(another\)"),
        (extra, r"other files \(notes.txt\)"),
    ]
    for target, why in cases:
        before = files(target) if target.is_dir() else target.read_bytes()
        with pytest.raises(CheckpointError, match=rf"cannot save to {target}: .*{why}.*overwrite=True"):
            trained.parallel.save(target)
        assert (files(target) if target.is_dir() else target.read_bytes()) == before
    for target, _ in cases:
        trained.parallel.save(target, overwrite=True)
        assert_trees_equal(jax.device_get(trained.parallel.restore(target)), jax.device_get(trained.live))
    assert leftovers(tmp_path) == []
    trained.live = trained.parallel.restore(tmp_path / "mine")
    trained.check_live()


# --------------------------------------------------------------------------- restoring


def rewrite_part(directory: Path, part: str, change) -> None:
    """Rewrites a part with `change(arrays)` and records it in the manifest as consistent
    (size, checksum, arrays): only the checks against the plan can see what changed."""
    manifest = json.loads((directory / "manifest.json").read_text())
    arrays = checkpoint.load_part(directory / f"{part}.npz")
    record = {k: manifest[k] for k in ("save", "step", "plan")}
    manifest["parts"][part] = checkpoint.write_part(directory, part, change(arrays), record)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def shorten(arrays: dict) -> dict:
    """The first result with several rows cut to one."""
    key = next(k for k, a in sorted(arrays.items()) if a.ndim and a.shape[0] > 1)
    return {**arrays, key: arrays[key][:1]}


def truncate(path: Path, size) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: size(len(data))])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": (
        lambda t, d, p: truncate(d / f"{p}.npz", lambda n: n // 2),
        r"{p}.npz: \d+ bytes, the manifest "
        r"says \d+ \(truncated",
    ),
    "empty": (lambda t, d, p: truncate(d / f"{p}.npz", lambda n: 0), r"{p}.npz: empty"),
    "bit-flipped": (
        lambda t, d, p: flip(d / f"{p}.npz"),
        r"{p}.npz: damaged: its SHA-256 is not the one the "
        "manifest records",
    ),
    "missing": (lambda t, d, p: (d / f"{p}.npz").unlink(), r"{p}.npz: missing"),
    "wrong-shape": (
        lambda t, d, p: rewrite_part(d, p, shorten),
        r"{p}.npz: result \d+ is float32\[1(, \d+)*\], the plan's is float32\[\d+(, \d+)*\]",
    ),
    "other-step": (
        lambda t, d, p: shutil.copy(t.later / f"{p}.npz", d / f"{p}.npz"),
        r"{p}.npz: a part of another save of this plan \(step 2, save \w+\), not of this one \(step 1",
    ),
    "other-plan": (
        lambda t, d, p: checkpoint.write_part(
            d, p, checkpoint.load_part(d / f"{p}.npz"), {"save": "0" * 32, "step": 7, "plan": "another"}
        ),
        r"{p}.npz: a part of another plan's save \(step 7, save 00000000\)",
    ),
    "manifest-not-json": (
        lambda t, d, p: (d / "manifest.json").write_text('{"format": "hlopar-save", '),
        r"manifest.json: not a readable JSON manifest \(JSONDecodeError",
    ),
    "manifest-other-plan": (
        lambda t, d, p: (d / "manifest.json").write_text(
            json.dumps({**json.loads((d / "manifest.json").read_text()), "plan": "another"})
        ),
        r"manifest.json: saved from another plan \(another\), not this step's",
    ),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_save_is_refused_before_anything_is_restored(trained, tmp_path, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    part = sorted(trained.parallel.runtime.worker_meshes())[-1]  # on Ray, the second worker's
    directory = tmp_path / "state"
    shutil.copytree(trained.saved, directory)
    corrupt(trained, directory, part)
    step_id = trained.parallel.runtime.step_id
    with pytest.raises(
        CheckpointError,
        match=rf"cannot restore from {directory}: .*{message.format(p=part)}.*"
        r"nothing was restored \(the live state is as it was\)",
    ):
        trained.parallel.restore(directory)
    assert trained.parallel.runtime.step_id == step_id
    trained.check_live()
    trained.check_saved()


# --------------------------------------------------------------------------- Orbax's format


def test_an_orbax_save_reads_in_plain_orbax_and_back(trained, tmp_path):
    """`save(format="orbax")`: an Orbax item per worker, which plain Orbax restores into host
    arrays equal to the live state, from which plain `jax.jit` on one device steps as the
    parallel step does; hlopar restores it too, into its workers, and as another plan's save
    (joined in the driver, single-device arrays). And back: a checkpoint plain Orbax wrote of
    the step's output pytree from single-device arrays restores into hlopar. A damaged item
    is refused as a damaged part is."""
    import orbax.checkpoint as ocp

    target = trained.parallel.save(tmp_path / "orbax", format="orbax")
    items = sorted(p for p in target.iterdir() if p.is_dir())
    assert [p.name for p in items] == sorted(trained.parallel.runtime.worker_meshes())
    checkpointer = ocp.StandardCheckpointer()
    flat = {}
    for item in items:
        flat.update(checkpointer.restore(item))
    live = jax.device_get(trained.live)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(live)
    assert sorted(flat) == sorted(jax.tree_util.keystr(path) for path, _ in leaves)
    state = jax.tree_util.tree_unflatten(
        treedef, [jax.device_put(flat[jax.tree_util.keystr(path)]) for path, _ in leaves]
    )
    assert_trees_equal(state, live)

    trained.live = trained.parallel.restore(target)  # the same plan: each worker reads its item
    assert_trees_equal(jax.device_get(trained.live), live)
    other = tmp_path / "other-plan"  # as saved by another plan: its items joined here, on one device
    shutil.copytree(target, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "plan": "another"}))
    joined = trained.parallel.restore(other)
    assert all(x.sharding.device_set == {jax.local_devices()[0]} for x in jax.tree_util.tree_leaves(joined))
    assert_trees_equal(jax.device_get(joined), live)

    reference = trained.step.jitted_step(state[0], state[1], trained.batch)  # plain jax.jit, one device
    checkpointer.save(tmp_path / "plain", reference)
    checkpointer.wait_until_finished()
    back = trained.parallel.restore(tmp_path / "plain")
    assert all(x.sharding.device_set == {jax.local_devices()[0]} for x in jax.tree_util.tree_leaves(back))
    assert_trees_equal(jax.device_get(back), jax.device_get(reference))
    trained.live = back
    trained.check_live()

    damaged = tmp_path / "damaged"
    shutil.copytree(target, damaged)
    flip(max((p for p in (damaged / items[-1].name).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size))
    with pytest.raises(CheckpointError, match=rf"{items[-1].name}: damaged: its SHA-256 is not the one the manifest"):
        trained.parallel.restore(damaged)
    trained.check_live()


@pytest.mark.filterwarnings("ignore:checkpoint_every. cannot save")  # the save begun when the worker dies
def test_checkpoint_every_and_resuming_after_a_worker_dies(trained, tmp_path):
    """`checkpoint_every=2`: saves in Orbax's format in the background after calls 2, 4, ...
    (the last two kept), each equal to its call's results. On Ray, after a worker dies, the
    call that passes the lost state says which checkpoint resumes it, and restoring it gives
    the state to go on from, equal to single-device JAX's."""
    step, batch = trained.step, trained.batch
    options = (
        dict(cluster=ONE_HOST, method="shard", runtime="process")
        if not isinstance(trained.parallel.runtime, RayRuntime)
        else dict(cluster=TWO_HOSTS, num_microbatches=2, schedule="1f1b", runtime="ray")
    )
    directory = tmp_path / "checkpoints"
    parallel = hlopar.parallelize(
        step.step, batch_argnums=(2,), verbose=False, checkpoint_every=2, checkpoint_dir=directory, **options
    )
    try:
        state, outputs = jax.device_get(trained.first[:2]), {}
        for call in range(1, 6):
            out = parallel(*state, batch)
            outputs[call] = jax.device_get(out)
            state = out[:2]
            if call % 2 == 0:
                assert parallel.wait_for_checkpoint() == directory / str(call)
        assert sorted(p.name for p in directory.iterdir()) == ["2", "4"]
        assert_trees_equal(jax.device_get(parallel.restore(directory / "4")), outputs[4])
        runtime = parallel.runtime
        if not isinstance(runtime, RayRuntime):
            return
        import os
        import signal

        state = parallel(*state, batch)[:2]  # call 6: its save is begun; the worker dies at once
        os.kill(runtime.worker_pids()["m0"], signal.SIGKILL)
        with pytest.raises(hlopar.WorkerError, match="died"):
            for _ in range(3):
                state = parallel(*state, batch)[:2]
        latest = parallel.wait_for_checkpoint()
        assert latest in (directory / "4", directory / "6")
        with pytest.raises(
            RuntimeError,
            match=rf"the last checkpoint is {latest} \(saved after call "
            rf"{latest.name}\): restore\('{latest}'\) resumes there",
        ):
            parallel(*state, batch)
        resumed = parallel.restore(latest)
        if latest.name == "4":
            assert_trees_equal(jax.device_get(resumed), outputs[4])
        out = parallel(resumed[0], resumed[1], batch)
        from_state = jax.device_get(resumed[:2])
        assert_step_close(
            jax.tree_util.tree_leaves(out),
            step.jitted_step(*from_state, batch),
            from_state[0],
            rtol=RTOL,
            update_max_rtol=UPDATE_MAX_RTOL,
        )
    finally:
        parallel.close()
