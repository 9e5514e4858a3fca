"""Per-device memory of one fragment's executable, predicted from the planner's layouts.

A fragment's executable (`codegen.fragments.fragment_module`, in accumulating form where
its results are summed over microbatches) holds, on each device of its mesh, what XLA's
`memory_analysis()` splits four ways; the prediction reads each from the module the
planner wrote, never from XLA:

- **arguments**: the fragment's operands (parameters, optimizer state, the stash its
  forward kept, received activations, accumulators), each one device's tile of its
  `sdy.sharding` (the planner's layout: stage construction's intra-op plan);
- **outputs**: its results, tiled the same way, plus the result tuple's table of buffer
  pointers (8 bytes per result when there are several: XLA returns a tuple);
- **aliased**: the donated accumulators (`tf.aliasing_output`), whose buffers the results
  reuse: counted in both of the above, held once;
- **temporaries**: the peak of the intermediate values live at once, walking the body in
  program order, each value one device's tile of the layout the plan gave the op that makes
  it. What XLA fuses is not a buffer: an elementwise value (and a broadcast, a transpose, a
  slice...) read only by ops that fuse their operands (elementwise ops and reductions) never
  materializes; it keeps its own operands alive until its readers run. A value materializes
  when a non-fusible op makes it (a matrix product, a convolution, a reduction, a loop) or a
  non-fusible op reads it (XLA:CPU's matrix products read whole buffers). Reshapes and
  sharding constraints are views of their operand; a sharding constraint that changes the
  layout is a new buffer (the partitioner's collective), a scatter or dynamic update slice
  writes into its operand's. What feeds a result runs as soon as its operands exist (XLA's
  scheduler adds a gradient into its accumulator at once, freeing it). A convolution that
  reads an operand in another dimension order than XLA:CPU's kernels take (a filter
  gradient) reads a copy of it, made as soon as the operand exists. The bodies of loops and
  conditionals count by their results alone.

The total is arguments + outputs + temporaries - aliased: what one device holds while the
fragment runs. It leaves out what the schedule keeps alive around the fragment (other
microbatches' stashes, state the fragment does not read), which `codegen.memory_check`
adds, and XLA's own choices this model does not make (a buffer shared by values whose
lives do not overlap in XLA's order but do in program order, rematerialized broadcasts, a
collective's scratch space, XLA:CPU's other relayout copies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from jaxlib.mlir import ir

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.module_meshes import module_meshes
from hlopar.analysis.sharding import ShardingPerValue, TensorSharding, axes_size
from hlopar.ir.graph import FuncGraph, Value

__all__ = [
    "FragmentMemory",
    "TUPLE_POINTER_BYTES",
    "fragment_memory",
    "io_tiles",
    "Temporaries",
    "tile_bytes",
]

TUPLE_POINTER_BYTES = 8  # one entry of XLA's result tuple table (a 64-bit host pointer)

_SHARDING = "sdy.sharding"
_ALIASING_OUTPUT = "tf.aliasing_output"

# Ops whose result is a view of their first operand (no buffer of its own); an optimization
# barrier's results are each a view of its operand in the same position.
_VIEWS = frozenset(
    {"stablehlo.reshape", "stablehlo.bitcast_convert", "sdy.sharding_constraint", "stablehlo.optimization_barrier"}
)
# Ops XLA fuses into their readers: elementwise math and data movement computed per element.
_FUSIBLE = frozenset(
    {
        "stablehlo.abs",
        "stablehlo.add",
        "stablehlo.and",
        "stablehlo.atan2",
        "stablehlo.broadcast_in_dim",
        "stablehlo.cbrt",
        "stablehlo.ceil",
        "stablehlo.clamp",
        "stablehlo.compare",
        "stablehlo.complex",
        "stablehlo.concatenate",
        "stablehlo.constant",
        "stablehlo.convert",
        "stablehlo.cosine",
        "stablehlo.divide",
        "stablehlo.dynamic_slice",
        "stablehlo.exponential",
        "stablehlo.exponential_minus_one",
        "stablehlo.floor",
        "stablehlo.imag",
        "stablehlo.iota",
        "stablehlo.is_finite",
        "stablehlo.log",
        "stablehlo.log_plus_one",
        "stablehlo.logistic",
        "stablehlo.maximum",
        "stablehlo.minimum",
        "stablehlo.multiply",
        "stablehlo.negate",
        "stablehlo.not",
        "stablehlo.or",
        "stablehlo.pad",
        "stablehlo.popcnt",
        "stablehlo.power",
        "stablehlo.real",
        "stablehlo.remainder",
        "stablehlo.reverse",
        "stablehlo.round_nearest_afz",
        "stablehlo.round_nearest_even",
        "stablehlo.rsqrt",
        "stablehlo.select",
        "stablehlo.shift_left",
        "stablehlo.shift_right_arithmetic",
        "stablehlo.shift_right_logical",
        "stablehlo.sign",
        "stablehlo.sine",
        "stablehlo.slice",
        "stablehlo.sqrt",
        "stablehlo.subtract",
        "stablehlo.tan",
        "stablehlo.tanh",
        "stablehlo.transpose",
        "stablehlo.xor",
    }
)
# Ops that fuse the elementwise values they read (XLA's input fusion into a reduction).
_FUSING_READERS = _FUSIBLE | {"stablehlo.reduce", "func.return"}
# Ops that write into their first operand's buffer (XLA runs them in place).
_IN_PLACE = frozenset({"stablehlo.scatter", "stablehlo.dynamic_update_slice"})
_RESHARD = "resharding"  # a sharding constraint that changes the layout: a collective's new buffer


@dataclass(frozen=True)
class FragmentMemory:
    """Bytes per device of one executable, as XLA's `memory_analysis()` splits them."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def total(self) -> int:
        """What one device holds while the executable runs."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    def to_json(self) -> dict:
        return {
            "arguments": self.arguments,
            "outputs": self.outputs,
            "aliased": self.aliased,
            "temporaries": self.temporaries,
            "total": self.total,
        }


def tile_bytes(value: Value, sharding: TensorSharding | None, mesh: DeviceMesh | None) -> int:
    """Bytes of one device's tile of `value` laid out as `sharding` (replicated: all of it;
    uneven dimensions round up, as XLA pads them)."""
    if value.nbytes is None:
        return 0
    if sharding is None or mesh is None or not value.shape or sharding.rank != len(value.shape):
        return value.nbytes
    elements = math.prod(value.shape)
    if elements == 0:
        return 0
    tile = 1
    for size, axes in zip(value.shape, sharding.dim_axes):
        tile *= -(-size // axes_size(mesh, axes)) if axes else size
    return tile * (value.nbytes // elements)


def fragment_memory(module: ir.Operation) -> FragmentMemory:
    """The predicted per-device memory of a fragment's executable module (its `@main`)."""
    graph, mesh, arg_attrs, res_attrs = _read(module)
    arguments, results = _tiles(graph, mesh, arg_attrs, res_attrs)
    outputs = sum(results) + (TUPLE_POINTER_BYTES * len(results) if len(results) > 1 else 0)
    aliased = sum(n for n, a in zip(arguments, arg_attrs) if _ALIASING_OUTPUT in a)
    size = dict(zip(graph.args, arguments))
    layout = {v: _sharding(a) for v, a in zip(graph.args, arg_attrs)}
    return FragmentMemory(sum(arguments), outputs, aliased, _temporaries(graph, mesh, size, layout))


