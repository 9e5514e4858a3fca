"""`hlopar-auto-sharding`: choose how every tensor and op of `@main` is split on one mesh.

Alpa §4 on StableHLO: Shardy's op sharding rules give each op's factors, strategies assign
mesh axes to factors, CP-SAT picks one strategy per op minimizing communication, resharding
and (for replicated heavy ops) compute time (Eq. 1), and the choice is written back as
`sdy` shardings that stock jaxlib compiles: `sdy.mesh`, `sdy.sharding` on arguments,
results and every op. Shardings already in the input are kept as hard constraints.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, LogicalMesh, logical_mesh
from hlopar.analysis.auto_sharding.graph_problem import ShardingProblem, build_problem
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import ShardingPerValue, ShardingSpec, TensorSharding
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.ir.graph import FuncGraph
from hlopar.passes.base import ModulePass, PassContext, option, parse_str_tuple

SDY_SHARDING = "sdy.sharding"
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """`16GiB`, `500MB`, `1e9` → bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit '{unit}' (use B, KB, MB, GB, KiB, MiB, GiB)")
    return float(number) * _UNITS[unit]


def parse_float_tuple(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in parse_str_tuple(text))


@dataclass
class AutoShardingPass(ModulePass):
    name = "hlopar-auto-sharding"
    summary = "choose a sharding for every op on one device mesh (Alpa's intra-op ILP) and write it as sdy"

    mesh_shape: tuple[int, ...] = option((1,), "logical mesh shape, e.g. 2x4")
    axis_names: tuple[str, ...] = option((), "mesh axis names (default x, y, z, ...)")
    preset: str = option("cpu", f"cluster preset for bandwidths, FLOP/s and memory ({', '.join(sorted(CLUSTER_PRESETS))})")
    latency: tuple[float, ...] = option((), "per-axis latency in seconds (overrides the preset)", parse=parse_float_tuple)
    bandwidth: tuple[float, ...] = option((), "per-axis bandwidth in bytes/s (overrides the preset)", parse=parse_float_tuple)
    memory_budget: float | None = option(None, "bytes per device, e.g. 16GiB (none: no limit)", parse=parse_bytes)
    time_limit: float = option(60.0, "solver time limit in seconds (keeps the best plan found)")
    prefer_reduce_scatter: bool = option(False, "shard weight updates (ZeRO-like): reduce-scatter gradients")
    force_batch_dim: str | None = option(None, "split the batch dimension over this mesh axis")
    merge: bool = option(True, "fold cheap ops into their deepest operand before solving (Alpa §4.2)")
    tie_outputs: bool = option(True, "give result i the layout of argument i when their types match (a training step's new and old state)")
    report: str | None = option(None, "write a JSON report of the plan to this path")

    def run(self, module: ir.Operation, context: PassContext) -> None:
        mesh = self._mesh()
        func = entry_function(module)
        if func is None:
            self.fail(module, "no entry function: expected @main or a single public function")
        start = time.perf_counter()
        _run_upstream(module, "func.func(sdy-populate-op-sharding-rules)")
        graph = FuncGraph.from_func(func)
        mesh_name = _mesh_name(module, mesh)
        rules = {op.index: rule_of(op.mlir_op) for op in graph.ops}
        arg_specs, result_specs, constraint_specs = self._user_shardings(module, graph, mesh, mesh_name)
        problem = build_problem(
            graph, rules, mesh,
            arg_shardings=arg_specs, result_shardings=result_specs, constraint_specs=constraint_specs,
            memory_budget=self.memory_budget, merge=self.merge, strategy_filter=self._batch_filter(graph),
            tied_results=_tied_results(func) if self.tie_outputs else {},
        )
        for op, message in problem.warnings:
            context.warn(op.mlir_op, message)
        build_seconds = time.perf_counter() - start
        solution = ilp.solve(problem.problem, time_limit=self.time_limit)
        if solution.status not in ("OPTIMAL", "FEASIBLE"):
            detail = f": {solution.message}" if getattr(solution, "message", "") else ""
            self.fail(func, f"no sharding plan fits ({solution.status}){detail}")
        _run_upstream(module, "func.func(sdy-drop-sharding-rules)")
        with module.context, ir.Location.unknown():
            _write_plan(module, func, graph, problem, solution.choices, mesh, mesh_name)
        if self.report:
            _write_report(Path(self.report), self, mesh, graph, problem, solution, build_seconds)

    def _mesh(self) -> LogicalMesh:
        try:
            return logical_mesh(
                self.mesh_shape, self.axis_names or None, preset=self.preset,
                latencies=self.latency or None, bandwidths=self.bandwidth or None,
                memory_budget=self.memory_budget,
            )
        except ValueError as error:
            raise DiagnosticError([Diagnostic("error", f"{self.name}: {error}")]) from None

    def _user_shardings(self, module, graph: FuncGraph, mesh: LogicalMesh, mesh_name: str):
        """Shardings in the input, as specs on our mesh: hard constraints for the ILP."""
        func = graph.mlir_func

        def spec_of(attr: ir.Attribute, where) -> ShardingSpec:
            sharding = TensorSharding.parse(str(attr))
            if sharding.mesh_name != mesh_name:
                self.fail(where, f"sharding {attr} is on mesh @{sharding.mesh_name}, not the planned mesh @{mesh_name}")
            try:
                return sharding.to_spec()
            except ValueError as error:
                self.fail(where, f"cannot plan around sharding {attr}: {error}")

        def from_attrs(key: str) -> dict[int, ShardingSpec]:
            if key not in func.attributes:
                return {}
            found = {}
            for i, attrs in enumerate(ir.ArrayAttr(func.attributes[key])):
                attrs = ir.DictAttr(attrs)
                if SDY_SHARDING in attrs:
                    found[i] = spec_of(attrs[SDY_SHARDING], func)
            return found

        constraints = {}
        for op in graph.ops:
            if op.name == "sdy.sharding_constraint":
                constraints[op.index] = spec_of(op.mlir_op.attributes["sharding"], op.mlir_op)
        return from_attrs("arg_attrs"), from_attrs("res_attrs"), constraints

    def _batch_filter(self, graph: FuncGraph):
        """With `force-batch-dim`, strategies must split dim 0 of batch-sized values over the
        axis. The batch size is the leading dim of the last argument (JAX train steps take
        the batch last)."""
        if self.force_batch_dim is None or not graph.args:
            return None
        if self.force_batch_dim not in self._mesh().axis_names:
            self.fail(graph.mlir_func, f"force-batch-dim: no mesh axis '{self.force_batch_dim}'")
        shape = graph.values[graph.args[-1]].shape
        if not shape:
            return None
        batch, axis = shape[0], self.force_batch_dim

        def keep(shapes, strategy) -> bool:
            return all(spec is None or not shape_ or shape_[0] != batch or axis in spec.dims[0]
                       for spec, shape_ in zip(strategy.result_specs, shapes))

        return keep


