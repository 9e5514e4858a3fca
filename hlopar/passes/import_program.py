"""`hlopar-import`: bring any JAX export to the form the planning passes expect.

One `@main` with private functions inlined, chlo legalized to stablehlo, dead code gone,
and shardings already in the input (sdy attributes, Shardy's round-trip frontend
attributes, or GSPMD `mhlo.sharding` strings) written as `sdy` attributes: the user's
constraints, which later passes keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxlib.mlir import ir, passmanager

from hlopar.ir.diagnostics import DiagnosticError
from hlopar.passes.base import ModulePass, PassContext, option
from hlopar.passes.import_shardings import import_shardings
from hlopar.passes.inline_calls import inline_calls


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