def io_tiles(module: ir.Operation) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes per device of each argument and each result of the module's `@main`."""
    return _tiles(*_read(module))


class Temporaries:
    """The temporaries of `graph` (a view of some ops: `FuncGraph.subgraph`) when the bytes
    per device of each value are `tile(value id)`: a plan's layouts not written into the IR
    (stage construction's per-layer plans). Which values are buffers, which fuse, when each
    op runs and each buffer is last read do not depend on the tiles: found once here, and
    `peak(tile)` only adds up bytes (stage construction prices each layer at the layouts of
    every logical mesh it plans it on)."""

    def __init__(self, graph: FuncGraph):
        self.graph = graph
        root, made_by = _buffers(graph, None, None, dict.fromkeys(graph.args))
        returned = {root[v] for v in graph.results}
        self._buffers = _Buffers(root, made_by, {}, returned, _fused(graph, root, made_by, returned))
        self._when, self._made_at = _schedule(graph, self._buffers)
        self._last = _last_reads(graph, self._buffers, self._when)

    def peak(self, tile: Callable[[int], float]) -> float:
        buffers = replace(self._buffers, size=_Tiles(tile))
        return _peak(self.graph, buffers, self._when, self._made_at, self._last)


class _Tiles(dict):
    """Bytes per buffer, each asked of `tile` the first time it is read."""

    def __init__(self, tile: Callable[[int], float]):
        super().__init__()
        self.tile = tile

    def __missing__(self, v: int) -> float:
        found = self[v] = self.tile(v)
        return found


