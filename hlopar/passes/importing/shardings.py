"""Reads the shardings a JAX export carries and writes them as `sdy` attributes.

JAX writes shardings in three ways, depending on its version and on `jax.export`:

- the sdy dialect itself: `sdy.mesh` ops and `sdy.sharding` attributes (kept as they are);
- Shardy's round-trip form inside `mhlo.frontend_attributes`: `xla.sdy.meshes` on the module,
  `xla.sdy.sharding` strings on arguments and ops, and `@xla.sdy.FuncResultSharding` /
  `@xla.sdy.Sharding` custom calls for results and constraints;
- GSPMD strings: `mhlo.sharding = "{devices=[2,1]<=[2]}"` on arguments and results, and
  `@Sharding` custom calls for constraints.

All become sdy: `sdy.mesh` ops, `sdy.sharding` on arguments, results and ops, and
`sdy.sharding_constraint` ops. What sdy cannot express (manual GSPMD shardings, which sdy
keeps on `sdy.manual_computation`, and tuple shardings) is left in its GSPMD form, which
XLA still honours. Either way the input's shardings stay: they are the user's constraints.
"""

from __future__ import annotations

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.common_mesh import common_mesh
from hlopar.analysis.gspmd import GspmdSharding, ManualSharding, gspmd_to_sdy
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.module_meshes import module_meshes
from hlopar.analysis.sharding import TensorSharding
from hlopar.passes.base import PassContext

SDY_SHARDING = "sdy.sharding"
GSPMD_SHARDING = "mhlo.sharding"
FRONTEND_ATTRIBUTES = "mhlo.frontend_attributes"
ROUND_TRIP_SHARDING = "xla.sdy.sharding"
ROUND_TRIP_MESHES = "xla.sdy.meshes"
ROUND_TRIP_RESULT_SHARDING = "xla.sdy.FuncResultSharding"
ROUND_TRIP_CONSTRAINT = "xla.sdy.Sharding"
GSPMD_CONSTRAINT = "Sharding"


class _Meshes:
    """The module's `sdy.mesh` symbols; adds one for each new mesh a GSPMD string needs."""

    def __init__(self, module: ir.Operation):
        self.body = module.regions[0].blocks[0]
        self.by_name: dict[str, DeviceMesh | None] = module_meshes(module)
        self.replicated_mesh = DeviceMesh()
        self.on_common_mesh: dict[str, tuple[DeviceMesh, TensorSharding]] = {}

    def plan_gspmd(self, texts: list[str]) -> None:
        """Puts all tiled GSPMD shardings on one mesh when possible (see `common_mesh`);
        replicated values go on the program's mesh when it has exactly one, as JAX writes them."""
        tiled = []
        for text in dict.fromkeys(texts):
            try:
                gs = GspmdSharding.parse(text).canonical()
            except ValueError:
                continue
            if gs.kind == "tiled" and not set(gs.last_tile_dims) - {"replicated"}:
                tiled.append((text, gs))
        common = common_mesh([gs for _, gs in tiled])
        candidates = {m for m in self.by_name.values() if m is not None and m.axes}
        if common is not None:
            mesh, shardings = common
            self.on_common_mesh = {text: (mesh, sharding) for (text, _), sharding in zip(tiled, shardings)}
            candidates.add(mesh)
        else:
            for text, _ in tiled:
                mesh, _ = gspmd_to_sdy(text)
                if mesh.axes:
                    candidates.add(mesh)
        self.replicated_mesh = next(iter(candidates)) if len(candidates) == 1 else DeviceMesh()

    def add(self, name: str, mesh_attr: ir.Attribute) -> None:
        if name in self.by_name:
            return
        self._create(name, mesh_attr)
        try:
            self.by_name[name] = DeviceMesh.from_sdy(str(mesh_attr))
        except ValueError:
            self.by_name[name] = None

    def name_for(self, mesh: DeviceMesh) -> str:
        for name, existing in self.by_name.items():
            if existing == mesh:
                return name
        base = "empty_mesh" if mesh.size == 1 and not mesh.axes and mesh.device_ids is None else "mesh"
        name, counter = base, 0
        while name in self.by_name:
            counter += 1
            name = f"{base}_{counter}"
        self._create(name, ir.Attribute.parse(f"#sdy.mesh{mesh.to_sdy()}"))
        self.by_name[name] = mesh
        return name

    def _create(self, name: str, mesh_attr: ir.Attribute) -> None:
        first = self.body.operations[0] if len(self.body.operations) else None
        point = ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(self.body)
        with point, ir.Location.unknown():
            sdy.MeshOp(name, mesh_attr)


