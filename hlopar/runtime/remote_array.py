"""A result of `hlopar.parallelize` that lives on the workers that computed it.

A step's results stay on the workers (`ray_worker.MeshWorker` keeps them by step and
result position); the driver gets a `RemoteArray` per result leaf, which knows its shape
and dtype without fetching anything. Passing it back to the same parallelized function
moves nothing (the worker that holds it uses its copy). Reading it fetches that one value,
once: `np.asarray`, `float`, `int`, `bool`, printing, indexing, arithmetic, `jax.device_get`
(`copy_to_host_async` starts the fetch, so a tree of them is fetched in parallel), and any
jax function or `jax.jit`, which see it as the jax array it holds: the class is registered
with jax's abstractification and argument handlers (`core.pytype_aval_mappings`,
`dtypes.canonicalize_value_handlers`: jax internals; a jax that moves them fails this
module's import), because jax no
longer calls `__jax_array__` when it abstractifies arguments. It stays a pytree leaf, so
the results have exactly `fn`'s pytree structure.

Typed random keys (`jax.random.key`) are not RemoteArrays: `jax.random`'s functions take
only jax's own key arrays, so a key result comes back with its step (a few bytes; the api
wraps its key data, `jax_value`) and is sent again when passed back.

A scalar result (a loss, a metric, a step count) also comes back with its step's reply
(`host`, `with_step`), as Ray itself returns small objects inline: the worker
has waited for the step anyway, and a read would cost a second round trip to the worker for
a few bytes (a training loop reads its loss every step). It is still a RemoteArray kept on
the workers (passed back, it moves nothing), read without asking them.

A result the caller no longer references is released: its finalizer tells the runtime,
which drops it on the workers at the start of the next step. A donated one
(`donate_argnums`) is deleted as jax deletes donated arrays: reading it afterwards raises
`RuntimeError`. When the workers stop (a failure, `shutdown`), what they held is gone:
reading a value not fetched before raises `RuntimeError` saying so (a value already read
is kept on the driver and is sent again like any host array).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import jax
import numpy as np

__all__ = ["RemoteArray", "ResultSource", "is_key", "jax_value", "key_impl", "read_all", "with_step"]


class ResultSource(Protocol):
    """What holds the results (`ray_runtime.RayRuntime`)."""

    generation: int

    def fetch_start(self, generation: int, step: int, results: tuple[int, ...]) -> Any: ...

    def fetch_finish(self, pending: Any, what: str) -> list[np.ndarray]: ...

    def release(self, generation: int, step: int, r: int) -> None: ...

    def holds(self, generation: int) -> bool: ...


def is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def with_step(shape, dtype) -> bool:
    """Whether a RemoteArray's value also comes back with its step's reply: a scalar, not a
    key (module docstring)."""
    return not is_key(dtype) and int(np.prod(shape, dtype=np.int64)) == 1


def key_impl(dtype) -> str:
    """The name of the generator of a typed key's dtype (`key<fry>` -> "threefry2x32")."""
    for name in ("threefry2x32", "rbg", "unsafe_rbg"):
        if jax.random.key(0, impl=name).dtype == dtype:
            return name
    raise TypeError(f"hlopar does not know the random generator of {dtype} keys")


def jax_value(host, dtype) -> jax.Array:
    """A result fetched from the workers (host words) as a jax array of `dtype` on the
    driver's default device: typed keys wrapped back from their key data."""
    if is_key(dtype):
        return jax.random.wrap_key_data(jax.device_put(host), impl=key_impl(dtype))
    return jax.device_put(host)


