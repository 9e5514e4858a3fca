"""Sharding specs: the papers' per-dimension form, and Shardy's `#sdy.sharding` attribute.

`ShardingSpec` is what the planning passes reason about: for each tensor dimension, the mesh
axes it is split over, major to minor (`S^0`, `S^01`, `R` in the papers). `TensorSharding` is
the full `#sdy.sharding<...>` attribute with everything Shardy can say (sub-axes, open
dimensions, priorities, explicitly replicated and unreduced axes); it parses and prints
exactly the text jaxlib prints, so annotations survive a round trip through hlopar unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hlopar.analysis.hashing import cached_hash, state_without_hash
from hlopar.analysis.mesh import DeviceMesh, _Cursor, format_symbol, parse_mesh_body, quote_string

__all__ = [
    "AxisRef",
    "DimSharding",
    "ShardingPerValue",
    "ShardingSpec",
    "TensorSharding",
    "axes_index",
    "axes_size",
    "unused_axes",
]

_MAX_PRIORITY = 2**63 - 1  # sdy stores priorities as int64


# --- the papers' spec --------------------------------------------------------------------


@dataclass(frozen=True)
class ShardingSpec:
    """Per tensor dimension, the mesh axes it is split over, major to minor; `()` = replicated.

    Printed as `[S(x), R]`: `S(...)` lists the axes of a split dimension (`S(x,y)`: x major,
    y minor), `R` marks a dimension that every device holds whole. Axes that no dimension uses
    replicate the tensor. `paper_str(mesh)` gives the papers' own `S0R` / `S01R` form.

    `unreduced`: mesh axes over which the value is a pending sum (GSPMD's partial, Shardy's
    `unreduced={...}`): the devices along them hold addends whose sum is the value, as a
    matrix product that splits its contracting dimension leaves them before its all-reduce.
    Printed after the dimensions: `[S(x), R] U(y)`.
    """

    dims: tuple[tuple[str, ...], ...]
    unreduced: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        dims = tuple(tuple(axes) for axes in self.dims)
        unreduced = tuple(self.unreduced)
        names = [name for axes in dims for name in axes]
        for name in names + list(unreduced):
            if not isinstance(name, str) or not name:
                raise ValueError(f"sharding spec axes are non-empty strings, got {name!r}")
        if len(set(names)) != len(names):
            duplicates = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"mesh axes {duplicates} split more than one dimension (or one twice)")
        if set(unreduced) & set(names) or len(set(unreduced)) != len(unreduced):
            raise ValueError(f"unreduced axes {list(unreduced)} must be distinct and split no dimension")
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "unreduced", unreduced)
        object.__setattr__(self, "_used_axes", tuple(names))

    # Specs key the cost model's caches (`auto_sharding.resharding`): hashed once.
    __hash__ = cached_hash
    __getstate__ = state_without_hash

    @classmethod
    def replicated(cls, rank: int) -> ShardingSpec:
        return cls(((),) * rank)

    @classmethod
    def of(cls, *dims: str | Sequence[str] | None) -> ShardingSpec:
        """Like `PartitionSpec`: `ShardingSpec.of("x", None, ("y", "z"))`."""
        return cls(tuple(() if d is None else (d,) if isinstance(d, str) else tuple(d) for d in dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> tuple[str, ...]:
        """Axes that split some dimension, in order of appearance."""
        return self._used_axes

    @property
    def is_replicated(self) -> bool:
        """Every device holds the whole value (no split, no pending sum)."""
        return not self.used_axes and not self.unreduced

    def reduced(self) -> ShardingSpec:
        """The same tiles with the pending sums done."""
        return ShardingSpec(self.dims) if self.unreduced else self

    def num_shards(self, mesh: DeviceMesh, dim: int) -> int:
        """How many pieces dimension `dim` is cut into."""
        return math.prod(mesh.axis_size(name) for name in self.dims[dim])

    def check(self, mesh: DeviceMesh) -> None:
        """Raise `ValueError` unless every axis named here is an axis of `mesh`."""
        for name in self.used_axes:
            mesh.axis_index(name)

    def __str__(self) -> str:
        text = "[" + ", ".join(f"S({','.join(axes)})" if axes else "R" for axes in self.dims) + "]"
        return text + f" U({','.join(self.unreduced)})" if self.unreduced else text

    def paper_str(self, mesh: DeviceMesh) -> str:
        """The papers' notation with mesh axis numbers: `S0R`, `RS1`, `S01R` (`S1,0` past 9 axes)."""
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("R")
                continue
            numbers = [str(mesh.axis_index(name)) for name in axes]
            parts.append("S" + ("," if mesh.ndim > 10 else "").join(numbers))
        return "".join(parts)

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """Parse the `[S(x), R]` (or `[S(x), R] U(y)`) form that `str()` prints."""
        text = text.strip()
        unreduced: tuple[str, ...] = ()
        match = re.fullmatch(r"(.*\])\s*U\(([^()]*)\)", text)
        if match:
            text, names = match.group(1).strip(), match.group(2)
            unreduced = tuple(name.strip() for name in names.split(","))
            return cls(cls.parse(text).dims, unreduced)
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError(f"invalid sharding spec {text!r}: expected '[...]'")
        body = text[1:-1].strip()
        if not body:
            return cls(())
        dims = []
        for part in re.split(r",(?![^()]*\))", body):
            part = part.strip()
            if part == "R":
                dims.append(())
                continue
            match = re.fullmatch(r"S\(([^()]*)\)", part)
            if not match or not match.group(1).strip():
                raise ValueError(f"invalid sharding spec {text!r}: bad dimension {part!r}")
            dims.append(tuple(name.strip() for name in match.group(1).split(",")))
        return cls(tuple(dims))