def _read(module: ir.Operation):
    graph = FuncGraph.from_module(module)
    mesh = next((m for m in module_meshes(module).values() if m is not None), None)
    return (
        graph,
        mesh,
        _attrs(graph.mlir_func, "arg_attrs", len(graph.args)),
        _attrs(graph.mlir_func, "res_attrs", len(graph.results)),
    )


def _tiles(graph: FuncGraph, mesh: DeviceMesh | None, arg_attrs, res_attrs) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (
        tuple(tile_bytes(graph.values[v], _sharding(a), mesh) for v, a in zip(graph.args, arg_attrs)),
        tuple(tile_bytes(graph.values[v], _sharding(a), mesh) for v, a in zip(graph.results, res_attrs)),
    )


def _temporaries(
    graph: FuncGraph, mesh: DeviceMesh | None, size: dict[int, int], layout: dict[int, TensorSharding | None]
) -> int:
    """The peak bytes of materialized intermediate values live at once (module docstring),
    each made value's bytes from the layout its op's sharding says."""
    root, made_by = _buffers(graph, mesh, size, layout)
    returned = {root[v] for v in graph.results}
    buffers = _Buffers(root, made_by, size, returned, _fused(graph, root, made_by, returned))
    when, made_at = _schedule(graph, buffers)
    return _peak(graph, buffers, when, made_at, _last_reads(graph, buffers, when))


@dataclass(frozen=True)
class _Buffers:
    """`root[v]`: the value whose buffer value v is; `made_by[b]`: the op that makes buffer b
    (`_RESHARD`: a constraint that changes the layout); `size[b]` its bytes; `returned`: the
    buffers the function returns; `fused`: those XLA never materializes."""

    root: dict[int, int]
    made_by: dict[int, str]
    size: dict[int, int]
    returned: set[int]
    fused: set[int]

    def temporary(self, v: int) -> bool:
        """Whether buffer `v` is a materialized intermediate value."""
        return v in self.made_by and v not in self.fused and v not in self.returned


def _buffers(
    graph: FuncGraph,
    mesh: DeviceMesh | None,
    size: dict[int, int] | None,
    layout: dict[int, TensorSharding | None],
) -> tuple[dict[int, int], dict[int, str]]:
    """Per value, the value whose buffer it is (itself, or what it is a view of); per buffer an
    op makes, that op's name (`_RESHARD` for a constraint that changes the layout). Fills in
    `layout` and (unless None) `size` for the buffers made."""
    root: dict[int, int] = {v: v for v in graph.args}  # a view -> the value whose buffer it is
    made_by: dict[int, str] = {}
    for op in graph.ops:
        shardings = _op_shardings(op)
        for k, v in enumerate(op.results):
            name = op.name
            if name == "sdy.sharding_constraint":
                target = _constraint(op)
                if _same_layout(target, layout.get(root[op.operands[0]]), graph.values[v]):
                    root[v] = root[op.operands[0]]
                    continue
                name, shardings = _RESHARD, (target,)
            elif name == "stablehlo.optimization_barrier":  # each result is its operand
                root[v] = root[op.operands[k]]
                continue
            elif name in _VIEWS or (name in _IN_PLACE and op.operands):
                root[v] = root[op.operands[0]]
                continue
            root[v] = v
            made_by[v] = name
            layout[v] = shardings[k] if k < len(shardings) else None
            if size is not None:
                size[v] = tile_bytes(graph.values[v], layout[v], mesh)
    return root, made_by


def _fused(graph: FuncGraph, root: dict[int, int], made_by: dict[int, str], returned: set[int]) -> set[int]:
    """The buffers XLA fuses into their readers (never materialized)."""
    readers: dict[int, set[str]] = {}  # what reads each buffer, views seen through
    for op in graph.ops:
        name = _RESHARD if op.results and made_by.get(op.results[0]) == _RESHARD else op.name
        if name not in _VIEWS:
            for u in op.operands:
                readers.setdefault(root[u], set()).add(name)
    return {
        v
        for v, name in made_by.items()
        if name in _FUSIBLE and v not in returned and readers.get(v, set()) <= _FUSING_READERS
    }


