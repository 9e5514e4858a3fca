"""Host callbacks: ops that call a Python function of the process that lowered the program.

`jax.debug.print`, `jax.debug.callback`, `jax.experimental.io_callback` and
`jax.pure_callback` lower to a `stablehlo.custom_call` to jaxlib's Python callback handler
(`xla_ffi_python_cpu_callback`, `xla_ffi_partitioned_python_cpu_callback` for
`partitioned=True`, their `gpu` twins, and the older `xla_python_*_callback`) with
`mhlo.backend_config = {index = k}`: the k-th of the Python functions the lowering
collected, which `jax.jit` hands to the compiler beside the module (`host_callbacks` of
`Client.compile_and_load`). The function lives only in that process: compiled anywhere else,
or without the list, index k names nothing and the executable crashes when it gets there.

`host_callbacks(op)` finds such ops; `lowered_host_callbacks(lowered)` is the lowering's
list, read from jax's private `Lowered._lowering` (no public API gives it; one place, as
DESIGN.md asks of jax internals).
"""

from __future__ import annotations

import re
from typing import Any

from jaxlib.mlir import ir

__all__ = ["callback_target", "host_callbacks", "lowered_host_callbacks"]

_TARGET = re.compile(r"^xla(?:_ffi)?(?:_partitioned)?_python_(?:cpu|gpu)_callback$")


def callback_target(op: ir.Operation) -> str | None:
    """The call target of a host callback `op`, or None for any other op."""
    op = op.operation
    if op.name != "stablehlo.custom_call" or "call_target_name" not in op.attributes:
        return None
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    return target if _TARGET.match(target) else None


def host_callbacks(root: ir.Operation) -> list[ir.Operation]:
    """The host callback ops under `root` (a module or a function), in program order."""
    found: list[ir.Operation] = []

    def visit(op):
        if callback_target(op) is not None:
            found.append(op.operation)
        return ir.WalkResult.ADVANCE

    root.operation.walk(visit)
    return found


def lowered_host_callbacks(lowered: Any) -> list:
    """The Python functions a `jax.stages.Lowered` hands the compiler beside its module, in
    the order of the callbacks' `index` (empty where it has none)."""
    lowering = getattr(lowered, "_lowering", None)
    compile_args = getattr(lowering, "compile_args", None) or {}
    return list(compile_args.get("host_callbacks") or ())