def _tied_results(func: ir.Operation) -> dict[int, int]:
    """Result i ↔ argument i where the types match: JAX flattens a training step's state the
    same way in and out, so these are the new and old values of the same state."""
    function_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    inputs, results = list(function_type.inputs), list(function_type.results)
    return {i: i for i in range(min(len(inputs), len(results))) if inputs[i] == results[i]}


def entry_function(module: ir.Operation) -> ir.Operation | None:
    """`@main`, else the only public function."""
    public = []
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name != "func.func":
            continue
        name = ir.StringAttr(op.operation.attributes["sym_name"]).value
        if name == "main":
            return op.operation
        visibility = op.operation.attributes["sym_visibility"] if "sym_visibility" in op.operation.attributes else None
        if visibility is None or ir.StringAttr(visibility).value == "public":
            public.append(op.operation)
    return public[0] if len(public) == 1 else None


def _run_upstream(module: ir.Operation, pipeline: str) -> None:
    manager = passmanager.PassManager.parse(f"builtin.module({pipeline})", context=module.context)
    try:
        manager.run(module)
    except ir.MLIRError as error:
        raise DiagnosticError.from_mlir_error(error) from None


def _mesh_name(module: ir.Operation, mesh: LogicalMesh) -> str:
    """The name of the module's mesh equal to ours, or a fresh name for a new one."""
    wanted = mesh.to_device_mesh()
    names = set()
    for op in module.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh":
            name = ir.StringAttr(op.operation.attributes["sym_name"]).value
            names.add(name)
            try:
                if DeviceMesh.from_sdy(str(op.operation.attributes["mesh"])) == wanted:
                    return name
            except ValueError:
                pass
    name, counter = "mesh", 0
    while name in names:
        counter += 1
        name = f"mesh_{counter}"
    return name


