"""A program of one mesh and one microbatch as ONE executable, as `jax.jit` compiles the step.

The "shard" plan is one stage on one mesh: its forward, backward and update fragments run
in turn on the same devices, each a separate executable. With one microbatch nothing
needs them apart (no schedule interleaves them, nothing is summed over microbatches), and
three launches cost three times the per-launch overhead, materialize what the forward hands
the backward, and add gradients into zero accumulators. `one_program(program)` writes the
fragments' bodies one after the other into a single `@main` that takes the program's
arguments and returns its results, in `@main`'s order:

- every op keeps the `sdy` sharding the plan gave it; a value one fragment hands another
  goes in the layout its reader reads it (an `sdy.sharding_constraint` where its maker
  wrote another layout), so the plan is the plan;
- an accumulator is a zero constant (one microbatch: the sum is that microbatch's value,
  and XLA folds the add of zero away);
- `@main` takes the arguments some fragment reads (`fused_arguments`: jax keeps unused
  ones, which the executor then leaves out), each laid out as its first reader reads it; one
  an update fragment donates stays donated (to the same result when the layouts match, else
  to any);
- a mesh only one fragment holds joins the others' (a host callback's `@maximal_mesh_0`,
  the one device `jax.jit` calls it on: `jax.debug.print` runs in its fragment alone).

None where the program is not such a program (several meshes or microbatches, transfers, an
argument no fragment reads returned as a result, a fragment with functions besides its `@main`, two fragments
giving one mesh name different meshes): it then runs fragment by fragment.
"""

from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func as func_dialect
from jaxlib.mlir.dialects import sdy, stablehlo

from hlopar.codegen.executables import ALIASING_OUTPUT, BUFFER_DONOR, _arg_attrs, _res_attrs
from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.ir.extract import clone_into
from hlopar.ir.module import main_func

__all__ = ["fused_arguments", "fuses", "one_program"]

_SHARDING = "sdy.sharding"


def fuses(program: PipelineProgram) -> bool:
    """Whether `one_program` makes one module of `program` (module docstring)."""
    fragments = program.fragments
    if len(program.meshes) != 1 or program.microbatches != 1 or program.transfers or not fragments:
        return False
    if _merged_symbols(fragments) is None:
        return False
    read = _first_reads(program)
    return all(program.values[v].argument in read for v in program.results if program.values[v].argument is not None)


def fused_arguments(program: PipelineProgram) -> list[int]:
    """The program's arguments `one_program`'s `@main` takes, in its order: those some
    fragment reads."""
    return sorted(_first_reads(program))


def _merged_symbols(fragments) -> dict[str, ir.Operation] | None:
    """Every fragment's top-level ops but `@main` (its meshes) by symbol name, or None where
    a fragment has other functions or two fragments give one name different ops. A fragment
    may hold a mesh the others lack: a host callback's `@maximal_mesh_0` (module docstring)."""
    merged: dict[str, ir.Operation] = {}
    for f in fragments:
        symbols = _symbols(f.module)
        if symbols is None:
            return None
        for name, op in symbols.items():
            if name in merged and str(merged[name]) != str(op):
                return None
            merged.setdefault(name, op)
    return merged


def _first_reads(program: PipelineProgram) -> dict[int, tuple[int, int]]:
    """argument -> (the first fragment reading it, that fragment's argument number)."""
    first_read: dict[int, tuple[int, int]] = {}
    for k, f in enumerate(program.fragments):
        for p, v in enumerate(f.operands):
            if program.values[v].argument is not None:
                first_read.setdefault(program.values[v].argument, (k, len(f.accumulate) + p))
    return first_read


