"""What JAX's lowering says of a function's arguments and results.

`jax.jit(f).lower(...)` names each `@main` argument after its pytree path in `f`'s
signature (the argument's location, e.g. `loc("state.params['Dense_0']['kernel']")`,
kept with `as_text(debug_info=True)`), each result after its path in `f`'s output
(`jax.result_info = "result[1]['w']"`), and marks donated arguments: `tf.aliasing_output =
N` when the donated buffer is reused for result N, `jax.buffer_donor = true` when it is
donated with no result of its type. These are the user's own words for the values and the
only place the signature's structure survives the flattening; roles analysis and messages
read them here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxlib.mlir import ir

__all__ = ["FuncSignature", "path_tokens"]


@dataclass(frozen=True)
class FuncSignature:
    """Per argument and result of a `func.func`: JAX's name (or None) and donation."""

    arg_names: tuple[str | None, ...]
    result_names: tuple[str | None, ...]
    aliases: tuple[tuple[int, int], ...]  # (argument, result) from tf.aliasing_output
    donors: frozenset[int]  # arguments marked jax.buffer_donor

    @classmethod
    def of(cls, func: ir.Operation) -> FuncSignature:
        func = func.operation
        block = func.regions[0].blocks[0] if len(func.regions[0].blocks) else None
        args = list(block.arguments) if block is not None else []
        arg_attrs = _dicts(func, "arg_attrs", len(args))
        results = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value).results
        res_attrs = _dicts(func, "res_attrs", len(results))
        aliases, donors = [], set()
        for i, attrs in enumerate(arg_attrs):
            if "tf.aliasing_output" in attrs:
                aliases.append((i, ir.IntegerAttr(attrs["tf.aliasing_output"]).value))
            if "jax.buffer_donor" in attrs and ir.BoolAttr(attrs["jax.buffer_donor"]).value:
                donors.add(i)
        return cls(
            tuple(_name_of(arg.location) for arg in args),
            tuple(ir.StringAttr(a["jax.result_info"]).value if "jax.result_info" in a else None for a in res_attrs),
            tuple(aliases),
            frozenset(donors),
        )

    def arg(self, i: int) -> str:
        """`argument i` with JAX's name when there is one: `argument 3 (params['w'])`."""
        name = self.arg_names[i] if i < len(self.arg_names) else None
        return f"argument {i} ({name})" if name else f"argument {i}"

    def result(self, i: int) -> str:
        name = self.result_names[i] if i < len(self.result_names) else None
        return f"result {i} ({name})" if name else f"result {i}"


_TOKEN = re.compile(r"\[[^\]]*\]|\.\w+|^\w+")


def path_tokens(name: str | None) -> tuple[str, ...]:
    """The keys of a pytree path as JAX prints it, below its top level (the argument, or
    the output's first level): `state.params['w']` -> (`.params`, `['w']`); `args[2]['w']`
    (a `*args` parameter) -> (`['w']`,); `result[1]['w']` -> (`['w']`,). Top-level
    positions are dropped: an argument's and a result's numbers say nothing of each other."""
    if not name:
        return ()
    tokens = _TOKEN.findall(name)
    if not tokens or tokens[0].startswith(("[", ".")):
        return tuple(tokens)
    drop = 2 if tokens[0] in ("args", "result") else 1
    return tuple(tokens[drop:])


def _dicts(func: ir.Operation, key: str, count: int) -> list[dict[str, ir.Attribute]]:
    if key not in func.attributes:
        return [{}] * count
    return [{named.name: named.attr for named in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]


def _name_of(location: ir.Location) -> str | None:
    """A block argument's NameLoc name (JAX's pytree path), None for other locations."""
    text = str(location)
    match = re.fullmatch(r'loc\("((?:[^"\\]|\\.)*)"\)', text)
    return match.group(1).replace('\\"', '"') if match else None
