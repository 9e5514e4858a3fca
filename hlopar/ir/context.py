"""The one MLIR context factory: every dialect JAX emits, and the passes jaxlib ships."""

from __future__ import annotations

import functools

from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import chlo, mhlo, mpmd, sdy, stablehlo

# The dialect hlopar writes its own ops in (generic form, unregistered).
HLOPAR_DIALECT = "hlopar"


@functools.cache
def register_upstream_passes() -> None:
    """Make jaxlib's StableHLO and MHLO passes visible to pipeline strings.

    MLIR keeps registered passes in a process-wide registry; registering twice is
    harmless but wasteful, hence the cache.
    """
    stablehlo.register_stablehlo_passes()
    mhlo.register_mhlo_passes()


def make_context(*, allow_unregistered: bool = False) -> ir.Context:
    """A fresh context with func, stablehlo, chlo, sdy, mpmd, mhlo and the upstream dialects.

    `allow_unregistered` is for modules that carry hlopar's own generic ops; the loader
    checks that no other unknown dialect slips in (see `hlopar.ir.module`).
    """
    register_upstream_passes()
    context = ir.Context()
    registry = ir.DialectRegistry()
    _jax_mlir_ext.register_dialects(registry)
    context.append_dialect_registry(registry)
    context.load_all_available_dialects()
    sdy.register_dialect(context)
    mpmd.register_dialect(context)
    mhlo.register_mhlo_dialect(context)
    chlo.register_dialect(context)
    stablehlo.register_dialect(context)
    context.allow_unregistered_dialects = allow_unregistered
    return context
