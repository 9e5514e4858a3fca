"""XLA's GSPMD sharding text (`mhlo.sharding = "{...}"`), and conversion to and from sdy.

Older JAX exports and other frontends annotate tensors with XLA `HloSharding` strings. hlopar
treats them as user constraints like sdy shardings, so it must read every form XLA prints,
turn each into a mesh plus an sdy sharding that puts the same tile on the same device, and
write the sdy form back as the string XLA itself would print.

Device ids, in both GSPMD strings and sdy meshes, are *logical*: positions in the device
assignment the program is compiled for (that is how JAX writes them; a JAX mesh built from a
transposed device array lowers to the same strings as the untransposed one). The functions
here never mix logical and physical ids; a caller with physical ids uses them consistently
on both sides.

Conversion GSPMD -> sdy (`gspmd_to_sdy`) builds a fresh mesh named `axis_0`, `axis_1`, ...:

* tiled: when the device list is an iota, reshaped and transposed (all JAX and sdy-made
  shardings are), the mesh axes are the common refinement of the tile dimensions and the
  iota's reshape dimensions, ordered so the mesh's device order is the iota itself (no
  `device_ids`), and a tensor dimension may be split over several axes. Otherwise, or when
  that mesh cannot reproduce the exact tile order, one axis per tile dimension of size > 1
  and explicit `device_ids`. The replicated trailing tile dimension becomes axes that no
  dimension uses; an unreduced one becomes `unreduced={...}`; a manual one is reported as
  `ManualSharding` (sdy keeps manual axes on `sdy.manual_computation`, not on tensors).
* `{replicated}` -> the empty mesh `<[]>`; `{maximal device=d}` -> the maximal mesh
  `<[], device_ids=[d]>`; `{manual}` -> `ManualSharding` on `<[]>`; `{unknown}` -> all
  dimensions open (`{?}`), i.e. left to propagation. `{unreduced}` and tuples have no
  single-tensor sdy form and raise `ValueError`.

Printing (`format_gspmd`) gives XLA's text for the canonical value, with one deliberate
difference: a device list that is an iota always prints in iota form, where XLA keeps lists
it parsed explicitly (or materialized while sorting replicas) explicit. Both texts parse, in
XLA and here, to the same sharding.

Known non-identities of GSPMD -> sdy -> GSPMD, all meaning-preserving: a tiling over one
device (`{devices=[1]<=[1]}`) comes back as `{replicated}` (what JAX prints for it),
`{unknown}` as `{replicated}`, `{devices=[1,3]<=[3] last_tile_dims={unreduced}}` (which XLA
prints, but reads back as `{unreduced}`) as `{unreduced}`; `shard_as` / `shard_like` groups
and metadata are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hlopar.analysis.mesh import DeviceMesh, _Cursor
from hlopar.analysis.sharding import (
    AxisRef,
    DimSharding,
    ShardingSpec,
    TensorSharding,
    axes_index,
    axes_size,
    unused_axes,
)

__all__ = [
    "GspmdSharding",
    "ManualSharding",
    "format_gspmd",
    "gspmd_to_sdy",
    "iota_form",
    "parse_gspmd",
    "sdy_to_gspmd",
    "to_gspmd_sharding",
]

KINDS = ("replicated", "maximal", "manual", "unknown", "unreduced", "tiled", "tuple")
# Kinds of trailing "subgroup" tile dimensions, in the order XLA sorts them into.
SUBGROUP_KINDS = ("maximal", "manual", "unreduced", "replicated")
# A tiling whose data dimensions are all 1 and whose subgroups are all of one of these kinds is
# that kind; once size-1 subgroups of other kinds are dropped, XLA collapses only the second set.
_COLLAPSIBLE = ("manual", "unreduced", "replicated")
_COLLAPSIBLE_AFTER_DROP = ("manual", "replicated")


@dataclass(frozen=True)
class GspmdSharding:
    """One XLA HloSharding.

    `kind` is one of `KINDS`. For `tiled`: `tile_shape` has one entry per tensor dimension,
    then one per entry of `last_tile_dims` (the kind of each trailing subgroup dimension);
    `devices` is the device at each tile position, row-major over `tile_shape`. For
    `maximal`: `devices == (d,)`. For `tuple`: `elements`. `shard_group` keeps an
    `shard_as N` / `shard_like N` suffix verbatim. Use `canonical()` (or `parse_gspmd`, which
    returns canonical values) before comparing: XLA normalizes the same way.
    """

    kind: str
    tile_shape: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    last_tile_dims: tuple[str, ...] = ()
    elements: tuple[GspmdSharding, ...] = ()
    shard_group: str = ""
    # Set on values `canonical()` returned. XLA's normalization is not idempotent in one
    # corner (`{devices=[1,3]<=[3] last_tile_dims={unreduced}}` is printed, but parses as
    # `{unreduced}`), so a canonical value must not be normalized a second time.
    _is_canonical: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown GSPMD sharding kind {self.kind!r}; expected one of {KINDS}")
        for name in ("tile_shape", "devices", "last_tile_dims", "elements"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "tile_shape", tuple(int(t) for t in self.tile_shape))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if self.kind == "tiled":
            self._check_tiled()
        elif self.kind == "maximal":
            if len(self.devices) != 1 or self.devices[0] < 0:
                raise ValueError(f"a maximal sharding names one non-negative device, got {self.devices}")
        elif self.tile_shape or self.devices or self.last_tile_dims:
            raise ValueError(f"a {self.kind} sharding has no tile assignment")
        if self.elements and self.kind != "tuple":
            raise ValueError("only tuple shardings have elements")

    def _check_tiled(self) -> None:
        for kind in self.last_tile_dims:
            if kind not in SUBGROUP_KINDS:
                raise ValueError(f"unknown last tile dim kind {kind!r}; expected one of {SUBGROUP_KINDS}")
        if len(self.tile_shape) < len(self.last_tile_dims):
            raise ValueError(f"tile shape {list(self.tile_shape)} is shorter than last_tile_dims {self.last_tile_dims}")
        if any(t < 1 for t in self.tile_shape):
            raise ValueError(f"tile shape must be positive, got {list(self.tile_shape)}")
        if len(self.devices) != math.prod(self.tile_shape):
            raise ValueError(
                f"tile shape {list(self.tile_shape)} needs {math.prod(self.tile_shape)} devices, "
                f"got {len(self.devices)}"
            )
        if any(d < 0 for d in self.devices) or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"tile devices must be distinct and non-negative, got {list(self.devices)}")

    # --- constructors ------------------------------------------------------------------------

    @classmethod
    def replicated(cls) -> GspmdSharding:
        return cls("replicated")

    @classmethod
    def maximal(cls, device: int) -> GspmdSharding:
        return cls("maximal", devices=(device,))

    @classmethod
    def manual(cls) -> GspmdSharding:
        return cls("manual")

    @classmethod
    def tiled(
        cls,
        tile_shape: Sequence[int],
        devices: Sequence[int] | np.ndarray | None = None,
        last_tile_dims: Sequence[str] = (),
    ) -> GspmdSharding:
        """A tiling; `devices` defaults to the iota."""
        n = math.prod(tile_shape)
        ids = range(n) if devices is None else np.asarray(devices).ravel().tolist()
        return cls("tiled", tuple(tile_shape), tuple(ids), tuple(last_tile_dims))

    @classmethod
    def tuple_of(cls, elements: Sequence[GspmdSharding]) -> GspmdSharding:
        return cls("tuple", elements=tuple(elements))

    # --- views -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Number of tensor dimensions a tiled sharding covers."""
        return len(self.tile_shape) - len(self.last_tile_dims)

    @property
    def data_tile_shape(self) -> tuple[int, ...]:
        """How many pieces each tensor dimension is cut into."""
        return self.tile_shape[: self.rank]

    def device_array(self) -> np.ndarray:
        """`devices` shaped as `tile_shape`."""
        return np.array(self.devices, dtype=np.int64).reshape(self.tile_shape)

    def canonical(self) -> GspmdSharding:
        """The normal form XLA builds: subgroup dims of size 1 dropped, same kinds merged and
        sorted (manual, unreduced, replicated), the devices of each replication group sorted,
        trivial tilings collapsed to replicated / manual / unreduced."""
        if self._is_canonical:
            return self
        result = self._normalized()
        object.__setattr__(result, "_is_canonical", True)
        return result

    def _normalized(self) -> GspmdSharding:
        if self.kind == "tuple":
            return GspmdSharding.tuple_of([e.canonical() for e in self.elements])
        if self.kind != "tiled":
            return self
        rank, kinds = self.rank, self.last_tile_dims
        data = self.data_tile_shape
        collapse = math.prod(data) == 1 and len(set(kinds)) == 1 and kinds[0] in _COLLAPSIBLE
        if collapse:
            return GspmdSharding(kinds[0], shard_group=self.shard_group)
        keep = [i for i, k in enumerate(kinds) if self.tile_shape[rank + i] > 1]
        order = sorted(range(len(keep)), key=lambda j: SUBGROUP_KINDS.index(kinds[keep[j]]))
        array = self.device_array().reshape(data + tuple(self.tile_shape[rank + i] for i in keep))
        array = array.transpose(list(range(rank)) + [rank + j for j in order])
        merged_kinds: list[str] = []
        merged_sizes: list[int] = []
        for j in order:
            kind, size = kinds[keep[j]], self.tile_shape[rank + keep[j]]
            if merged_kinds and merged_kinds[-1] == kind:
                merged_sizes[-1] *= size
            else:
                merged_kinds.append(kind)
                merged_sizes.append(size)
        if math.prod(data) == 1 and len(merged_kinds) == 1 and merged_kinds[0] in _COLLAPSIBLE_AFTER_DROP:
            return GspmdSharding(merged_kinds[0], shard_group=self.shard_group)
        shape = data + tuple(merged_sizes)
        array = array.reshape(shape)
        if merged_kinds and merged_kinds[-1] == "replicated":
            # Which replica sits where within a group means nothing; XLA sorts each group.
            array = np.sort(array, axis=-1)
        return GspmdSharding(
            "tiled", shape, tuple(array.reshape(-1).tolist()), tuple(merged_kinds), shard_group=self.shard_group
        )

    def __str__(self) -> str:
        return format_gspmd(self)

    @classmethod
    def parse(cls, text: str) -> GspmdSharding:
        return parse_gspmd(text)


