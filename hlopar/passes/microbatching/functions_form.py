"""The functions form of a split step (`hlopar-split-microbatches{functions=true}`).

`@microbatch_step` (the per-microbatch part of the contract), `@apply_update` (the rest, on
the sums) and a `@main` that slices the batch arguments, calls `@microbatch_step` on each
microbatch, adds the results up and calls `@apply_update`: the pass's docstring shows it.
"""

from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import stablehlo

from hlopar.dialect.attributes import BATCH_ARGS_ATTR, MAIN_ARGS_ATTR, MICROBATCHES_ATTR
from hlopar.dialect.split import microbatch_index_values, split_step
from hlopar.ir.module import main_func

__all__ = ["write_functions"]


def write_functions(module: ir.Operation) -> None:
    """Rewrites a module the pass split into the functions form (module docstring)."""
    main = main_func(module)
    split = split_step(module)
    body = module.regions[0].blocks[0]
    names = {"microbatch_step": split.microbatch, "apply_update": split.update}
    args = {"microbatch_step": split.microbatch_args, "apply_update": split.update_args}
    funcs = {}
    for name, extraction in names.items():
        with ir.InsertionPoint(body):
            func = extraction.func.clone()
        func.attributes["sym_name"] = ir.StringAttr.get(name)
        func.attributes["sym_visibility"] = ir.StringAttr.get("private")
        func.attributes[MAIN_ARGS_ATTR] = ir.DenseI64ArrayAttr.get(list(args[name]))
        for key in ("arg_attrs", "res_attrs"):
            if key in func.attributes:
                del func.attributes[key]
        funcs[name] = func
    # The driver: the whole step from the original arguments.
    full_types = []
    for i, a in enumerate(main.regions[0].blocks[0].arguments):
        if i == split.index_arg:
            break  # the driver makes the microbatch index (the last argument) itself
        t = ir.RankedTensorType(a.type)
        shape = list(t.shape)
        if i in split.batch_args:
            shape[0] *= split.microbatches
        full_types.append(ir.RankedTensorType.get(shape, t.element_type, t.encoding))
    result_types = [ir.Type(t) for t in ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results]
    driver = func_dialect.FuncOp("main", ir.FunctionType.get(full_types, result_types), ip=ir.InsertionPoint(main))
    for key in ("arg_attrs", "res_attrs", "sym_visibility"):
        if key in main.attributes:
            driver.operation.attributes[key] = main.attributes[key]
    if split.index_arg is not None and "arg_attrs" in main.attributes:
        driver.operation.attributes["arg_attrs"] = ir.ArrayAttr.get(
            list(ir.ArrayAttr(main.attributes["arg_attrs"]))[: split.index_arg]
        )
    driver.operation.attributes[MICROBATCHES_ATTR] = main.attributes[MICROBATCHES_ATTR]
    driver.operation.attributes[BATCH_ARGS_ATTR] = ir.DenseI64ArrayAttr.get(
        [i for i in split.batch_args if i != split.index_arg]
    )
    entry = driver.add_entry_block()
    micro_type = ir.FunctionType(ir.TypeAttr(funcs["microbatch_step"].attributes["function_type"]).value)
    with ir.InsertionPoint(entry):
        totals = None
        for k in range(split.microbatches):
            operands = []
            for i in split.microbatch_args:
                if i == split.index_arg:
                    operands.append(
                        stablehlo.ConstantOp(
                            ir.DenseElementsAttr.get(microbatch_index_values(split.microbatches)[k : k + 1])
                        ).result
                    )
                    continue
                arg = entry.arguments[i]
                if i in split.batch_args:
                    shape = ir.RankedTensorType(full_types[i]).shape
                    size = shape[0] // split.microbatches
                    arg = stablehlo.SliceOp(
                        arg, [k * size] + [0] * (len(shape) - 1), [(k + 1) * size] + list(shape[1:]), [1] * len(shape)
                    ).result
                operands.append(arg)
            call = func_dialect.CallOp(list(micro_type.results), "microbatch_step", operands)
            parts = list(call.results)
            totals = parts if totals is None else [stablehlo.AddOp(t, p).result for t, p in zip(totals, parts)]
        call = func_dialect.CallOp(
            result_types, "apply_update", [entry.arguments[i] for i in split.update_args] + list(totals or [])
        )
        func_dialect.ReturnOp(list(call.results))
    main.erase()