class RemoteArray:
    """Result leaf `result` of step `step` of the workers of `source` (its `generation`):
    the program's results `parts` (several: the pieces of stacked layers, joined along
    their first axis when read); `host`: its value, when it came back with the step (a
    scalar). Module docstring."""

    __slots__ = (
        "shape",
        "dtype",
        "_source",
        "_generation",
        "_step",
        "_result",
        "_parts",
        "_what",
        "_pending",
        "_value",
        "_host",
        "_deleted",
        "__weakref__",
    )

    __array_priority__ = 100  # numpy defers binary operators to ours

    def __init__(
        self,
        source: ResultSource,
        generation: int,
        step: int,
        result: int,
        parts: tuple[int, ...],
        shape,
        dtype,
        what: str = "a result",
        host: np.ndarray | None = None,
    ):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)  # never a key's (module docstring)
        self._source = source
        self._generation = generation
        self._step = step
        self._result = result
        self._parts = tuple(parts)
        self._what = what
        self._pending = None
        self._value: jax.Array | None = None
        self._host = host
        self._deleted = False
        weakref.finalize(self, _release, source, generation, step, self._parts)

    # -- what is known without fetching

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def resident_in(self, source: ResultSource) -> tuple[int, int] | None:
        """(step, result leaf) when `source`'s live workers keep it, else None."""
        if self._source is source and not self._deleted and source.holds(self._generation):
            return self._step, self._result
        return None

    def is_deleted(self) -> bool:
        return self._deleted

    def delete(self) -> None:
        """Deleted as a donated jax array is: the workers drop it, reading it raises."""
        if not self._deleted:
            self._deleted = True
            self._value = self._pending = self._host = None
            _release(self._source, self._generation, self._step, self._parts)

    def block_until_ready(self) -> RemoteArray:
        return self  # a step returns once the workers are done

    # -- reading

    def copy_to_host_async(self) -> None:
        """Starts fetching (`jax.device_get` calls it on every leaf before reading any)."""
        if self._value is None and self._host is None and self._pending is None and not self._deleted:
            try:
                self._pending = self._source.fetch_start(self._generation, self._step, self._parts)
            except RuntimeError as error:
                raise RuntimeError(f"{self._what} cannot be read: {error}") from None

    def _jax(self) -> jax.Array:
        """The value as a jax array on the driver's default device (fetched once)."""
        if self._deleted:
            raise RuntimeError(
                f"{self._what} has been deleted (donated to a later call, or deleted): it can no longer be read"
            )
        if self._value is None and self._host is not None:
            self._value = jax_value(self._host, self.dtype)
        elif self._value is None:
            self.copy_to_host_async()
            pending, self._pending = self._pending, None
            parts = self._source.fetch_finish(pending, self._what)
            self._value = jax_value(parts[0] if len(parts) == 1 else np.concatenate(parts), self.dtype)
        return self._value

    def __jax_array__(self) -> jax.Array:
        return self._jax()

    def __array__(self, dtype=None, copy=None):
        value = self._jax()
        return np.asarray(value, dtype=dtype) if copy is None else np.array(value, dtype=dtype, copy=copy)

    def __float__(self) -> float:
        return float(self._jax())

    def __int__(self) -> int:
        return int(self._jax())

    def __index__(self) -> int:
        return self._jax().__index__()

    def __bool__(self) -> bool:
        return bool(self._jax())

    def __complex__(self) -> complex:
        return complex(self._jax())

    def __format__(self, spec: str) -> str:
        return format(self._jax(), spec)

    def __repr__(self) -> str:
        if self._deleted:
            return f"RemoteArray(<deleted>, shape={self.shape}, dtype={self.dtype})"
        return repr(self._jax())

    def __str__(self) -> str:
        return str(self._jax())

    def __getitem__(self, index):
        return self._jax()[index]

    def __iter__(self):
        return iter(self._jax())

    def __reduce__(self):
        return self._jax().__reduce__()

    def tolist(self):
        return self._jax().tolist()

    def item(self, *args):
        return self._jax().item(*args)


def read_all(arrays) -> None:
    """Reads each of `arrays` not read yet, keeping its value on the driver (every fetch
    started before any is waited for): before their workers stop, so that they stay readable."""
    arrays = [a for a in arrays if not a.is_deleted()]
    for a in arrays:
        a.copy_to_host_async()
    for a in arrays:
        a._jax()


def _release(source: ResultSource, generation: int, step: int, parts: tuple[int, ...]) -> None:
    for r in parts:
        source.release(generation, step, r)


def _operator(name: str):
    def method(self, *others):
        return getattr(self._jax(), name)(*(o._jax() if isinstance(o, RemoteArray) else o for o in others))

    method.__name__ = name
    return method


for _name in (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
):
    setattr(RemoteArray, f"__{_name}__", _operator(f"__{_name}__"))
    setattr(RemoteArray, f"__r{_name}__", _operator(f"__r{_name}__"))
for _name in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne"):
    setattr(RemoteArray, f"__{_name}__", _operator(f"__{_name}__"))
RemoteArray.__hash__ = None  # as jax arrays: `==` is elementwise


def _register_with_jax() -> None:
    """jax functions and `jax.jit` take a RemoteArray as the array it holds (module docstring)."""
    from jax._src import core, dtypes

    core.pytype_aval_mappings[RemoteArray] = lambda x: core.ShapedArray(x.shape, x.dtype)
    dtypes.canonicalize_value_handlers[RemoteArray] = lambda x: dtypes.canonicalize_value(x._jax())


_register_with_jax()