# --- iota device lists ---------------------------------------------------------------------


def _iota_digits(devices: Sequence[int]) -> list[tuple[int, int]] | None:
    """Split tile positions into mixed-radix digits (size, device stride), major first.

    A device list is an iota, reshaped and transposed, exactly when the device at each
    position is a sum of digit * stride over such digits with strides of an iota. Digits are
    merged as far as possible, which is what makes the printed form unique.
    """
    n = len(devices)
    if sorted(devices) != list(range(n)):
        return None
    digits: list[tuple[int, int]] = []  # minor first while building
    block = 1
    while block < n:
        stride = devices[block]
        size = 1
        while block * size < n and devices[block * size] == size * stride:
            size += 1
        if size < 2 or (n // block) % size:
            return None
        digits.append((size, stride))
        block *= size
    digits.reverse()
    rebuilt = np.zeros(1, dtype=np.int64)
    for size, stride in digits:
        rebuilt = (rebuilt[:, None] + np.arange(size) * stride).reshape(-1)
    if rebuilt.tolist() != list(devices):
        return None
    expected = 1
    for size, stride in sorted(digits, key=lambda d: d[1]):
        if stride != expected:
            return None
        expected *= size
    return digits


def iota_form(devices: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reshape_dims, transpose_perm) with `devices == iota(n).reshape(dims).transpose(perm)`
    in XLA's canonical form (perm `()` when no transpose is needed), or None."""
    digits = _iota_digits(devices)
    if digits is None:
        return None
    if len(digits) <= 1:
        return (len(devices),), ()
    by_stride = sorted(range(len(digits)), key=lambda i: -digits[i][1])
    dims = tuple(digits[i][0] for i in by_stride)
    perm = tuple(by_stride.index(i) for i in range(len(digits)))
    return dims, perm


# --- text ----------------------------------------------------------------------------------


def format_gspmd(sharding: GspmdSharding, *, iota: bool = True) -> str:
    """XLA's text for a sharding, canonicalized first.

    Device lists print in iota form `<=[...]T(...)` when they are one (as XLA does for every
    sharding it builds itself), explicitly otherwise or when `iota=False` (except a lone
    device, which XLA's parser only accepts as `<=[1]`).
    """
    s = sharding.canonical()
    group = f" {s.shard_group}" if s.shard_group else ""
    if s.kind == "tuple":
        parts = []
        for i, element in enumerate(s.elements):
            prefix = "" if i == 0 else f", /*index={i}*/" if i % 5 == 0 else ", "
            parts.append(prefix + format_gspmd(element, iota=iota))
        return "{" + "".join(parts) + "}"
    if s.kind == "maximal":
        return f"{{maximal device={s.devices[0]}{group}}}"
    if s.kind != "tiled":
        return f"{{{s.kind}{group}}}"
    text = "{devices=[" + ",".join(map(str, s.tile_shape)) + "]"
    form = iota_form(s.devices) if iota or len(s.devices) == 1 else None
    if form is None:
        text += ",".join(map(str, s.devices))
    else:
        dims, perm = form
        text += "<=[" + ",".join(map(str, dims)) + "]"
        if perm:
            text += "T(" + ",".join(map(str, perm)) + ")"
    if s.last_tile_dims == ("replicated",):
        text += " last_tile_dim_replicate"
    elif s.last_tile_dims:
        text += " last_tile_dims={" + ", ".join(s.last_tile_dims) + "}"
    return text + group + "}"


def parse_gspmd(text: str) -> GspmdSharding:
    """Parse any HloSharding text XLA prints or accepts; metadata is skipped.

    The result is canonical (see `GspmdSharding.canonical`), as XLA's own parser makes it.
    """
    cursor = _Cursor(text, "GSPMD sharding")
    if cursor.at_end():
        raise cursor.fail("empty text (no sharding)")
    sharding = _parse_sharding(cursor)
    cursor.expect_end()
    return sharding.canonical()


def _parse_sharding(cursor: _Cursor) -> GspmdSharding:
    cursor.expect("{")
    if cursor.accept("}"):
        return GspmdSharding.tuple_of(())
    if cursor.peek("{"):
        elements = [_parse_sharding(cursor)]
        while cursor.accept(","):
            _skip_comment(cursor)
            elements.append(_parse_sharding(cursor))
        cursor.expect("}")
        return GspmdSharding.tuple_of(elements)
    kind = None
    tile_shape: list[int] = []
    devices: list[int] = []
    last_tile_dims: list[str] = []
    shard_group = ""
    while not cursor.accept("}"):
        word = cursor.word()
        if word in ("replicated", "manual", "unknown", "unreduced", "maximal"):
            kind = _set_once(cursor, kind, word)
        elif word == "device":
            cursor.expect("=")
            devices = [_non_negative(cursor)]
        elif word == "devices":
            kind = _set_once(cursor, kind, "tiled")
            cursor.expect("=")
            tile_shape, devices = _parse_tile_assignment(cursor)
        elif word == "last_tile_dim_replicate":
            last_tile_dims = ["replicated"]
        elif word == "last_tile_dims":
            cursor.expect("=")
            cursor.expect("{")
            last_tile_dims = []
            if not cursor.accept("}"):
                while True:
                    last_tile_dims.append(cursor.word())
                    if cursor.accept("}"):
                        break
                    cursor.expect(",")
        elif word in ("shard_as", "shard_like"):
            shard_group = f"{word} {_non_negative(cursor)}"
        elif word == "metadata":
            cursor.expect("=")
            _skip_braces(cursor)
        else:
            raise cursor.fail(f"unknown sharding attribute {word!r}")
    if kind is None:
        raise cursor.fail("no sharding kind (replicated, maximal, manual, unknown, unreduced or devices=)")
    if kind == "maximal" and len(devices) != 1:
        raise cursor.fail("maximal sharding needs 'device=N'")
    if kind not in ("maximal", "tiled") and (devices or last_tile_dims):
        raise cursor.fail(f"{kind} sharding takes no devices")
    try:
        if kind == "tiled":
            return GspmdSharding(
                "tiled", tuple(tile_shape), tuple(devices), tuple(last_tile_dims), shard_group=shard_group
            )
        return GspmdSharding(kind, devices=tuple(devices), shard_group=shard_group)
    except ValueError as err:
        raise cursor.fail(str(err)) from None


def _set_once(cursor: _Cursor, kind: str | None, new: str) -> str:
    if kind is not None:
        raise cursor.fail(f"sharding is both {kind} and {new}")
    return new


def _non_negative(cursor: _Cursor) -> int:
    value = cursor.integer()
    if value < 0:
        raise cursor.fail(f"expected a non-negative integer, got {value}")
    return value


def _int_list(cursor: _Cursor, close: str) -> list[int]:
    if cursor.accept(close):
        return []
    values = [_non_negative(cursor)]
    while cursor.accept(","):
        values.append(_non_negative(cursor))
    cursor.expect(close)
    return values


def _parse_tile_assignment(cursor: _Cursor) -> tuple[list[int], list[int]]:
    """`[dims]d0,d1,...` or `[dims]<=[reshape]` with an optional `T(perm)`."""
    cursor.expect("[")
    dims = _int_list(cursor, "]")
    n = math.prod(dims)
    if not cursor.accept("<="):
        devices = [_non_negative(cursor)]
        while cursor.accept(","):
            devices.append(_non_negative(cursor))
        return dims, devices
    cursor.expect("[")
    reshape = _int_list(cursor, "]")
    perm = list(range(len(reshape)))
    if cursor.accept("T"):
        cursor.expect("(")
        perm = _int_list(cursor, ")")
    if math.prod(reshape) != n:
        raise cursor.fail(f"iota reshape {reshape} does not hold the {n} devices of tile {dims}")
    if sorted(perm) != list(range(len(reshape))):
        raise cursor.fail(f"transpose {perm} is not a permutation of the reshape dims {reshape}")
    devices = np.arange(n).reshape(reshape).transpose(perm).reshape(-1).tolist()
    return dims, devices


def _skip_comment(cursor: _Cursor) -> None:
    """XLA prints `/*index=5*/` before every fifth tuple element."""
    if cursor.accept("/*"):
        end = cursor.text.find("*/", cursor.pos)
        if end < 0:
            raise cursor.fail("unterminated comment")
        cursor.pos = end + 2


def _skip_braces(cursor: _Cursor) -> None:
    """Skip a balanced `{...}` group (metadata), honouring quoted strings."""
    cursor.expect("{")
    depth = 1
    while depth:
        if cursor.pos >= len(cursor.text):
            raise cursor.fail("unterminated '{'")
        char = cursor.text[cursor.pos]
        if char == '"':
            cursor.string()
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        cursor.pos += 1


# --- sdy <-> GSPMD -------------------------------------------------------------------------


@dataclass(frozen=True)
class ManualSharding:
    """A GSPMD sharding that is manual on some axes; `kind == "manual"` marks it.

    sdy has no tensor sharding for manual axes: they belong to the `sdy.manual_computation`
    around the value. `manual_axes` are the mesh axes that are manual (empty on the empty mesh
    means every device, GSPMD's `{manual}`); `sharding` is the layout over the other axes.
    """

    manual_axes: tuple[str, ...]
    sharding: TensorSharding
    kind: str = field(default="manual", init=False)


SdySharding = TensorSharding | ShardingSpec | ManualSharding


def gspmd_to_sdy(
    sharding: GspmdSharding | str, rank: int | None = None, mesh_name: str = "mesh"
) -> tuple[DeviceMesh, TensorSharding | ManualSharding]:
    """A mesh and an sdy sharding on it (referring to it as `@mesh_name`) that give every
    device the same tile as `sharding`. See the module docstring for each kind."""
    gs = parse_gspmd(sharding) if isinstance(sharding, str) else sharding.canonical()
    if gs.kind == "tuple":
        raise ValueError("a tuple sharding has one sharding per element: convert each element")
    if gs.kind == "tiled":
        if rank is not None and rank != gs.rank:
            raise ValueError(f"sharding {format_gspmd(gs)} is for rank {gs.rank}, not {rank}")
        if "maximal" in gs.last_tile_dims:
            raise ValueError(f"{format_gspmd(gs)}: maximal subgroups have no sdy form")
        return _tiled_to_sdy(gs, mesh_name)
    if rank is None:
        raise ValueError(f"converting {format_gspmd(gs)} needs the tensor rank")
    closed = tuple(DimSharding() for _ in range(rank))
    if gs.kind == "replicated":
        return DeviceMesh(), TensorSharding(mesh_name, closed)
    if gs.kind == "maximal":
        return DeviceMesh((), gs.devices), TensorSharding(mesh_name, closed)
    if gs.kind == "unknown":
        return DeviceMesh(), TensorSharding(mesh_name, tuple(DimSharding(is_closed=False) for _ in range(rank)))
    if gs.kind == "manual":
        return DeviceMesh(), ManualSharding((), TensorSharding(mesh_name, closed))
    raise ValueError(f"{format_gspmd(gs)} has no sdy form without a mesh (unreduced on every device)")


def _tiled_to_sdy(gs: GspmdSharding, mesh_name: str) -> tuple[DeviceMesh, TensorSharding | ManualSharding]:
    if math.prod(gs.data_tile_shape) == 1 and not gs.last_tile_dims:
        # One device: the same layout as replicated, and what JAX prints for it.
        return DeviceMesh(), TensorSharding(mesh_name, tuple(DimSharding() for _ in range(gs.rank)))
    target = _layout(gs)
    factors = iota_factors(gs)
    if factors is not None:
        order = sorted(range(len(factors)), key=lambda i: -factors[i][2])
        result = _factors_to_sdy(gs, factors, order, None, mesh_name)
        if _layout(to_gspmd_sharding(*result)) == target:
            return result
    # Fallback: one axis per tile dimension, in tile order, with explicit device ids.
    factors = [(size, group, 0) for group, size in enumerate(gs.tile_shape) if size > 1]
    result = _factors_to_sdy(gs, factors, list(range(len(factors))), gs.devices, mesh_name)
    if _layout(to_gspmd_sharding(*result)) != target:  # pragma: no cover - would be a bug here
        raise AssertionError(f"internal error converting {format_gspmd(gs)} to sdy")
    return result


def _layout(gs: GspmdSharding) -> GspmdSharding:
    """A key equal for shardings that put the same tiles on the same devices."""
    return GspmdSharding(gs.kind, gs.tile_shape, gs.devices, gs.last_tile_dims).canonical()


def iota_factors(gs: GspmdSharding) -> list[tuple[int, int, int]] | None:
    """(size, tile dim, device stride) per mesh axis, in tile-position order, or None.

    The common refinement of the tile dims and the iota digits, walked from the minor end:
    at each step the smaller remaining piece must divide the larger one.
    """
    digits = _iota_digits(gs.devices)
    if digits is None:
        return None
    tiles = [(size, group) for group, size in enumerate(gs.tile_shape) if size > 1]
    factors: list[tuple[int, int, int]] = []
    digits = list(digits)
    while tiles and digits:
        (t_size, group), (d_size, stride) = tiles[-1], digits[-1]
        piece = min(t_size, d_size)
        if max(t_size, d_size) % piece:
            return None
        factors.append((piece, group, stride))
        tiles[-1] = (t_size // piece, group)
        digits[-1] = (d_size // piece, stride * piece)
        if tiles[-1][0] == 1:
            tiles.pop()
        if digits[-1][0] == 1:
            digits.pop()
    factors.reverse()
    return factors


def _factors_to_sdy(
    gs: GspmdSharding,
    factors: list[tuple[int, int, int]],
    order: list[int],
    device_ids: Sequence[int] | None,
    mesh_name: str,
) -> tuple[DeviceMesh, TensorSharding | ManualSharding]:
    """Mesh axes `axis_k` for `factors[order[k]]`, and the sharding that uses them."""
    names = {f: f"axis_{k}" for k, f in enumerate(order)}
    mesh = DeviceMesh(tuple((names[f], factors[f][0]) for f in order), device_ids)
    groups: dict[int, list[str]] = {}
    for f, (_, group, _) in enumerate(factors):
        groups.setdefault(group, []).append(names[f])

    def in_mesh_order(group: int) -> tuple[str, ...]:
        return tuple(sorted(groups.get(group, []), key=mesh.axis_index))

    rank = gs.rank
    dims = tuple(DimSharding(tuple(AxisRef(n) for n in groups.get(d, []))) for d in range(rank))
    unreduced: tuple[str, ...] = ()
    manual: tuple[str, ...] = ()
    for j, kind in enumerate(gs.last_tile_dims):
        if kind == "unreduced":
            unreduced = in_mesh_order(rank + j)
        elif kind == "manual":
            manual = in_mesh_order(rank + j)
    sharding = TensorSharding(mesh_name, dims, unreduced_axes=tuple(AxisRef(n) for n in unreduced))
    return mesh, (ManualSharding(manual, sharding) if manual else sharding)


def to_gspmd_sharding(mesh: DeviceMesh | None, sharding: SdySharding, rank: int | None = None) -> GspmdSharding:
    """The GSPMD sharding that gives each device of `mesh` the tile `sharding` gives it.

    Tile dimensions list a tensor dimension's axes in the order written (first = major); then
    manual axes, unreduced axes, and the unused axes (replication), each in mesh order — the
    same layout JAX produces. Open dimensions and priorities do not change the layout.
    """
    is_manual = isinstance(sharding, ManualSharding)
    manual: tuple[str, ...] = ()
    if isinstance(sharding, ManualSharding):
        manual, sharding = sharding.manual_axes, sharding.sharding
    if isinstance(sharding, ShardingSpec):
        if mesh is None:
            raise ValueError("a sharding spec needs a mesh")
        sharding = TensorSharding.from_spec(mesh, sharding)
    mesh = sharding.resolve_mesh(mesh)
    if rank is not None and rank != sharding.rank:
        raise ValueError(f"sharding {sharding} has rank {sharding.rank}, not {rank}")
    manual_refs = tuple(AxisRef(name) for name in manual)
    dim_refs = list(sharding.dim_axes)
    used = [r for refs in dim_refs for r in refs] + list(manual_refs) + list(sharding.unreduced_axes)
    unused_axes(mesh, used + list(sharding.replicated_axes))  # raises if an axis is used twice
    free = unused_axes(mesh, used)  # explicitly replicated axes replicate like unused ones
    groups = dim_refs[:]
    kinds: list[str] = []
    for kind, refs in (("manual", manual_refs), ("unreduced", sharding.unreduced_axes), ("replicated", free)):
        if refs:
            groups.append(tuple(refs))
            kinds.append(kind)
    if not mesh.axes:
        if is_manual or mesh.device_ids is None:
            return GspmdSharding("manual" if is_manual else "replicated")
        return GspmdSharding.maximal(mesh.device_ids[0])
    if is_manual and not manual:
        raise ValueError("a manual sharding on a mesh with axes must name its manual axes")
    if math.prod(axes_size(mesh, g) for g in dim_refs) == 1 and not manual and not sharding.unreduced_axes:
        return GspmdSharding.replicated()
    tile_shape = tuple(axes_size(mesh, g) for g in groups)
    array = np.full(tile_shape, -1, dtype=np.int64)
    devices = mesh.devices()
    for index in np.ndindex(*mesh.shape):
        coords = dict(zip(mesh.axis_names, index))
        array[tuple(axes_index(mesh, g, coords) for g in groups)] = devices[index]
    return GspmdSharding("tiled", tile_shape, tuple(array.reshape(-1).tolist()), tuple(kinds)).canonical()


def sdy_to_gspmd(mesh: DeviceMesh | None, sharding: SdySharding, rank: int | None = None) -> str:
    """XLA's text for `to_gspmd_sharding(mesh, sharding, rank)`."""
    return format_gspmd(to_gspmd_sharding(mesh, sharding, rank))
