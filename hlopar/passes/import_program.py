"""`hlopar-import`: bring any JAX export to the form the planning passes expect.

One `@main` with private functions inlined, chlo legalized to stablehlo, dead code gone,
and shardings already in the input (sdy attributes, Shardy's round-trip frontend
attributes, or GSPMD `mhlo.sharding` strings) written as `sdy` attributes: the user's
constraints, which later passes keep.

Refused, at the callback: a host callback that takes a `!stablehlo.token` argument of
`@main`, which is how JAX threads ordered effects through a step (`ordered=True` of
`jax.debug.print`, `jax.debug.callback`, `io_callback`): the token is the runtime's, between
one step's effects and the next one's, and nothing of hlopar's passes or runtimes carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir, passmanager

from hlopar.ir.diagnostics import DiagnosticError, error_at
from hlopar.ir.host_callbacks import callback_target
from hlopar.ir.module import find_main
from hlopar.passes.base import ModulePass, PassContext, option
from hlopar.passes.importing.inline_calls import inline_calls
from hlopar.passes.importing.shardings import import_shardings


@dataclass
class ImportPass(ModulePass):
    name = "hlopar-import"
    summary = "inline calls into @main, legalize chlo, remove dead code, read input shardings as sdy constraints"

    inline: bool = option(True, "inline private functions into their callers")
    legalize_chlo: bool = option(True, "rewrite chlo ops as stablehlo ops")
    canonicalize: bool = option(True, "fold and remove dead ops (upstream canonicalize and symbol-dce)")
    shardings: bool = option(True, "convert GSPMD and round-trip shardings to sdy attributes")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        if self.shardings:
            import_shardings(module, context)
        if self.inline:
            inline_calls(module)
        _refuse_ordered_effects(module)
        upstream = []
        if self.legalize_chlo:
            upstream.append("func.func(chlo-legalize-to-stablehlo)")
        if self.canonicalize:
            upstream += ["canonicalize", "symbol-dce"]
        if not upstream:
            return
        manager = passmanager.PassManager.parse(f"builtin.module({','.join(upstream)})", context=module.context)
        try:
            manager.run(module)
        except ir.MLIRError as error:
            raise DiagnosticError.from_mlir_error(error) from None


def _refuse_ordered_effects(module: ir.Operation) -> None:
    """A host callback reading a token argument of `@main` (module docstring)."""
    main = find_main(module)
    if main is None:
        return
    for arg in main.regions[0].blocks[0].arguments:
        if str(arg.type) != "!stablehlo.token":
            continue
        for reader in (use.owner for use in arg.uses):
            target = callback_target(reader)
            if target is not None:
                raise DiagnosticError(
                    [
                        error_at(
                            reader,
                            (
                                f"host callback '{target}' takes a token of @main: an ordered effect (ordered=True of "
                                "jax.debug.print, jax.debug.callback or io_callback), ordered across steps by jax.jit's "
                                "runtime; hlopar plans none: without ordered=True a callback runs once per step where "
                                "hlopar runs the plan in the process that lowered it as one executable (one mesh and one "
                                "microbatch on this machine)"
                            ),
                        )
                    ]
                )
