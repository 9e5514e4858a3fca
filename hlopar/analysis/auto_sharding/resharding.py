"""Resharding: the collectives that turn a tensor's layout into another (Alpa §4.1, Table 2).

The plan writes each conversion as an `sdy.sharding_constraint`, and XLA's SPMD partitioner
(GSPMD's `PartitionedHlo::Reshard`) decides how to carry it out; this module predicts what it
emits, following its cases in their order (`t_d` = how many tiles a spec cuts dim d into):

1. *Same tile counts*, other devices (an axis replaced by one of equal size, or the order of a
   dimension's axes changed): one collective-permute of the target tile.
2. *Finer tiles* (every `t_d` of `dst` a multiple of `src`'s): each device slices its target
   tile out of data it holds (free, Table 2 #1) when `dst` only appends axes to `src`'s; else
   the tiles are sliced where they lie and sent where they belong: one collective-permute.
3. *Coarser tiles*: an all-gather per dimension that loses axes (#2, #3), the last dimension
   first, each named after the per-device size once gathered; a collective-permute of the
   source tiles comes first when an axis that stays is minor to one that goes.
4. Otherwise axes move between dimensions (#4, #5): the dimensions' lost axes are gathered as
   in 3 (before anything new is sliced out), then one all-to-all per pair of dimensions that
   trade axes (two dimensions that swap their splits trade the smaller one's, as XLA pairs
   dimensions by tile count), and a collective-permute when the axes of a dimension end up
   in another order than `dst`'s (an all-to-all appends arriving axes as the minor-most).
   When a dimension's axes spread over several dimensions, or several dimensions' merge into
   one, XLA finds no all-to-all: it gathers every dimension (last first) and slices.

`tools/check_fidelity.py` and `test/unit/analysis/auto_sharding/test_fidelity.py` compare this with what
XLA compiles: on a 2x4 mesh it agrees for about 80% of all pairs of layouts of a 3-D tensor,
and the rest (sub-axis collectives XLA uses for some multi-axis conversions) are rare in plans.
Sizes are per device, rounded up per dimension as XLA pads uneven shards. Mesh axes of size 1
split nothing and are ignored. The ILP asks for every pair of strategies on every edge, so
costs are cached per (shape, dtype size, src, dst, mesh), and the collectives themselves per
(src, dst, mesh shape): which collectives a resharding takes does not depend on the tensor's
shape, only the bytes they move do. All arguments are hashable values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hlopar.analysis.auto_sharding.cluster import LogicalMesh, MeshAxis
from hlopar.analysis.auto_sharding.collectives import Collective, collective_cost
from hlopar.analysis.sharding import ShardingSpec

__all__ = ["per_device_bytes", "resharding_collectives", "resharding_cost"]

_CACHE_SIZE = 1 << 16


def per_device_bytes(shape: Sequence[int], dtype_bytes: int, spec: ShardingSpec, mesh: LogicalMesh) -> int:
    """Bytes of one device's tile of a `shape` tensor laid out as `spec` (ceil per dimension)."""
    shape = tuple(shape)
    _check_rank(shape, spec, "spec")
    elements = 1
    for size, axes in zip(shape, spec.dims):
        elements *= -(-size // mesh.axes_size(axes)) if axes else size
    return elements * dtype_bytes


def resharding_collectives(
    shape: Sequence[int], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    """The collectives, in order, that turn layout `src` into `dst`; `()` when slicing suffices."""
    return _collectives(_as_shape(shape), dtype_bytes, src, dst, mesh)


def resharding_cost(
    shape: Sequence[int], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> float:
    """Seconds the resharding takes on `mesh`: the sum of its collectives' alpha-beta costs."""
    return _cost(_as_shape(shape), dtype_bytes, src, dst, mesh)


def _as_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return shape if type(shape) is tuple else tuple(shape)


# A resharding's collectives depend on the tensor only through the bytes they move: which
# collectives, over which axes, follows from the two layouts and the mesh. `_steps` finds them
# once per (rank, src, dst, mesh), each with the layout whose per-device tile names its size;
# `_cost` and `_collectives` then only size them for a shape (the ILP asks for the same pairs
# of layouts for many tensors).
_Step = tuple[str, tuple[str, ...], ShardingSpec]  # (kind, axes, layout that sizes it)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cost(shape: tuple[int, ...], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> float:
    # `Collective.cost` of each of `_collectives`, without making the (validated) objects.
    _check_rank(shape, src, "source spec")
    _check_rank(shape, dst, "target spec")
    return sum(
        (
            collective_cost(kind, mesh, axes, per_device_bytes(shape, dtype_bytes, spec, mesh))
            for kind, axes, spec in _steps(src, dst, _geometry(mesh))
        ),
        0.0,
    )


def _collectives(
    shape: tuple[int, ...], dtype_bytes: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    _check_rank(shape, src, "source spec")
    _check_rank(shape, dst, "target spec")
    return tuple(
        Collective(kind, axes, per_device_bytes(shape, dtype_bytes, spec, mesh))
        for kind, axes, spec in _steps(src, dst, _geometry(mesh))
    )


@functools.lru_cache(maxsize=1024)
def _geometry(mesh: LogicalMesh) -> LogicalMesh:
    """The mesh's axes (names, sizes) with unit link costs: what `_steps` reads of a mesh, so
    that meshes of one shape and other links (a stage's logical shapes on several
    submeshes) share their steps."""
    return LogicalMesh(tuple(MeshAxis(a.name, a.size, 0.0, 1.0) for a in mesh.axes), 1.0, 1.0)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _steps(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[_Step, ...]:
    """The collectives from `src` to `dst` on a mesh of this geometry (`_geometry`)."""
    src, dst = _without_trivial_axes(src, mesh), _without_trivial_axes(dst, mesh)
    if src == dst:
        return ()
    if src.unreduced or dst.unreduced:
        return _pending_sums(src, dst, mesh)
    order = mesh.axis_names
    src_axes, dst_axes = set(src.used_axes), set(dst.used_axes)
    used = tuple(a for a in order if a in src_axes | dst_axes)
    have_tiles = [mesh.axes_size(axes) for axes in src.dims]
    want_tiles = [mesh.axes_size(axes) for axes in dst.dims]
    if have_tiles == want_tiles:
        # the same tiles on other devices
        return (("collective-permute", used, dst),)
    if all(w % h == 0 for h, w in zip(have_tiles, want_tiles)):
        # each new tile lies in one a device holds: slice it out, then move it if it is
        # not on the device that wants it
        if all(want[: len(have)] == have for have, want in zip(src.dims, dst.dims)):
            return ()
        return (("collective-permute", used, dst),)
    if all(h % w == 0 for h, w in zip(have_tiles, want_tiles)):
        return _to_coarser(src, dst, mesh, used)
    return _gather_and_trade(src, dst, mesh, used)


def _to_coarser(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh, used: tuple[str, ...]) -> tuple[_Step, ...]:
    """Coarser tiles: gather each dimension, the last one first (after a permute when an
    axis that stays is minor to one that goes)."""
    order = mesh.axis_names
    steps = []
    if not all(have[: len(want)] == want for have, want in zip(src.dims, dst.dims)):
        steps.append(("collective-permute", used, src))
    current = list(src.dims)
    for dim in reversed(range(src.rank)):
        gathered = tuple(a for a in order if a in src.dims[dim] and a not in dst.dims[dim])
        if gathered:
            current[dim] = tuple(a for a in current[dim] if a not in gathered)
            steps.append(("all-gather", gathered, ShardingSpec(tuple(current))))
    return tuple(steps)


def _gather_and_trade(
    src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh, used: tuple[str, ...]
) -> tuple[_Step, ...]:
    """Tiles neither finer nor coarser: gather the axes that go, trade the axes that move
    between dimensions by all-to-all, permute where the devices end up in another order."""
    order = mesh.axis_names
    dst_axes = set(dst.used_axes)
    dst_dim = {a: d for d, axes in enumerate(dst.dims) for a in axes}
    current = []  # the layout as the gathers leave it
    gathers: list[tuple[int, tuple[str, ...]]] = []
    moves: dict[tuple[int, int], set[str]] = {}  # (from dim, to dim) -> axes
    reordered: set[str] = set()  # axes that stay in their dim but at another place
    for dim, (have, want) in enumerate(zip(src.dims, dst.dims)):
        if want[: len(have)] == have:
            current.append(have)
            continue
        kept = _common_prefix(have, want)
        gathered = tuple(a for a in order if a in have and a not in dst_axes)
        if gathered:
            gathers.append((dim, gathered))
        for a in have[kept:]:
            if a not in dst_axes:
                continue
            if dst_dim[a] != dim:
                moves.setdefault((dim, dst_dim[a]), set()).add(a)
            else:
                reordered.add(a)
        current.append(have)
    pairs = sorted(moves)
    if len({d for d, _ in pairs}) < len(pairs) or len({e for _, e in pairs}) < len(pairs):
        # axes of one dimension spread over several, or of several merged into one: XLA
        # finds no all-to-all for it, gathers the whole tensor, then slices
        return _gather_all(src, mesh)
    steps = []
    # XLA gathers each tensor dimension on its own, the last one first.
    for dim, gathered in reversed(gathers):
        current[dim] = tuple(a for a in current[dim] if a in dst_axes)
        steps.append(("all-gather", gathered, ShardingSpec(tuple(current))))
    # One all-to-all per pair of tensor dimensions that trade axes; two dimensions that swap
    # their splits trade only the smaller one's shards, then the devices get reordered. An
    # axis new to the tensor that splits a dimension giving axes away is sliced out after the
    # all-to-all, which moves the tiles whole, other new axes before: XLA's choice for
    # [R, S(y)] -> [S(y), S(x)] on 2x4 (the tiny GPT's plans), a heuristic elsewhere (for
    # some 3-D shapes XLA trades x and permutes instead; `test_fidelity.py`: 276 of 342 pairs).
    swapped = False
    src_axes = set(src.used_axes)
    giving = {d for d, _ in moves}
    gathered_tiles = ShardingSpec(
        tuple(tuple(a for a in axes if a in src_axes or d not in giving) for d, axes in enumerate(dst.dims))
    )
    for (d, e), axes in sorted(moves.items()):
        if (e, d) in moves:
            if d > e:
                continue
            axes = min(axes, moves[e, d], key=lambda a: (mesh.axes_size(tuple(a)), sorted(a)))
            swapped = True
        steps.append(("all-to-all", tuple(a for a in order if a in axes), gathered_tiles))
    # Axes that end up elsewhere in their own dimension: the devices are in another order.
    arrived = {dst_dim[a] for axes in moves.values() for a in axes}
    if swapped or reordered or any(_arrival_breaks_order(src, dst, dim) for dim in arrived):
        steps.append(("collective-permute", used, dst))
    return tuple(steps)


def _gather_all(src: ShardingSpec, mesh: LogicalMesh) -> tuple[_Step, ...]:
    """Every dimension gathered on its own, the last one first."""
    steps = []
    current = list(src.dims)
    for dim in reversed(range(src.rank)):
        if current[dim]:
            gathered = tuple(a for a in mesh.axis_names if a in current[dim])
            current[dim] = ()
            steps.append(("all-gather", gathered, ShardingSpec(tuple(current))))
    return tuple(steps)


def _arrival_breaks_order(src: ShardingSpec, dst: ShardingSpec, dim: int) -> bool:
    """Whether the axes of `dim` end up in another order than `dst` wants: those that stay
    come first, then those sliced out where nothing was, then those an all-to-all brings
    (it appends them as the minor-most axes of the dimension)."""
    have, want = src.dims[dim], dst.dims[dim]
    moved_in = set(src.used_axes)
    natural = (
        tuple(a for a in have if a in want)
        + tuple(a for a in want if a not in moved_in)
        + tuple(a for a in want if a in moved_in and a not in have)
    )
    return natural != want


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _pending_sums(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[_Step, ...]:
    """From or to a layout with pending sums (`ShardingSpec.unreduced`). The sums `dst` does
    not keep are done first, at `src`'s tiles: reduce-scattered over the axes `dst` splits a
    dimension over (each lands where `dst` has it, as the minor-most axis of that dimension),
    all-reduced over the others; then the tiles change as between reduced layouts. Sums `dst`
    starts over tiles it holds whole cost nothing: XLA keeps the value on one device of each
    group along those axes and zeros elsewhere, a local select (checked on jaxlib 0.10.2)."""
    order = mesh.axis_names
    done = [a for a in order if a in src.unreduced and a not in dst.unreduced]
    scattered = tuple(a for a in done if a in dst.used_axes)
    summed = tuple(a for a in done if a not in dst.used_axes)
    current = src.reduced()
    steps: list[_Step] = []
    if summed:
        steps.append(("all-reduce", summed, current))
    if scattered:
        steps.append(("reduce-scatter", scattered, current))
        dims = [list(axes) for axes in current.dims]
        for axis in scattered:
            dims[next(d for d, axes in enumerate(dst.dims) if axis in axes)].append(axis)
        current = ShardingSpec(tuple(map(tuple, dims)))
    return (*steps, *_steps(current, dst.reduced(), mesh))


def _without_trivial_axes(spec: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec:
    """`spec` without axes of size 1 (checking that every axis is on `mesh`)."""
    if all(mesh.axis(name).size > 1 for name in (*spec.used_axes, *spec.unreduced)):
        return spec
    return ShardingSpec(
        tuple(tuple(a for a in axes if mesh.axis(a).size > 1) for axes in spec.dims),
        tuple(a for a in spec.unreduced if mesh.axis(a).size > 1),
    )


def _check_rank(shape: tuple[int, ...], spec: ShardingSpec, what: str) -> None:
    if spec.rank != len(shape):
        raise ValueError(f"{what} {spec} has rank {spec.rank} but the tensor shape {shape} has rank {len(shape)}")