def import_shardings(module: ir.Operation, context: PassContext) -> None:
    with module.context, ir.Location.unknown():
        meshes = _Meshes(module)
        _import_round_trip_meshes(module, meshes)
        meshes.plan_gspmd(_gspmd_strings(module))
        for op in list(module.regions[0].blocks[0].operations):
            if op.operation.name == "func.func":
                _import_function(op.operation, meshes, context)


def _gspmd_strings(module: ir.Operation) -> list[str]:
    """Every GSPMD sharding string of the module, on ops, arguments and results."""
    found: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        attributes = [op.attributes]
        if op.name == "func.func":
            attributes += [
                ir.DictAttr(a)
                for key in ("arg_attrs", "res_attrs")
                if key in op.attributes
                for a in ir.ArrayAttr(op.attributes[key])
            ]
        found.extend(ir.StringAttr(attrs[GSPMD_SHARDING]).value for attrs in attributes if GSPMD_SHARDING in attrs)
        return ir.WalkResult.ADVANCE

    module.walk(visit)
    return found


def _import_round_trip_meshes(module: ir.Operation, meshes: _Meshes) -> None:
    frontend = _frontend_attributes(module)
    text = frontend.pop(ROUND_TRIP_MESHES, None)
    if text is None:
        return
    for named in ir.DictAttr(ir.Attribute.parse(text)):
        meshes.add(named.name, named.attr)
    _set_frontend_attributes(module, frontend)


def _import_function(func: ir.Operation, meshes: _Meshes, context: PassContext) -> None:
    # Ops first: @xla.sdy.FuncResultSharding calls say what the results' shardings are.
    result_shardings: dict[int, ir.Attribute] = {}
    for block in func.regions[0].blocks:
        _import_ops(block, meshes, context, result_shardings)
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    for key, types in (("arg_attrs", function_type.inputs), ("res_attrs", function_type.results)):
        if key in func.attributes:
            dicts = [_dict(a) for a in ir.ArrayAttr(func.attributes[key])]
        else:
            dicts = [{} for _ in types]
        if key == "res_attrs":
            for index, sharding in result_shardings.items():
                dicts[index][SDY_SHARDING] = sharding
        updated = [_value_sharding(d, _rank(t), meshes, func, context) for d, t in zip(dicts, types)]
        if key in func.attributes or any(updated):
            func.attributes[key] = ir.ArrayAttr.get([ir.DictAttr.get(d) for d in updated])


def _value_sharding(attrs: dict, rank: int | None, meshes: _Meshes, where, context: PassContext) -> dict:
    """The attribute dict of an argument or result, with its sharding as `sdy.sharding`."""
    attrs = dict(attrs)
    frontend = _frontend_dict(attrs)
    round_trip = frontend.pop(ROUND_TRIP_SHARDING, None)
    if round_trip is not None:
        attrs[SDY_SHARDING] = ir.Attribute.parse(round_trip)
        _store_frontend(attrs, frontend)
    if SDY_SHARDING in attrs:
        attrs.pop(GSPMD_SHARDING, None)
        return attrs
    if GSPMD_SHARDING in attrs and rank is not None:
        converted = _from_gspmd(ir.StringAttr(attrs[GSPMD_SHARDING]).value, rank, meshes, where, context)
        if converted is not None:
            attrs[SDY_SHARDING] = converted
            del attrs[GSPMD_SHARDING]
    return attrs


def _from_gspmd(text: str, rank: int, meshes: _Meshes, where, context: PassContext) -> ir.Attribute | None:
    """An sdy sharding attribute for a GSPMD string, or None to keep the string as it is."""
    try:
        mesh, sharding = meshes.on_common_mesh.get(text) or gspmd_to_sdy(text, rank)
    except ValueError as error:
        context.warn(where, f"GSPMD sharding '{text}' kept as it is: {error}")
        return None
    if isinstance(sharding, ManualSharding) or (mesh.is_maximal and rank > 0):
        # sdy has no tensor sharding for these (manual axes live on sdy.manual_computation,
        # maximal shardings only on rank-0 values): the GSPMD string stays, which XLA honours.
        return None
    if mesh == DeviceMesh():
        mesh = meshes.replicated_mesh
    sharding = TensorSharding(meshes.name_for(mesh), sharding.dims, sharding.replicated_axes, sharding.unreduced_axes)
    return ir.Attribute.parse(sharding.format())