def _schedule(graph: FuncGraph, buffers: _Buffers) -> tuple[dict[int, int], dict[int, int]]:
    """When each op runs (by op index) and when each value is made. XLA schedules to save
    memory: what makes a result (or only feeds one) runs as soon as its operands exist,
    freeing them (a gradient added into its accumulator right away)."""
    ops, root, fused, returned = graph.ops, buffers.root, buffers.fused, buffers.returned
    early: dict[int, bool] = {}  # by op index (a view's ops keep the function's numbering)
    feeds_result: dict[int, bool] = {}
    for op in reversed(ops):
        early[op.index] = bool(op.results) and all(
            root[v] in returned or (root[v] in fused and feeds_result.get(root[v], False)) for v in op.results
        )
        for u in op.operands:
            feeds_result[root[u]] = feeds_result.get(root[u], True) and early[op.index]
    made_at: dict[int, int] = {v: -1 for v in graph.args}
    when: dict[int, int] = {}
    for op in ops:
        when[op.index] = max((made_at[u] for u in op.operands), default=-1) if early[op.index] else op.index
        for v in op.results:
            made_at[v] = when[op.index]
    return when, made_at


def _last_reads(graph: FuncGraph, buffers: _Buffers, when: dict[int, int]) -> dict[int, int]:
    """Per buffer, when it is last needed: until its last reader runs; read by a fused value,
    until that value's readers run (program order is topological: walk it backwards)."""
    root, fused = buffers.root, buffers.fused
    last: dict[int, int] = {}
    for op in reversed(graph.ops):
        end = when[op.index]
        if op.results and all(root[v] in fused for v in op.results):
            end = max(last.get(root[v], end) for v in op.results)
        for u in op.operands:
            last[root[u]] = max(last.get(root[u], end), end)
    return last


def _peak(
    graph: FuncGraph, buffers: _Buffers, when: dict[int, int], made_at: dict[int, int], last: dict[int, int]
) -> int:
    """The largest bytes live at once, walking the ops in order: materialized intermediates
    from when they are made to their last read, and the copies of relaid operands."""
    ops, root, size = graph.ops, buffers.root, buffers.size
    frees: dict[int, list[int]] = {}
    for v, end in last.items():
        frees.setdefault(end, []).append(v)
    copies: dict[int, list[tuple[int, int]]] = {}  # when made -> (bytes, when freed)
    for op in ops:
        for u in _relaid_operands(op):
            start = max(made_at[u], 0)
            copies.setdefault(start, []).append((size[root[u]], max(when[op.index], start)))
    live = peak = 0
    for op in ops:
        for nbytes, end in copies.get(op.index, ()):
            live += nbytes
            frees.setdefault(end, []).append(-nbytes - 1)  # negative: a copy's bytes
        for v in op.results:
            if root[v] == v and buffers.temporary(v) and v in last:
                live += size[v]
        peak = max(peak, live)
        for v in frees.get(op.index, ()):
            if v < 0:
                live += v + 1
            elif buffers.temporary(v):
                live -= size[v]
    return peak


def _attrs(func: ir.Operation, key: str, count: int) -> list[dict[str, str]]:
    if key not in func.attributes:
        return [{} for _ in range(count)]
    return [{n.name: str(n.attr) for n in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]


def _sharding(attrs: dict[str, str]) -> TensorSharding | None:
    return TensorSharding.parse(attrs[_SHARDING]) if _SHARDING in attrs else None


def _op_shardings(op) -> Sequence[TensorSharding]:
    text = op.raw_attrs.get(_SHARDING)
    return tuple(ShardingPerValue.parse(text)) if text else ()


def _relaid_operands(op) -> tuple[int, ...]:
    """The operands a convolution reads in another dimension order than XLA:CPU's kernels
    take (batch first and features last; a kernel's spatial dimensions first, its output
    features last): XLA copies each into that order first (a filter gradient's operands)."""
    if op.name != "stablehlo.convolution" or op.attrs is None:
        return ()
    dims = op.attrs
    rank = len(dims.input_spatial) + 2
    relaid = []
    if (dims.input_batch, dims.input_feature) != (0, rank - 1):
        relaid.append(op.operands[0])
    if (dims.kernel_in, dims.kernel_out) != (rank - 2, rank - 1):
        relaid.append(op.operands[1])
    return tuple(relaid)


def _constraint(op) -> TensorSharding | None:
    text = op.raw_attrs.get("sharding")
    return TensorSharding.parse(text) if text else None


def _same_layout(a: TensorSharding | None, b: TensorSharding | None, value: Value) -> bool:
    """Whether two layouts tile the value alike (None: replicated)."""

    def axes(s: TensorSharding | None):
        return tuple(tuple(a) for a in s.dim_axes) if s is not None else ((),) * len(value.shape or ())

    return axes(a) == axes(b)