def _write_plan(module, func, graph: FuncGraph, problem: ShardingProblem, choices, mesh: LogicalMesh, mesh_name: str) -> None:
    body = module.regions[0].blocks[0]
    if not any(op.operation.name == "sdy.mesh" and ir.StringAttr(op.operation.attributes["sym_name"]).value == mesh_name
               for op in body.operations):
        with ir.InsertionPoint(body.operations[0]):
            sdy.MeshOp(mesh_name, ir.Attribute.parse(f"#sdy.mesh{mesh.to_device_mesh().to_sdy()}"))

    def sharding(spec: ShardingSpec) -> ir.Attribute:
        return ir.Attribute.parse(TensorSharding.from_spec(mesh_name, spec).format())

    chosen = [node.strategies[c] for node, c in zip(problem.nodes, choices)]
    value_spec: dict[int, ShardingSpec] = {}
    for position, node_index in problem.arg_node.items():
        spec = chosen[node_index].result_specs[0]
        if spec is not None:
            value_spec[graph.args[position]] = spec
    for op in graph.ops:
        strategy = chosen[problem.op_node[op.index]]
        for value_id, spec in zip(op.results, strategy.result_specs):
            if spec is not None:
                value_spec[value_id] = spec
        if op.name == "sdy.sharding_constraint" or not op.results:
            continue
        if all(spec is not None for spec in strategy.result_specs):
            per_value = ShardingPerValue(tuple(TensorSharding.from_spec(mesh_name, s) for s in strategy.result_specs))
            op.mlir_op.attributes[SDY_SHARDING] = ir.Attribute.parse(per_value.format())
    _set_value_attrs(func, "arg_attrs", [value_spec.get(v) for v in graph.args], sharding)
    _set_value_attrs(func, "res_attrs", [value_spec.get(v) for v in graph.results], sharding)


def _set_value_attrs(func, key: str, specs, sharding) -> None:
    if key in func.attributes:
        dicts = [{n.name: n.attr for n in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]
    else:
        dicts = [{} for _ in specs]
    for attrs, spec in zip(dicts, specs):
        if spec is not None and SDY_SHARDING not in attrs:
            attrs[SDY_SHARDING] = sharding(spec)
    func.attributes[key] = ir.ArrayAttr.get([ir.DictAttr.get(d) for d in dicts])


def _write_report(path: Path, options: AutoShardingPass, mesh: LogicalMesh, graph: FuncGraph, problem: ShardingProblem,
                  solution, build_seconds: float) -> None:
    ops = []
    for node, choice in zip(problem.nodes, solution.choices):
        strategy = node.strategies[choice]
        entry = {
            "node": node.name,
            "kind": node.kind,
            "strategy": strategy.describe(),
            "result_specs": [str(s) if s is not None else None for s in strategy.result_specs],
            "operand_specs": [str(s) if s is not None else None for s in strategy.operand_specs],
            "communication_s": strategy.communication_cost,
            "compute_s": strategy.compute_cost,
            "memory_bytes": strategy.memory,
            "collectives": [str(c) for c in strategy.collectives],
            "num_strategies": len(node.strategies),
            "follows": problem.nodes[node.leader].name if node.leader is not None else None,
        }
        if node.kind == "op":
            location = graph.ops[node.index].location
            entry["location"] = f"{location.file}:{location.line}:{location.col}" if location and location.file else None
        ops.append(entry)
    report = {
        "pass": options.pipeline_text(),
        "mesh": {"shape": list(mesh.shape), "axes": list(mesh.axis_names),
                 "bandwidth_bytes_per_s": [a.bandwidth_bytes_per_s for a in mesh.axes],
                 "latency_s": [a.latency_s for a in mesh.axes]},
        "objective_s": solution.objective,
        "status": solution.status,
        "gap": solution.gap,
        "solve_s": solution.solve_seconds,
        "build_s": build_seconds,
        "ilp_sizes": solution.sizes,
        "ops": ops,
    }
    path.write_text(json.dumps(report, indent=1))
