"""N-dimensional device meshes with named axes, and their `sdy.mesh` text.

A mesh is an array of devices whose dimensions are named axes; tensors are split over those
axes (see `sharding.py`). The text form is exactly what Shardy prints inside
`sdy.mesh @m = <...>`, so a mesh read from a module and written back is unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DeviceMesh", "quote_string", "format_symbol"]

_BARE_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_$.]*")
_INTEGER = re.compile(r"-?[0-9]+")
_HEX_BYTE = re.compile(r"[0-9A-Fa-f]{2}")
_DEFAULT_NAMES = ("x", "y", "z")


def quote_string(text: str) -> str:
    """An MLIR string literal, escaped the way MLIR's printer escapes it.

    Printable ASCII stays as is except `"` (written `\\22`) and `\\` (written `\\\\`); every
    other byte of the UTF-8 encoding becomes `\\XX`. Matching the printer byte for byte is
    what makes parse/format round trips exact.
    """
    out = ['"']
    for byte in text.encode("utf-8"):
        char = chr(byte)
        if char == "\\":
            out.append("\\\\")
        elif 0x20 <= byte < 0x7F and char != '"':
            out.append(char)
        else:
            out.append(f"\\{byte:02X}")
    out.append('"')
    return "".join(out)


def format_symbol(name: str) -> str:
    """`@name` for a symbol reference: bare when MLIR allows it, quoted otherwise."""
    if _BARE_ID.fullmatch(name):
        return "@" + name
    return "@" + quote_string(name)


class _Cursor:
    """A tiny scanner over attribute text, shared by the sdy and GSPMD parsers.

    Whitespace between tokens is skipped (MLIR's and XLA's parsers allow it); errors are
    `ValueError`s that name the column, so a bad annotation points at itself.
    """

    def __init__(self, text: str, what: str):
        self.text = text
        self.pos = 0
        self.what = what

    def fail(self, message: str) -> ValueError:
        return ValueError(f"invalid {self.what} {self.text!r}: {message} at column {self.pos + 1}")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def at_end(self) -> bool:
        self.skip_ws()
        return self.pos >= len(self.text)

    def peek(self, token: str) -> bool:
        self.skip_ws()
        return self.text.startswith(token, self.pos)

    def accept(self, token: str) -> bool:
        if self.peek(token):
            self.pos += len(token)
            return True
        return False

    def expect(self, token: str) -> None:
        if not self.accept(token):
            found = self.text[self.pos : self.pos + 10] or "end of text"
            raise self.fail(f"expected {token!r}, found {found!r}")

    def expect_end(self) -> None:
        if not self.at_end():
            raise self.fail(f"unexpected trailing text {self.text[self.pos :]!r}")

    def integer(self) -> int:
        """A decimal integer, optionally negative (callers reject negatives with a message)."""
        self.skip_ws()
        match = _INTEGER.match(self.text, self.pos)
        if not match:
            raise self.fail("expected an integer")
        self.pos = match.end()
        return int(match.group())

    def word(self) -> str:
        """A keyword or bare identifier (letters, digits, `_`, `$`, `.`)."""
        self.skip_ws()
        match = _BARE_ID.match(self.text, self.pos)
        if not match:
            raise self.fail("expected an identifier")
        self.pos = match.end()
        return match.group()

    def string(self) -> str:
        """An MLIR string literal: `\\\\`, `\\"`, `\\n`, `\\t` and `\\XX` escapes."""
        self.skip_ws()
        if not self.text.startswith('"', self.pos):
            raise self.fail("expected a string")
        out = bytearray()
        i = self.pos + 1
        while True:
            if i >= len(self.text):
                raise self.fail("unterminated string")
            char = self.text[i]
            if char == '"':
                break
            if char != "\\":
                out += char.encode("utf-8")
                i += 1
                continue
            nxt = self.text[i + 1 : i + 2]
            simple = {"\\": b"\\", '"': b'"', "n": b"\n", "t": b"\t"}
            if nxt in simple:
                out += simple[nxt]
                i += 2
            elif _HEX_BYTE.fullmatch(self.text[i + 1 : i + 3]):
                out.append(int(self.text[i + 1 : i + 3], 16))
                i += 3
            else:
                self.pos = i
                raise self.fail("unknown escape in string")
        self.pos = i + 1
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail("string is not valid UTF-8") from err

    def symbol(self) -> str:
        """`@name` or `@"quoted name"`, returning the name."""
        self.expect("@")
        if self.text.startswith('"', self.pos):
            return self.string()
        match = _BARE_ID.match(self.text, self.pos)
        if not match:
            raise self.fail("expected a symbol name after '@'")
        self.pos = match.end()
        return match.group()


@dataclass(frozen=True)
class DeviceMesh:
    """An N-D array of devices with named axes.

    `axes` lists (name, size) major to minor. `device_ids[i]` is the device at row-major
    position `i` of the mesh; `None` means the iota 0..n-1, and an explicit iota is stored as
    `None` so that equal meshes compare equal (Shardy omits it the same way). A mesh with no
    axes and one device id is the *maximal* mesh: the whole tensor on that one device.
    """

    axes: tuple[tuple[str, int], ...] = ()
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        axes = tuple(self._checked_axis(axis) for axis in self.axes)
        names = [name for name, _ in axes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate mesh axis names: {duplicates}")
        size = math.prod(size for _, size in axes)
        ids = self.device_ids
        if ids is not None:
            ids = tuple(_as_int(d, "device id") for d in np.asarray(ids).ravel().tolist())
            if len(ids) != size:
                raise ValueError(f"mesh {_format_axes(axes)} has {size} devices but {len(ids)} device ids were given")
            if any(d < 0 for d in ids):
                raise ValueError(f"device ids must be non-negative, got {list(ids)}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"device ids must be distinct, got {list(ids)}")
            if axes and ids == tuple(range(size)):
                ids = None
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "device_ids", ids)

    @staticmethod
    def _checked_axis(axis: object) -> tuple[str, int]:
        try:
            name, size = axis  # type: ignore[misc]
        except (TypeError, ValueError):
            raise ValueError(f"a mesh axis is a (name, size) pair, got {axis!r}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names are non-empty strings, got {name!r}")
        size = _as_int(size, f"size of mesh axis {name!r}")
        if size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive size, got {size}")
        return name, size

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        names: Sequence[str] | None = None,
        device_ids: Iterable[int] | None = None,
    ) -> DeviceMesh:
        """A mesh from its shape; names default to x, y, z (axis_0, axis_1, ... beyond 3-D)."""
        shape = tuple(shape)
        if names is None:
            names = _DEFAULT_NAMES[: len(shape)] if len(shape) <= 3 else [f"axis_{i}" for i in range(len(shape))]
        if len(names) != len(shape):
            raise ValueError(f"mesh shape {shape} and axis names {tuple(names)} differ in length")
        ids = None if device_ids is None else tuple(np.asarray(device_ids).ravel().tolist())
        return cls(tuple(zip(names, shape)), ids)

    # --- shape -----------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        """Number of devices (1 for the empty and the maximal mesh)."""
        return math.prod(self.shape)

    @property
    def is_maximal(self) -> bool:
        """No axes, one named device: a tensor on it lives whole on that device."""
        return not self.axes and self.device_ids is not None

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ValueError(f"mesh {self.to_sdy()} has no axis {name!r}") from None

    # --- devices ---------------------------------------------------------------------------

    @property
    def device_list(self) -> tuple[int, ...]:
        """Device ids in row-major mesh order."""
        return self.device_ids if self.device_ids is not None else tuple(range(self.size))

    def devices(self) -> np.ndarray:
        """The device ids as an integer array of shape `self.shape`."""
        return np.array(self.device_list, dtype=np.int64).reshape(self.shape)

    def coords(self, device_id: int) -> dict[str, int]:
        """The position of `device_id` along each axis."""
        try:
            flat = self.device_list.index(device_id)
        except ValueError:
            raise ValueError(f"device {device_id} is not in mesh {self.to_sdy()}") from None
        index = np.unravel_index(flat, self.shape) if self.axes else ()
        return {name: int(i) for name, i in zip(self.axis_names, index)}

    def device_at(self, coords: Mapping[str, int]) -> int:
        """The device at the given position (every axis must be named)."""
        if set(coords) != set(self.axis_names):
            raise ValueError(f"coordinates {dict(coords)} do not name exactly the axes {self.axis_names}")
        index = tuple(coords[name] for name in self.axis_names)
        for (name, size), i in zip(self.axes, index):
            if not 0 <= i < size:
                raise ValueError(f"coordinate {i} out of range for axis {name!r} of size {size}")
        flat = int(np.ravel_multi_index(index, self.shape)) if self.axes else 0
        return self.device_list[flat]

    # --- sdy text --------------------------------------------------------------------------

    def to_sdy(self) -> str:
        """The text inside `sdy.mesh @m = ...`, e.g. `<["x"=2], device_ids=[1, 0]>`.

        Shardy only accepts device ids that are a permutation of 0..n-1 (or a single id on the
        maximal mesh); other meshes are still valid here but have no sdy text.
        """
        _check_sdy_device_ids(self)
        text = "<" + _format_axes(self.axes)
        if self.device_ids is not None:
            text += ", device_ids=[" + ", ".join(map(str, self.device_ids)) + "]"
        return text + ">"

    def __str__(self) -> str:
        return self.to_sdy()

    @classmethod
    def from_sdy(cls, text: str) -> DeviceMesh:
        """Parse `<["x"=2, "y"=4]>`, with or without the `<>`, a leading `#sdy.mesh` or `mesh`."""
        cursor = _Cursor(text, "sdy mesh")
        if not cursor.accept("#sdy.mesh"):
            cursor.accept("mesh")
        mesh = parse_mesh_body(cursor) if cursor.peek("<") else _parse_mesh_contents(cursor)
        cursor.expect_end()
        return mesh


def parse_mesh_body(cursor: _Cursor) -> DeviceMesh:
    """`<[axes](, device_ids=[...])?>` at the cursor (used for inlined meshes too)."""
    cursor.expect("<")
    mesh = _parse_mesh_contents(cursor)
    cursor.expect(">")
    return mesh


def _parse_mesh_contents(cursor: _Cursor) -> DeviceMesh:
    cursor.expect("[")
    axes: list[tuple[str, int]] = []
    if not cursor.accept("]"):
        while True:
            name = cursor.string()
            cursor.expect("=")
            axes.append((name, cursor.integer()))
            if cursor.accept("]"):
                break
            cursor.expect(",")
    device_ids = None
    if cursor.accept(","):
        if cursor.word() != "device_ids":
            raise cursor.fail("expected 'device_ids'")
        cursor.expect("=")
        cursor.expect("[")
        ids: list[int] = []
        if not cursor.accept("]"):
            while True:
                ids.append(cursor.integer())
                if cursor.accept("]"):
                    break
                cursor.expect(",")
        device_ids = tuple(ids)
    try:
        mesh = DeviceMesh(tuple(axes), device_ids)
        _check_sdy_device_ids(mesh)
    except ValueError as err:
        raise cursor.fail(str(err)) from None
    return mesh


def _check_sdy_device_ids(mesh: DeviceMesh) -> None:
    ids = mesh.device_ids
    if ids is None or not mesh.axes:
        return
    if sorted(ids) != list(range(len(ids))):
        raise ValueError(f"sdy meshes need device ids that are a permutation of 0..{len(ids) - 1}, got {list(ids)}")


def _format_axes(axes: Sequence[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{quote_string(name)}={size}" for name, size in axes) + "]"


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)