def one_program(program: PipelineProgram) -> ir.Operation | None:
    """The program as one module (module docstring), or None."""
    if not fuses(program):
        return None
    fragments = program.fragments
    values = program.values
    first_read = _first_reads(program)
    mains = [main_func(f.module) for f in fragments]
    bodies = [m.regions[0].blocks[0] for m in mains]
    arg_attrs = [_arg_attrs(m) for m in mains]
    res_attrs = [_res_attrs(m) for m in mains]

    module = fragments[0].module.clone()
    old = main_func(module)
    have = _symbols(module)
    for name, op in _merged_symbols(fragments).items():
        if name not in have:  # a mesh of another fragment (a host callback's)
            op.clone(ip=ir.InsertionPoint(old))
    with module.context, ir.Location.unknown():
        taken = fused_arguments(program)
        position = {i: p for p, i in enumerate(taken)}
        inputs = [bodies[k].arguments[a].type for k, a in (first_read[i] for i in taken)]
        made = {v: (k, p) for k, f in enumerate(fragments) for p, v in enumerate(f.results)}
        outputs = [_result_type(values[v], made.get(v), bodies, first_read, v) for v in program.results]
        main = func_dialect.FuncOp("main", ir.FunctionType.get(inputs, outputs), ip=ir.InsertionPoint(old))
        for name in old.attributes:
            if name not in ("function_type", "sym_name", "arg_attrs", "res_attrs"):
                main.operation.attributes[name] = old.attributes[name]
        entry = main.add_entry_block()
        env: dict[int, ir.Value] = {}  # program value -> its value in the new body
        layout: dict[int, ir.Attribute | None] = {}  # program value -> the sdy sharding it has there
        for v, value in enumerate(values):
            if value.argument in position:
                k, a = first_read[value.argument]
                env[v], layout[v] = entry.arguments[position[value.argument]], arg_attrs[k][a].get(_SHARDING)
        with ir.InsertionPoint(entry):
            for k, f in enumerate(fragments):
                arguments = bodies[k].arguments
                mapping = {arguments[j]: _zeros(arguments[j].type) for j in range(len(f.accumulate))}
                for p, v in enumerate(f.operands):
                    a = len(f.accumulate) + p
                    want = arg_attrs[k][a].get(_SHARDING)
                    value = env[v]
                    if want is not None and str(want) != str(layout[v]):
                        value = sdy.ShardingConstraintOp(value, want).result
                    mapping[arguments[a]] = value
                operations = list(bodies[k].operations)
                for op in operations[:-1]:
                    clone_into(op.operation, mapping)
                returned = [mapping.get(x, x) for x in operations[-1].operands]
                for p, v in enumerate(f.results):
                    env[v], layout[v] = returned[p], res_attrs[k][p].get(_SHARDING)
            func_dialect.ReturnOp([env[v] for v in program.results])
        main.operation.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get(a) for a in _arguments(program, first_read, arg_attrs, layout)]
        )
        main.operation.attributes["res_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get({_SHARDING: layout[v]} if layout[v] is not None else {}) for v in program.results]
        )
        old.erase()
    return module


def _symbols(module: ir.Operation) -> dict[str, ir.Operation] | None:
    """The module's top-level ops but `@main` (its meshes) by symbol name, or None when it
    has other functions."""
    others = {}
    for op in module.regions[0].blocks[0].operations:
        name = op.operation.attributes["sym_name"] if "sym_name" in op.operation.attributes else None
        name = ir.StringAttr(name).value if name is not None else str(op)
        if op.operation.name == "func.func":
            if name != "main":
                return None
            continue
        others[name] = op.operation
    return others


def _result_type(value, made, bodies, first_read, v) -> ir.Type:
    if made is not None:
        k, p = made
        return bodies[k].operations[len(bodies[k].operations) - 1].operands[p].type
    k, a = first_read[value.argument]
    return bodies[k].arguments[a].type


def _zeros(tensor: ir.Type) -> ir.Value:
    """A zero of `tensor`'s type (an accumulator with nothing summed yet)."""
    tensor = ir.RankedTensorType(tensor)
    element = tensor.element_type
    float_type = str(element).startswith(("f", "bf"))
    zero = ir.FloatAttr.get(element, 0.0) if float_type else ir.IntegerAttr.get(element, 0)
    return stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(tensor, zero)).result


def _arguments(program: PipelineProgram, first_read, arg_attrs, layout) -> list[dict]:
    """Each argument's attributes: its first reader's layout, and the donation an update
    fragment made of it (to the same result where the layouts match)."""
    out = []
    for i in fused_arguments(program):
        k, a = first_read[i]
        attrs = {_SHARDING: arg_attrs[k][a][_SHARDING]} if _SHARDING in arg_attrs[k][a] else {}
        for f in program.fragments:
            for p, r in f.donated.items():
                if program.values[f.operands[p]].argument != i:
                    continue
                v = f.results[r] if r is not None else None
                if v in program.results and str(layout[v]) == str(attrs.get(_SHARDING)):
                    attrs[ALIASING_OUTPUT] = ir.IntegerAttr.get(
                        ir.IntegerType.get_signless(32), program.results.index(v)
                    )
                else:
                    attrs[BUFFER_DONOR] = ir.BoolAttr.get(True)
        out.append(attrs)
    return out
