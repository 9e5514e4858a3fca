"""A read-only graph view of one function, for the analyses.

`FuncGraph.from_func(func_op)` walks a `func.func` once and keeps what the analyses read,
as plain Python: the top-level ops in program order, every SSA value with its shape,
element type and size, who produces it and who uses it, and op attributes decoded into
small dataclasses (`hlopar.ir.op_attrs`). Regions (reduce bodies, while cond/body, case
branches) are kept as nested blocks of nested ops.

Numbering:

- Values have ids `0..len(values)-1`: the function arguments first (id == argument
  number), then every value in the order it is defined in a pre-order walk.
- Top-level ops have ids `0..len(ops)-1`, their position in `FuncGraph.ops` (also their
  `index`). Nested ops get the ids that follow, in pre-order (`FuncGraph.walk()` order);
  their `index` is their position within their own block, and `top` the index of the
  top-level op they sit in. `FuncGraph.op(i)` looks up any op by id.
- The terminating `func.return` is not an op of the graph: `FuncGraph.results` lists the
  values it returns. Terminators of nested blocks (`stablehlo.return`) are kept.

Uses: `Value.users` are top-level op indices in program order; a use by a nested op counts
as a use by the top-level op enclosing it, so a value defined outside a while loop and
read in its body has the while op among its users. `FuncGraph.direct_users_of(v)` gives
the ops, at any depth, that take the value as an operand.

Each node keeps its `ir.Operation` (`OpNode.mlir_op`) for passes that rewrite the IR, and
its `ir.Location`, decoded on access by `OpNode.location` (locations belong to the context
and survive edits). Everything else is plain Python made at build time, except
`OpNode.raw_attrs`, which prints the live op's attributes when read: read it before the
IR is changed.

Speed matters (a 21k-op training step must load in well under a second), so values and
nodes are named tuples, attributes are decoded once with the cheapest binding calls, and
the cyclic garbage collector is paused while building.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from jaxlib.mlir import ir

from hlopar.ir.collector import paused_gc
from hlopar.ir.op_attrs import DECODERS, OpAttrs

Shape = tuple[int | None, ...]

_DYNAMIC = ir.ShapedType.get_dynamic_size()


@dataclass(frozen=True, slots=True)
class Location:
    """Where an op comes from: source position and JAX name stack, parts None when unknown."""

    file: str | None = None
    line: int | None = None
    col: int | None = None
    # The outermost name of a NameLoc, which in JAX output is the name stack, e.g.
    # "jit(f)/layer_3/dot_general".
    name: str | None = None


class Value(NamedTuple):
    """One SSA value (an immutable named tuple: cheap to build by the hundred thousand)."""

    id: int
    type: str  # the printed type, e.g. "tensor<4x?xf32>", "!stablehlo.token"
    shape: Shape | None  # None dims are dynamic; None for non-tensor and unranked types
    dtype: str  # element type text ("f32", "bf16", "i1", "complex<f32>"); the type text otherwise
    nbytes: int | None  # None when dynamic, unranked or not a tensor
    # Index of the top-level op that defines the value, directly or inside one of its
    # regions; None for function arguments (and only for them).
    producer: int | None
    def_op: int | None  # id of the op whose result it is (at any depth); None for block arguments
    result_index: int | None  # position among `def_op`'s results
    arg_index: int | None  # function argument number; None for everything else
    nested: bool  # defined inside a region of a top-level op
    users: tuple[int, ...]  # top-level op indices, ascending (nested uses count for their top op)

    @property
    def is_arg(self) -> bool:
        """A function argument."""
        return self.producer is None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


class Block(NamedTuple):
    """A block of a region: its arguments (value ids) and its ops, terminator included."""

    args: tuple[int, ...]
    ops: tuple[OpNode, ...]


class OpNode(NamedTuple):
    """One operation. `attrs` is the decoded attribute record, None for ops without one.

    A named tuple for speed; equality and hashing ignore the MLIR objects at its end.
    """

    id: int
    index: int  # position in its block; for top-level ops, in `FuncGraph.ops`
    top: int  # index of the enclosing top-level op (itself when top-level)
    parent: int | None  # id of the immediately enclosing op; None when top-level
    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    attrs: OpAttrs | None
    regions: tuple[tuple[Block, ...], ...]
    mlir_location: ir.Location  # decoded by `location` on access
    mlir_op: ir.Operation  # the live op, for passes that rewrite

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpNode) and self[:-2] == other[:-2]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self[:-2])

    def __repr__(self) -> str:
        regions = f", regions={[len(r) for r in self.regions]}" if self.regions else ""
        return (
            f"OpNode(id={self.id}, name={self.name!r}, operands={self.operands}, "
            f"results={self.results}, attrs={self.attrs!r}{regions})"
        )

    @property
    def location(self) -> Location | None:
        """Source position and name stack, decoded on access (locations outlive edits)."""
        return decode_location(self.mlir_location)

    @property
    def is_top_level(self) -> bool:
        return self.parent is None

    @property
    def dialect(self) -> str:
        return self.name.partition(".")[0]

    @property
    def raw_attrs(self) -> Mapping[str, str]:
        """Every attribute of the op in printed form, read from the live op at each access.

        Printing is slow: it is done on demand only, and must happen before the IR changes.
        """
        attributes = self.mlir_op.attributes
        printed = {}
        for position, name in enumerate(attributes):
            try:
                printed[name] = str(attributes[name])
            except TypeError:
                # Attributes the bindings cannot cast (complex dense elements): print
                # the named attribute, never touching its `.attr`.
                text = str(attributes[position])
                printed[name] = text[len(f"NamedAttribute({name}=") : -1]
        return MappingProxyType(printed)

    def walk(self) -> Iterator[OpNode]:
        """This op, then the ops of its regions, pre-order."""
        yield self
        for region in self.regions:
            for block in region:
                for op in block.ops:
                    yield from op.walk()


@dataclass(frozen=True, eq=False)
class FuncGraph:
    """The graph view of one `func.func`. Program order is a topological order."""

    name: str
    args: tuple[int, ...]  # value ids of the function arguments
    results: tuple[int, ...]  # value ids returned, in order
    ops: tuple[OpNode, ...]  # top-level ops in program order, `func.return` excluded
    values: tuple[Value, ...]  # indexed by value id
    all_ops: tuple[OpNode, ...] = field(repr=False)  # indexed by op id
    mlir_func: ir.Operation = field(repr=False)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_func(cls, func_op: ir.Operation | ir.OpView) -> FuncGraph:
        """The view of a `func.func` op (a body-less declaration gives args and no ops)."""
        # The build makes a few objects per op and frees none: the cyclic collector would
        # rescan the growing heap again and again for nothing.
        with paused_gc():
            return _Builder().build(func_op.operation)

    @classmethod
    def from_module(cls, module: ir.Module | ir.Operation, name: str = "main") -> FuncGraph:
        """The view of function `@name` of a module (`ir.Module` or `builtin.module` op)."""
        for func in _funcs(module):
            if ir.StringAttr(func.attributes["sym_name"]).value == name:
                return cls.from_func(func)
        raise KeyError(f"no func.func named @{name} in the module")

    # ------------------------------------------------------------------ queries

    def op(self, i: int) -> OpNode:
        """The op with id `i` (top-level ops are 0..len(ops)-1)."""
        return self.all_ops[i]

    def value(self, v: int) -> Value:
        return self.values[v]

    def walk(self) -> Iterator[OpNode]:
        """Every op, nested ones included, in pre-order."""
        for op in self.ops:
            yield from op.walk()

    def users_of(self, v: int) -> tuple[OpNode, ...]:
        """The top-level ops that use value `v` (directly or inside their regions)."""
        return tuple(self.ops[i] for i in self.values[v].users)

    def producer_of(self, v: int) -> OpNode | None:
        """The top-level op defining value `v` (or enclosing its definition); None for args."""
        producer = self.values[v].producer
        return None if producer is None else self.ops[producer]

    def defining_op(self, v: int) -> OpNode | None:
        """The op, at any depth, whose result `v` is; None for block arguments."""
        def_op = self.values[v].def_op
        return None if def_op is None else self.all_ops[def_op]

    def direct_users_of(self, v: int) -> tuple[OpNode, ...]:
        """The ops, at any depth, that take value `v` as an operand, in walk order."""
        return tuple(self.all_ops[i] for i in self._direct_users.get(v, ()))

    @functools.cached_property
    def _direct_users(self) -> dict[int, list[int]]:
        table: dict[int, list[int]] = {}
        for op in self.walk():
            for v in op.operands:
                ids = table.setdefault(v, [])
                if not ids or ids[-1] != op.id:
                    ids.append(op.id)
        return table

    def reads(self, i: int) -> tuple[int, ...]:
        """Values defined outside top-level op `i` that it reads (its regions included), in
        order of first use: what the op needs from the rest of the function."""
        op = self.ops[i]
        if not op.regions:
            return op.operands
        found: dict[int, None] = {}
        for nested in op.walk():
            for v in nested.operands:
                if self.values[v].producer != i:
                    found.setdefault(v)
        return tuple(found)

    def predecessors(self, i: int) -> tuple[int, ...]:
        """Top-level ops whose results top-level op `i` reads, ascending."""
        found = set()
        for op in self.ops[i].walk():
            for v in op.operands:
                producer = self.values[v].producer
                if producer is not None and producer != i:
                    found.add(producer)
        return tuple(sorted(found))

    def successors(self, i: int) -> tuple[int, ...]:
        """Top-level ops that read a result of top-level op `i`, ascending."""
        found = set()
        for v in self.ops[i].results:
            found.update(self.values[v].users)
        return tuple(sorted(found))

    def topological_order(self) -> range:
        """Indices of the top-level ops in a topological order: program order."""
        return range(len(self.ops))

    def subgraph(self, op_indices: Iterable[int], name: str | None = None) -> FuncGraph:
        """The view of some top-level ops as if they were a function of their own.

        Its `args` are the values the ops read from outside the set (function arguments or
        other ops' results, by ascending id), its `results` the values they make that are read
        outside the set or returned by the function. Ops, values and ids stay those of this
        graph (an op's `index` is still its position here), so per-op tables keyed by id
        apply unchanged; `Value.users` still lists users outside the set. No IR is built.
        """
        chosen = sorted(set(op_indices))
        inside = set(chosen)
        ops = tuple(op for op in self.ops if op.index in inside)  # a view's ops too (their indices are the function's)
        made: set[int] = set()
        read: set[int] = set()
        for op in ops:
            made.update(op.results)
            for inner in op.walk():
                read.update(inner.operands)
        values = self.values
        args = tuple(sorted(v for v in read if values[v].producer is None or values[v].producer not in inside))
        returned = set(self.results)
        results = tuple(sorted(v for v in made if v in returned or any(u not in inside for u in values[v].users)))
        return FuncGraph(
            name=name or f"{self.name}[{len(ops)} ops]",
            args=args,
            results=results,
            ops=ops,
            values=values,
            all_ops=self.all_ops,
            mlir_func=self.mlir_func,
        )

    @property
    def num_ops(self) -> int:
        """All ops, nested ones included (the top-level `func.return` excluded)."""
        return len(self.all_ops)

    def __repr__(self) -> str:
        return f"FuncGraph(@{self.name}: {len(self.ops)} ops, {self.num_ops} with nested, {len(self.values)} values)"


def reaches(successors: Callable[[int], Iterable[int]], start: int, targets: Container[int]) -> bool:
    """Whether a path of one or more edges leads from op `start` to an op in `targets`."""
    seen, stack = {start}, [start]
    while stack:
        for following in successors(stack.pop()):
            if following in targets:
                return True
            if following not in seen:
                seen.add(following)
                stack.append(following)
    return False


def callee_graph(graph: FuncGraph, call: OpNode) -> FuncGraph | None:
    """The graph of the function that `call` (a `func.call` op of `graph`) calls, found in the
    module holding `graph`'s function; None where it is not there."""
    name = ir.FlatSymbolRefAttr(call.mlir_op.attributes["callee"]).value
    module = graph.mlir_func.parent
    if module is None:
        return None
    for func in _funcs(module):
        if ir.StringAttr(func.attributes["sym_name"]).value == name:
            return FuncGraph.from_func(func)
    return None


def module_graphs(module: ir.Module | ir.Operation) -> dict[str, FuncGraph]:
    """The graph of every function in the module, by symbol name."""
    with paused_gc():
        types: dict[ir.Type, _TypeInfo] = {}  # types are uniqued by the context: share them
        return {
            ir.StringAttr(func.attributes["sym_name"]).value: _Builder(types).build(func) for func in _funcs(module)
        }


def _funcs(module: ir.Module | ir.Operation) -> Iterator[ir.Operation]:
    body = module.body if isinstance(module, ir.Module) else module.operation.regions[0].blocks[0]
    for op in body.operations:
        if op.operation.name == "func.func":
            yield op.operation


# --------------------------------------------------------------------------- builder


@dataclass(frozen=True, slots=True)
class _TypeInfo:
    text: str
    shape: Shape | None
    dtype: str
    nbytes: int | None


def _type_info(type_: ir.Type) -> _TypeInfo:
    text = str(type_)
    if isinstance(type_, ir.RankedTensorType):
        shape = tuple(None if d == _DYNAMIC else d for d in type_.shape)
        element = type_.element_type
        width = bit_width(element)
        nbytes = None
        if width is not None and None not in shape:
            count = 1
            for d in shape:
                count *= d
            nbytes = count * ((width + 7) // 8)
        return _TypeInfo(text, shape, str(element), nbytes)
    if isinstance(type_, ir.ShapedType):  # unranked tensors
        return _TypeInfo(text, None, str(type_.element_type), None)
    return _TypeInfo(text, None, text, None)


def bit_width(element: ir.Type) -> int | None:
    """Storage bits of one element, as XLA lays tensors out (i1 and i4 take a byte)."""
    if isinstance(element, ir.ComplexType):
        inner = bit_width(element.element_type)
        return None if inner is None else 2 * inner
    if isinstance(element, ir.IndexType):
        return 64
    width = getattr(element, "width", None)
    return width if isinstance(width, int) else None


def decode_location(loc: ir.Location) -> Location | None:
    """The file, line, column and outermost name of an MLIR location; None if it has none.

    Names are taken from NameLocs (the first one met is the JAX name stack), positions from
    the first FileLineColLoc reached through names, call-site callees and fused parts.
    """
    file = line = col = name = None
    while loc is not None:
        if isinstance(loc, ir.NameLoc):
            if name is None:
                name = loc.name_str
            loc = loc.child_loc
        elif isinstance(loc, ir.CallSiteLoc):
            loc = loc.callee
        elif isinstance(loc, ir.FileLineColLoc):
            file, line, col = loc.filename, loc.start_line, loc.start_col
            break
        elif isinstance(loc, ir.FusedLoc):
            found = [decode_location(part) for part in loc.locations]
            found = [part for part in found if part is not None]
            with_file = next((part for part in found if part.file is not None), None)
            if with_file is not None:
                file, line, col = with_file.file, with_file.line, with_file.col
            if name is None:
                name = next((part.name for part in found if part.name is not None), None)
            break
        else:
            break
    if file is None and name is None:
        return None
    return Location(file, line, col, name)


class _Builder:
    """One pass over the func, gathering values in flat lists and ops by id.

    Written for speed: the MLIR bindings are called once per op, operand and result, and
    every Python object made is a tuple.
    """

    def __init__(self, types: dict[ir.Type, _TypeInfo] | None = None) -> None:
        self.ids: dict[ir.Value | tuple[str, int], int] = {}
        # Per value id: (type info, producer, def_op, result_index, arg_index, nested).
        self.defs: list[tuple] = []
        self.users: list[list[int]] = []
        self.nodes: list[OpNode | None] = []
        self.types: dict[ir.Type, _TypeInfo] = {} if types is None else types
        # Values used before their definition (graph regions of foreign dialects).
        self.forward: set[int] = set()

    def _info(self, type_: ir.Type) -> _TypeInfo:
        info = self.types.get(type_)
        if info is None:
            info = self.types[type_] = _type_info(type_)
        return info

    def _value(self, key: ir.Value | tuple[str, int], definition: tuple) -> int:
        """Numbers a value at its definition (or completes one first seen as an operand)."""
        if self.forward:
            vid = self.ids.get(key)
            if vid is not None and vid in self.forward:
                self.forward.discard(vid)
                self.defs[vid] = definition
                return vid
        vid = len(self.defs)
        self.ids[key] = vid
        self.defs.append(definition)
        self.users.append([])
        return vid

    def _forward_value(self, value: ir.Value) -> int:
        vid = len(self.defs)
        self.ids[value] = vid
        self.defs.append((self._info(value.type), None, None, None, None, True))
        self.users.append([])
        self.forward.add(vid)
        return vid

    def build(self, func: ir.Operation) -> FuncGraph:
        name = ir.StringAttr(func.attributes["sym_name"]).value
        blocks = list(func.regions[0].blocks)
        if blocks:
            args = tuple(
                self._value(arg, (self._info(arg.type), None, None, None, position, False))
                for position, arg in enumerate(blocks[0].arguments)
            )
        else:  # a declaration: arguments from the signature, no body
            signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
            args = tuple(
                self._value(("argument", position), (self._info(type_), None, None, None, position, False))
                for position, type_ in enumerate(signature.inputs)
            )

        top_ops = [op.operation for block in blocks for op in block.operations]
        returned = top_ops.pop() if top_ops and top_ops[-1].name == "func.return" else None
        self.nodes = [None] * len(top_ops)
        ops = self._ops(top_ops, None, None)
        results: tuple[int, ...] = ()
        if returned is not None:
            ids = self.ids
            results = tuple(ids[v] if v in ids else self._forward_value(v) for v in returned.operands)

        users = self.users
        values = tuple(
            Value(
                vid,
                info.text,
                info.shape,
                info.dtype,
                info.nbytes,
                producer,
                def_op,
                result_index,
                arg_index,
                nested,
                tuple(users[vid]),
            )
            for vid, (info, producer, def_op, result_index, arg_index, nested) in enumerate(self.defs)
        )
        return FuncGraph(
            name=name,
            args=args,
            results=results,
            ops=ops,
            values=values,
            all_ops=tuple(self.nodes),
            mlir_func=func,
        )

    def _ops(self, mlir_ops, top: int | None, parent: int | None) -> tuple[OpNode, ...]:
        """Builds the nodes of one block's ops; `top`/`parent` are None at top level.

        It runs once per op of modules of 10^5 ops, so numbering operands and results stays
        inline here (local names, no call per value) instead of in helpers of its own."""
        ids = self.ids
        defs = self.defs
        users = self.users
        nodes = self.nodes
        info_of = self.types
        decoders = DECODERS
        nested = parent is not None
        out = []
        for index, op in enumerate(mlir_ops):
            if nested:
                op = op.operation
                op_id = len(nodes)
                nodes.append(None)
                user = top
            else:
                op_id = user = index
            try:
                operands = tuple([ids[v] for v in op.operands])
            except KeyError:
                operands = tuple([ids[v] if v in ids else self._forward_value(v) for v in op.operands])
            for vid in operands:
                used_by = users[vid]
                if not used_by or used_by[-1] != user:
                    used_by.append(user)
            results = []
            for position, v in enumerate(op.results):
                type_ = v.type
                info = info_of.get(type_)
                if info is None:
                    info = info_of[type_] = _type_info(type_)
                definition = (info, user, op_id, position, None, nested)
                if self.forward:
                    results.append(self._value(v, definition))
                else:
                    vid = len(defs)
                    ids[v] = vid
                    defs.append(definition)
                    users.append([])
                    results.append(vid)
            regions = op.regions
            regions = self._regions(regions, user, op_id) if len(regions) else ()
            name = op.name
            decoder = decoders.get(name)
            node = OpNode(
                op_id,
                index,
                user,
                parent,
                name,
                operands,
                tuple(results),
                None if decoder is None else decoder(op),
                regions,
                op.location,
                op,
            )
            nodes[op_id] = node
            out.append(node)
        return tuple(out)

    def _regions(self, regions, user: int, op_id: int) -> tuple[tuple[Block, ...], ...]:
        """The blocks of an op's regions: their arguments, then their ops (`user`: the
        top-level op they belong to; `op_id`: the op holding them)."""
        return tuple(
            [
                tuple(
                    [
                        Block(
                            tuple(
                                [
                                    self._value(arg, (self._info(arg.type), user, None, None, None, True))
                                    for arg in block.arguments
                                ]
                            ),
                            self._ops(block.operations, user, op_id),
                        )
                        for block in region.blocks
                    ]
                )
                for region in regions
            ]
        )