# --- sdy attribute -----------------------------------------------------------------------


@dataclass(frozen=True)
class AxisRef:
    """A mesh axis, or a sub-axis of it: `"x"` or `"x":(pre_size)size`.

    A sub-axis `(p)s` of an axis of size n is the piece of size s that has p devices' worth of
    the axis to its major side: `"x":(1)2` is the major half of x=4, `"x":(2)2` the minor half.
    """

    name: str
    sub: tuple[int, int] | None = None  # (pre_size, size)

    def __post_init__(self) -> None:
        if self.sub is not None:
            pre, size = self.sub
            if pre < 1 or size < 1:
                raise ValueError(f"sub-axis of {self.name!r} needs positive pre-size and size, got {self.sub}")
            object.__setattr__(self, "sub", (int(pre), int(size)))

    def size(self, mesh: DeviceMesh) -> int:
        lo, hi = self.span(mesh)
        return hi // lo

    def span(self, mesh: DeviceMesh) -> tuple[int, int]:
        """(pre_size, pre_size * size): the part of the axis covered, as cumulative sizes."""
        full = mesh.axis_size(self.name)
        if self.sub is None:
            return 1, full
        pre, size = self.sub
        if full % (pre * size):
            raise ValueError(f"sub-axis {self} does not divide axis {self.name!r} of size {full}")
        return pre, pre * size

    def index(self, mesh: DeviceMesh, coords: Mapping[str, int]) -> int:
        """Which piece of this (sub-)axis a device with these mesh coordinates is in."""
        lo, hi = self.span(mesh)
        return (coords[self.name] // (mesh.axis_size(self.name) // hi)) % (hi // lo)

    def format(self) -> str:
        text = quote_string(self.name)
        if self.sub is not None:
            text += f":({self.sub[0]}){self.sub[1]}"
        return text

    def __str__(self) -> str:
        return self.format()


def axes_size(mesh: DeviceMesh, refs: Sequence[AxisRef]) -> int:
    """Total number of pieces a list of (sub-)axes cuts into."""
    return math.prod(ref.size(mesh) for ref in refs)


def axes_index(mesh: DeviceMesh, refs: Sequence[AxisRef], coords: Mapping[str, int]) -> int:
    """A device's piece index over several (sub-)axes, the first one major."""
    index = 0
    for ref in refs:
        index = index * ref.size(mesh) + ref.index(mesh, coords)
    return index


def unused_axes(mesh: DeviceMesh, used: Sequence[AxisRef]) -> tuple[AxisRef, ...]:
    """The (sub-)axes of `mesh` that `used` leaves free, in mesh order, major first.

    These are the axes over which a tensor is replicated. Raises `ValueError` when `used`
    names an axis twice or overlapping sub-axes.
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for ref in used:
        spans.setdefault(ref.name, []).append(ref.span(mesh))
    free: list[AxisRef] = []
    for name, full in mesh.axes:
        taken = sorted(spans.get(name, []))
        for (_, hi1), (lo2, _) in zip(taken, taken[1:]):
            if lo2 < hi1:
                raise ValueError(f"axis {name!r} is used twice (overlapping pieces {taken})")
        cursor = 1
        for lo, hi in taken + [(full, full)]:
            if lo > cursor:
                if lo % cursor:
                    raise ValueError(f"pieces {taken} of axis {name!r} do not nest")
                free.append(AxisRef(name) if (cursor, lo) == (1, full) else AxisRef(name, (cursor, lo // cursor)))
            cursor = max(cursor, hi)
    return tuple(free)


@dataclass(frozen=True)
class DimSharding:
    """One tensor dimension of an sdy sharding: `{"x", "y"}`, open `{"x", ?}`, priority `p1`."""

    axes: tuple[AxisRef, ...] = ()
    is_closed: bool = True
    priority: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(_as_ref(a) for a in self.axes))
        if self.priority is not None and not 0 <= self.priority <= _MAX_PRIORITY:
            raise ValueError(f"priority must be a non-negative int64, got {self.priority}")

    def format(self) -> str:
        items = [ref.format() for ref in self.axes] + ([] if self.is_closed else ["?"])
        text = "{" + ", ".join(items) + "}"
        return text if self.priority is None else f"{text}p{self.priority}"


@dataclass(frozen=True)
class TensorSharding:
    """`#sdy.sharding<@mesh, [dims], replicated={...}, unreduced={...}>`.

    `mesh` is the name of an `sdy.mesh` symbol, or an inlined `DeviceMesh`. Axis lists may be
    given as strings; they are stored as `AxisRef`s.
    """

    mesh: str | DeviceMesh
    dims: tuple[DimSharding, ...]
    replicated_axes: tuple[AxisRef, ...] = ()
    unreduced_axes: tuple[AxisRef, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        object.__setattr__(self, "replicated_axes", tuple(_as_ref(a) for a in self.replicated_axes))
        object.__setattr__(self, "unreduced_axes", tuple(_as_ref(a) for a in self.unreduced_axes))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def mesh_name(self) -> str | None:
        return self.mesh if isinstance(self.mesh, str) else None

    def resolve_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh:
        """The mesh to interpret this sharding on: the inlined one, else `mesh`."""
        if isinstance(self.mesh, DeviceMesh):
            if mesh is not None and mesh != self.mesh:
                raise ValueError(f"sharding inlines mesh {self.mesh} but mesh {mesh} was given")
            return self.mesh
        if mesh is None:
            raise ValueError(f"sharding refers to mesh @{self.mesh}; pass that mesh")
        return mesh

    @property
    def dim_axes(self) -> tuple[tuple[AxisRef, ...], ...]:
        return tuple(dim.axes for dim in self.dims)

    def check(self, mesh: DeviceMesh | None = None) -> None:
        """Raise `ValueError` unless the axes exist, sub-axes divide and nothing is used twice."""
        mesh = self.resolve_mesh(mesh)
        refs = [ref for axes in self.dim_axes for ref in axes]
        unused_axes(mesh, refs + list(self.replicated_axes) + list(self.unreduced_axes))

    # spec conversion

    @classmethod
    def from_spec(cls, mesh: str | DeviceMesh, spec: ShardingSpec) -> TensorSharding:
        """Closed dimensions over whole axes, as the passes write them."""
        dims = tuple(DimSharding(tuple(AxisRef(n) for n in axes)) for axes in spec.dims)
        return cls(mesh, dims, unreduced_axes=tuple(AxisRef(n) for n in spec.unreduced))

    def to_spec(self) -> ShardingSpec:
        """The papers' spec; open/closed, priorities and explicit replication do not change the
        layout and are dropped. Sub-axes have no spec form: `ValueError`."""
        if any(ref.sub is not None for ref in self.unreduced_axes):
            raise ValueError(f"{self} uses sub-axes, which a sharding spec cannot express")
        dims = []
        for dim in self.dims:
            if any(ref.sub is not None for ref in dim.axes):
                raise ValueError(f"{self} uses sub-axes, which a sharding spec cannot express")
            dims.append(tuple(ref.name for ref in dim.axes))
        return ShardingSpec(tuple(dims), tuple(ref.name for ref in self.unreduced_axes))

    # text

    def format(self) -> str:
        return "#sdy.sharding<" + self.format_body() + ">"

    def format_body(self) -> str:
        """The part between the angle brackets (also the per-value element form `<...>`)."""
        mesh = format_symbol(self.mesh) if isinstance(self.mesh, str) else "mesh" + self.mesh.to_sdy()
        text = mesh + ", [" + ", ".join(dim.format() for dim in self.dims) + "]"
        if self.replicated_axes:
            text += ", replicated={" + ", ".join(ref.format() for ref in self.replicated_axes) + "}"
        if self.unreduced_axes:
            text += ", unreduced={" + ", ".join(ref.format() for ref in self.unreduced_axes) + "}"
        return text

    def __str__(self) -> str:
        return self.format()

    @classmethod
    def parse(cls, text: str) -> TensorSharding:
        """Parse `#sdy.sharding<...>` (or just `<...>`)."""
        cursor = _Cursor(text, "sdy sharding")
        cursor.accept("#sdy.sharding")
        sharding = _parse_tensor_sharding(cursor)
        cursor.expect_end()
        return sharding


@dataclass(frozen=True)
class ShardingPerValue:
    """`#sdy.sharding_per_value<[<@mesh, [...]>, ...]>`: one sharding per op result."""

    shardings: tuple[TensorSharding, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shardings", tuple(self.shardings))

    def __iter__(self) -> Iterator[TensorSharding]:
        return iter(self.shardings)

    def __len__(self) -> int:
        return len(self.shardings)

    def __getitem__(self, index: int) -> TensorSharding:
        return self.shardings[index]

    def format(self) -> str:
        return "#sdy.sharding_per_value<[" + ", ".join(f"<{s.format_body()}>" for s in self.shardings) + "]>"

    def __str__(self) -> str:
        return self.format()

    @classmethod
    def parse(cls, text: str) -> ShardingPerValue:
        """Parse the attribute; elements may also be written `#sdy.sharding<...>`."""
        cursor = _Cursor(text, "sdy sharding_per_value")
        cursor.accept("#sdy.sharding_per_value")
        cursor.expect("<")
        cursor.expect("[")
        shardings = []
        if not cursor.accept("]"):
            while True:
                cursor.accept("#sdy.sharding")
                shardings.append(_parse_tensor_sharding(cursor))
                if cursor.accept("]"):
                    break
                cursor.expect(",")
        cursor.expect(">")
        cursor.expect_end()
        return cls(tuple(shardings))


def _as_ref(axis: AxisRef | str) -> AxisRef:
    if isinstance(axis, AxisRef):
        return axis
    if isinstance(axis, str) and axis:
        return AxisRef(axis)
    raise ValueError(f"expected an axis name or AxisRef, got {axis!r}")


def _parse_tensor_sharding(cursor: _Cursor) -> TensorSharding:
    cursor.expect("<")
    if cursor.peek("@"):
        mesh: str | DeviceMesh = cursor.symbol()
    elif cursor.accept("mesh"):
        mesh = parse_mesh_body(cursor)
    else:
        raise cursor.fail("expected a mesh symbol '@name' or an inlined 'mesh<...>'")
    cursor.expect(",")
    cursor.expect("[")
    dims = []
    if not cursor.accept("]"):
        while True:
            dims.append(_parse_dim(cursor))
            if cursor.accept("]"):
                break
            cursor.expect(",")
    lists: dict[str, tuple[AxisRef, ...]] = {}
    while cursor.accept(","):
        keyword = cursor.word()
        if keyword not in ("replicated", "unreduced") or keyword in lists:
            raise cursor.fail(f"unexpected {keyword!r}: expected replicated={{...}} or unreduced={{...}}, once each")
        cursor.expect("=")
        cursor.expect("{")
        refs = [_parse_axis_ref(cursor)]
        while cursor.accept(","):
            refs.append(_parse_axis_ref(cursor))
        cursor.expect("}")
        lists[keyword] = tuple(refs)
    cursor.expect(">")
    return TensorSharding(mesh, tuple(dims), lists.get("replicated", ()), lists.get("unreduced", ()))


def _parse_dim(cursor: _Cursor) -> DimSharding:
    cursor.expect("{")
    refs: list[AxisRef] = []
    closed = True
    if not cursor.accept("}"):
        while True:
            if cursor.accept("?"):
                closed = False
                cursor.expect("}")
                break
            refs.append(_parse_axis_ref(cursor))
            if cursor.accept("}"):
                break
            cursor.expect(",")
    priority = None
    cursor.skip_ws()
    if cursor.text.startswith("p", cursor.pos):
        cursor.pos += 1
        match = re.compile(r"0|[1-9][0-9]*").match(cursor.text, cursor.pos)
        if not match or (match.end() < len(cursor.text) and cursor.text[match.end()].isalnum()):
            raise cursor.fail("expected a priority 'p<number>' without leading zeros")
        cursor.pos = match.end()
        priority = int(match.group())
        if priority > _MAX_PRIORITY:
            raise cursor.fail(f"priority {priority} does not fit in int64")
    return DimSharding(tuple(refs), closed, priority)


def _parse_axis_ref(cursor: _Cursor) -> AxisRef:
    name = cursor.string()
    if not cursor.accept(":"):
        return AxisRef(name)
    cursor.expect("(")
    pre = cursor.integer()
    cursor.expect(")")
    size = cursor.integer()
    try:
        return AxisRef(name, (pre, size))
    except ValueError as err:
        raise cursor.fail(str(err)) from None