def _import_ops(
    block: ir.Block, meshes: _Meshes, context: PassContext, result_shardings: dict[int, ir.Attribute]
) -> None:
    for op in list(block.operations):
        operation = op.operation
        for region in operation.regions:
            for inner in region.blocks:
                _import_ops(inner, meshes, context, result_shardings)
        frontend = _frontend_attributes(operation)
        round_trip = frontend.get(ROUND_TRIP_SHARDING)
        if operation.name == "stablehlo.custom_call":
            target = ir.StringAttr(operation.attributes["call_target_name"]).value
            if target == ROUND_TRIP_RESULT_SHARDING and round_trip is not None:
                _record_result_sharding(operation, ir.Attribute.parse(round_trip), result_shardings)
                continue
            if target == ROUND_TRIP_CONSTRAINT and round_trip is not None:
                _replace_with_constraint(operation, _first_of(ir.Attribute.parse(round_trip)))
                continue
            if target == GSPMD_CONSTRAINT and GSPMD_SHARDING in operation.attributes and len(operation.results) == 1:
                rank = _rank(operation.results[0].type)
                text = ir.StringAttr(operation.attributes[GSPMD_SHARDING]).value
                converted = _from_gspmd(text, rank, meshes, operation, context) if rank is not None else None
                if converted is not None:
                    _replace_with_constraint(operation, converted)
                continue
        if round_trip is not None:
            operation.attributes[SDY_SHARDING] = ir.Attribute.parse(round_trip)
            del frontend[ROUND_TRIP_SHARDING]
            _set_frontend_attributes(operation, frontend)


def _record_result_sharding(
    call: ir.Operation, per_value: ir.Attribute, result_shardings: dict[int, ir.Attribute]
) -> None:
    """`@xla.sdy.FuncResultSharding` marks a returned value: move its sharding to the result."""
    sharding = _first_of(per_value)
    for use in list(call.results[0].uses):
        if use.owner.name == "func.return":
            result_shardings[use.operand_number] = sharding
    call.results[0].replace_all_uses_with(call.operands[0])
    call.erase()


def _replace_with_constraint(call: ir.Operation, sharding: ir.Attribute) -> None:
    with ir.InsertionPoint(call), call.location:
        constraint = sdy.ShardingConstraintOp(call.operands[0], sharding)
    call.results[0].replace_all_uses_with(constraint.result)
    call.erase()


def _first_of(attr: ir.Attribute) -> ir.Attribute:
    """The single tensor sharding inside a `#sdy.sharding_per_value<[...]>`, or the attribute itself."""
    text = str(attr)
    if text.startswith("#sdy.sharding_per_value<[") and text.endswith("]>"):
        return ir.Attribute.parse("#sdy.sharding" + text[len("#sdy.sharding_per_value<[") : -2])
    return attr


def _rank(type_: ir.Type) -> int | None:
    try:
        return ir.RankedTensorType(type_).rank
    except ValueError:
        return None


def _dict(attr: ir.Attribute) -> dict[str, ir.Attribute]:
    return {named.name: named.attr for named in ir.DictAttr(attr)}


def _frontend_dict(attrs: dict[str, ir.Attribute]) -> dict[str, str]:
    if FRONTEND_ATTRIBUTES not in attrs:
        return {}
    return {
        named.name: ir.StringAttr(named.attr).value
        for named in ir.DictAttr(attrs[FRONTEND_ATTRIBUTES])
        if isinstance(named.attr, ir.StringAttr)
    }


def _store_frontend(attrs: dict[str, ir.Attribute], frontend: dict[str, str]) -> None:
    if frontend:
        attrs[FRONTEND_ATTRIBUTES] = ir.DictAttr.get({k: ir.StringAttr.get(v) for k, v in frontend.items()})
    else:
        attrs.pop(FRONTEND_ATTRIBUTES, None)


def _frontend_attributes(operation: ir.Operation) -> dict[str, str]:
    if FRONTEND_ATTRIBUTES not in operation.attributes:
        return {}
    return _frontend_dict({FRONTEND_ATTRIBUTES: operation.attributes[FRONTEND_ATTRIBUTES]})


def _set_frontend_attributes(operation: ir.Operation, frontend: dict[str, str]) -> None:
    if frontend:
        operation.attributes[FRONTEND_ATTRIBUTES] = ir.DictAttr.get(
            {k: ir.StringAttr.get(v) for k, v in frontend.items()}
        )
    elif FRONTEND_ATTRIBUTES in operation.attributes:
        del operation.attributes[FRONTEND_ATTRIBUTES]
