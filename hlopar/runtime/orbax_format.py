"""Saves in the JAX ecosystem's checkpoint format: Orbax (`orbax-checkpoint`), imported only
when such a save is written or read (about 1 s of imports).

`fn.save(dir, format="orbax")` (and `parallelize(checkpoint_every=...)`) write, through
`checkpoint.save` (staging beside the target, checked, renamed), one Orbax item per worker:
`dir/<worker>/`, a PyTree checkpoint that `orbax.checkpoint.StandardCheckpointer` reads,
holding a flat dict of the results that worker keeps, as host arrays, keyed by the step's output leaf they are
(`jax.tree_util.keystr` of its path in `fn`'s output pytree: `[0]['layer0']['w']`; a piece of
a stacked layer leaf cut over stages has its rows appended, `[0]['layers']['w'][2:4]`; a typed
key is its key data). `dir/manifest.json` is hlopar's (checksums of every file of each item,
the plan, which worker holds which result).

Plain Orbax reads each item as its docs show, into single-device arrays, with no hlopar:

    import orbax.checkpoint as ocp
    flat = {}
    for item in sorted(p for p in path.iterdir() if p.is_dir()):
        flat.update(ocp.StandardCheckpointer().restore(item))        # numpy arrays
    state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[jax.tree_util.keystr(p)])
                                                   for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]])

and the other way, a checkpoint plain Orbax wrote of the step's output pytree
(`ocp.StandardCheckpointer().save(path, (params, opt_state, loss))`, single-device arrays),
is restored by `fn.restore(path)` (`restore_tree`, on the driver: the next call sends it), as
is an hlopar Orbax save of another plan (its items joined here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["is_orbax_checkpoint", "read_item", "restore_tree", "write_item"]


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:
        raise ImportError(
            f"saves in Orbax's format need orbax-checkpoint: pip install 'hlopar[orbax]' ({error})"
        ) from None
    return ocp


def write_item(directory: str | os.PathLike, name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes one worker's item, `directory/<name>/` (Orbax writes it under a temporary name
    and renames it; `checkpoint.save` then checksums it): a PyTree checkpoint, as
    `StandardCheckpointer` writes one but uncompressed (zstd barely shrinks trained float
    weights and took twice the CPU: 0.22 s against 0.10 s for 36 MiB here, CPU a background
    save takes from the steps), which `StandardCheckpointer().restore` reads."""
    ocp = _ocp()
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    try:
        checkpointer.save(
            Path(directory) / name, args=ocp.args.PyTreeSave({k: np.asarray(v) for k, v in arrays.items()})
        )
    finally:
        checkpointer.close()


def read_item(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """An item's arrays by key, as host arrays."""
    ocp = _ocp()
    checkpointer = ocp.StandardCheckpointer()
    try:
        return {k: np.asarray(v) for k, v in checkpointer.restore(Path(path)).items()}
    finally:
        checkpointer.close()


def is_orbax_checkpoint(path: Path) -> bool:
    """A checkpoint Orbax wrote (its metadata files), not an hlopar save."""
    return (path / "_CHECKPOINT_METADATA").is_file() or (path / "_METADATA").is_file()


def restore_tree(
    path: Path,
    keys: Sequence[str],
    shapes: Sequence[tuple[Sequence[int], str]],
    *,
    target=None,
    items: Sequence[str] = (),
) -> list:
    """The step's output leaves (in `keys` order, each its `keystr` path, of the given shapes
    and dtypes) from a checkpoint plain Orbax wrote of the output pytree (`target`: its
    abstract pytree, leaves restored as it places them) or from an hlopar Orbax save's
    `items` (joined, a stacked leaf's pieces concatenated; host arrays). A missing leaf, a
    wrong shape or dtype raises `ValueError` naming it."""
    import jax

    if items:
        flat: dict[str, np.ndarray] = {}
        for item in items:
            flat.update(read_item(path / item))
    else:
        ocp = _ocp()
        checkpointer = ocp.StandardCheckpointer()
        try:
            tree = checkpointer.restore(path, target)
        finally:
            checkpointer.close()
        flat = dict(zip(keys, jax.tree_util.tree_leaves(tree)))
    out = []
    for key, (shape, dtype) in zip(keys, shapes):
        if key in flat:
            value = flat[key]
        else:
            pieces = sorted(
                (int(k[len(key) + 1 :].split(":")[0]), v)
                for k, v in flat.items()
                if k.startswith(key + "[") and ":" in k[len(key) :]
            )
            if not pieces:
                raise ValueError(f"{path} holds no leaf {key}")
            value = np.concatenate([v for _, v in pieces])
        if list(value.shape) != list(shape) or str(value.dtype) != str(dtype):
            raise ValueError(
                f"{path}: leaf {key} is {value.dtype}{list(value.shape)}, the step's is {dtype}{list(shape)}"
            )
        out.append(value)
    return out
