"""The intra-op plan of a module, written back as `sdy` shardings (Alpa §4 on StableHLO).

Shardy's op sharding rules give each op's factors, strategies assign mesh axes to factors,
CP-SAT picks one strategy per op minimizing communication, resharding and (for replicated
heavy ops) compute time (Eq. 1), and the choice is written back as `sdy` shardings that
stock jaxlib compiles: `sdy.mesh`, `sdy.sharding` on arguments, results and every op, and
`sdy.sharding_constraint`s on op results and converted operands (XLA keeps only those, so
that it executes the plan). Shardings already in the input are kept as hard constraints.

`plan_module` is the whole of `hlopar-auto-sharding` but its option parsing and report
file (`passes/auto_sharding.py`); stage construction runs it in two halves on each stage's
function (`start_planning`, `ModulePlanning.finish`: `passes/mpmd_program.py` solves the
stages' ILPs together in between). It is not a pass: the IR side of the intra-op planner that two
passes share, so that neither imports the other (docs/architecture.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import sdy

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.batch_flow import batch_dims
from hlopar.analysis.auto_sharding.cluster import LogicalMesh, logical_mesh
from hlopar.analysis.auto_sharding.graph_problem import ShardingProblem, build_problem
from hlopar.analysis.auto_sharding.problem import Problem
from hlopar.analysis.auto_sharding.resharding import resharding_collectives
from hlopar.analysis.auto_sharding.rules import rule_of
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.module_meshes import module_meshes
from hlopar.analysis.sharding import ShardingPerValue, ShardingSpec, TensorSharding
from hlopar.analysis.step_io import RolesError, batch_arguments, state_pairs
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError, source_location
from hlopar.ir.graph import FuncGraph
from hlopar.ir.module import planned_functions, run_function_pass

__all__ = ["NAME", "SDY_SHARDING", "IntraOpOptions", "ModulePlan", "ModulePlanning", "plan_module", "start_planning"]

# The planner's name: its pass's pipeline name, and what its messages start with (also
# where stage construction runs it on a stage).
NAME = "hlopar-auto-sharding"
SDY_SHARDING = "sdy.sharding"

# Where warnings go: an op (or a location) and the message.
Warn = Callable[[Any, str], None]


@dataclass(frozen=True)
class IntraOpOptions:
    """What the plan depends on: the fields of `hlopar-auto-sharding`'s options of the same
    names, with the same defaults (their help is there)."""

    mesh_shape: tuple[int, ...] = (1,)
    axis_names: tuple[str, ...] = ()
    preset: str = "cpu"
    latency: tuple[float, ...] = ()
    bandwidth: tuple[float, ...] = ()
    memory_budget: float | None = None
    time_limit: float = 60.0
    prefer_reduce_scatter: bool = False
    weight_update_sharding: bool = False
    force_batch_dim: str | None = None
    data_parallel: bool = False
    batch_args: tuple[int, ...] | None = None
    merge: bool = False
    partial_sums: bool = False
    tie_outputs: bool = True
    reshard_constraints: bool = True


@dataclass(frozen=True)
class ModulePlan:
    """What `plan_module` decided: the mesh it planned on and one report per planned function
    (`@main` first; the fields of docs/auto_sharding_report.md)."""

    mesh: LogicalMesh
    functions: tuple[dict, ...]


def plan_module(module: ir.Operation, options: IntraOpOptions, warn: Warn) -> ModulePlan | None:
    """Plans every public function of `module` on one mesh and writes the plan into it; None
    where no function is public. Raises `DiagnosticError` where no plan fits or an option
    does not apply to the module."""
    with module.context, ir.Location.unknown():
        return _Planner(options, warn).run(module)


def start_planning(module: ir.Operation, options: IntraOpOptions, warn: Warn) -> ModulePlanning | None:
    """`plan_module` up to its ILPs, for a caller that solves the ILPs of several modules
    together (the stages of a pipeline, `mpmd_program`): every public function's problem
    built (`ModulePlanning.problems`), nothing written; `ModulePlanning.finish` takes their
    solutions (`ilp.solve` with `options.time_limit`, wherever it ran) and writes the plan.
    Every function is built before any is written, where `plan_module` takes them one by
    one: the same plan for a module of one public function."""
    with module.context, ir.Location.unknown():
        return _Planner(options, warn).start(module)


@dataclass(frozen=True)
class _Built:
    """One function's ILP, built, with what writing its plan reads."""

    func: Any
    graph: FuncGraph
    problem: ShardingProblem
    constraints: _UserShardings
    build_seconds: float


@dataclass(frozen=True)
class ModulePlanning:
    """A module's functions with their ILPs built, waiting for the solutions (`start_planning`)."""

    planner: _Planner
    module: ir.Operation
    analysable: tuple
    mesh: LogicalMesh
    mesh_name: str
    functions: tuple[_Built, ...]

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(built.problem.problem for built in self.functions)

    @property
    def time_limit(self) -> float:
        """What each of `problems` is solved with (`ilp.solve`'s `time_limit`)."""
        return self.planner.options.time_limit

    def finish(self, solutions) -> ModulePlan:
        """Writes the plan of each function from its solution (in `problems`' order)."""
        with self.module.context, ir.Location.unknown():
            reports = [
                self.planner._write(self.module, built, solution, self.mesh, self.mesh_name)
                for built, solution in zip(self.functions, solutions, strict=True)
            ]
            run_function_pass(self.module, list(self.analysable), "sdy-drop-sharding-rules")
        return ModulePlan(self.mesh, tuple(reports))


def _fail(op_or_location: Any, message: str) -> NoReturn:
    location = getattr(op_or_location, "location", op_or_location)
    raise DiagnosticError([Diagnostic("error", f"{NAME}: {message}", source_location(location))])


@dataclass
class _UserShardings:
    args: dict[int, ShardingSpec] = field(default_factory=dict)
    results: dict[int, ShardingSpec] = field(default_factory=dict)
    constraint_ops: dict[int, ShardingSpec] = field(default_factory=dict)
    op_results: dict[int, tuple[ShardingSpec, ...]] = field(default_factory=dict)
    kept_ops: set[int] = field(default_factory=set)  # ops whose own sdy.sharding stays
    # Shardings on a mesh whose axes all have size 1 say "replicated": they are rewritten
    # onto the planning mesh (argument and result positions, constraint op indices).
    rewritten_args: set[int] = field(default_factory=set)
    rewritten_results: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Planner:
    options: IntraOpOptions
    warn: Warn

    def run(self, module: ir.Operation) -> ModulePlan | None:
        """Each function built, solved and written before the next is built."""
        prepared = self._prepare(module)
        if prepared is None:
            return None
        funcs, analysable, mesh, mesh_name = prepared
        reports = []
        for func in funcs:
            built = self._build(module, func, func in analysable, mesh, mesh_name)
            reports.append(self._write(module, built, self._solve(built), mesh, mesh_name))
        run_function_pass(module, analysable, "sdy-drop-sharding-rules")
        return ModulePlan(mesh, tuple(reports))

    def start(self, module: ir.Operation) -> ModulePlanning | None:
        prepared = self._prepare(module)
        if prepared is None:
            return None
        funcs, analysable, mesh, mesh_name = prepared
        built = tuple(self._build(module, func, func in analysable, mesh, mesh_name) for func in funcs)
        return ModulePlanning(self, module, tuple(analysable), mesh, mesh_name, built)

    def _prepare(self, module: ir.Operation) -> tuple | None:
        """(public functions, those Shardy's rules cover, mesh, mesh name), the rules
        populated; None where no function is public."""
        funcs = planned_functions(module)
        if not funcs:
            return None  # only private functions: nothing is an entry point
        mesh, mesh_name = self._planning_mesh(module)
        analysable = [f for f in funcs if _analysable(f)]
        for func in funcs:
            if func not in analysable:
                self.warn(
                    func,
                    f"{NAME}: '{_symbol(func)}' has dynamic shapes or tuple values, which "
                    f"Shardy's sharding rules do not cover: it runs replicated",
                )
        run_function_pass(module, analysable, "sdy-populate-op-sharding-rules")
        return funcs, analysable, mesh, mesh_name

    def _solve(self, built: _Built) -> ilp.Solution:
        return ilp.solve(built.problem.problem, time_limit=self.options.time_limit)

    def _build(self, module, func, analysable: bool, mesh: LogicalMesh, mesh_name: str) -> _Built:
        start = time.perf_counter()
        graph = FuncGraph.from_func(func)
        rules = {op.id: rule_of(op.mlir_op) for op in graph.walk()} if analysable else {}
        constraints = self._user_shardings(module, graph, mesh_name)
        options = self.options
        split = options.prefer_reduce_scatter or options.weight_update_sharding
        pairs = state_pairs(graph) if options.tie_outputs or split or options.data_parallel else ()
        tied = {result: arg for arg, result in pairs} if options.tie_outputs or split else {}
        problem = build_problem(
            graph,
            rules,
            mesh,
            arg_shardings=constraints.args,
            result_shardings=constraints.results,
            constraint_specs=constraints.constraint_ops,
            op_result_shardings=constraints.op_results,
            memory_budget=options.memory_budget,
            merge=options.merge,
            partial_sums=options.partial_sums,
            split_dims=self._batch_splits(graph, rules, mesh, pairs),
            tied_results=tied,
            split_args=frozenset(tied.values()) if options.weight_update_sharding else frozenset(),
            preferred_split_args=frozenset(tied.values()) if options.prefer_reduce_scatter else frozenset(),
            replicated_args=frozenset(arg for arg, _ in pairs) if options.data_parallel else frozenset(),
        )
        for op, message in problem.warnings:
            self.warn(op.mlir_op, message)
        return _Built(func, graph, problem, constraints, time.perf_counter() - start)

    def _write(self, module, built: _Built, solution: ilp.Solution, mesh: LogicalMesh, mesh_name: str) -> dict:
        """The plan of `built` from its ILP's `solution`, written into the module; its report."""
        if solution.status not in ("OPTIMAL", "FEASIBLE"):
            detail = f": {solution.message}" if solution.message else ""
            _fail(built.func, f"no sharding plan fits ({solution.status}){detail}")
        _write_plan(
            module,
            built.func,
            built.graph,
            built.problem,
            solution.choices,
            mesh,
            mesh_name,
            built.constraints,
            self.options.reshard_constraints,
        )
        return _function_report(built.graph, built.problem, solution, built.build_seconds, mesh)

    def _planning_mesh(self, module: ir.Operation) -> tuple[LogicalMesh, str]:
        """The mesh asked for, unless the input's shardings already live on a mesh of another
        shape: the user's constraints win over the option, with a warning."""
        requested = self._mesh()
        user = _user_meshes(module)
        for name, device_mesh in user.items():
            if device_mesh.shape == requested.shape and device_mesh.device_ids is None:
                return self._mesh(device_mesh.axis_names), name
        if len(user) == 1:
            ((name, device_mesh),) = user.items()
            if device_mesh.device_ids is None:
                self.warn(
                    module,
                    f"{NAME}: the input's shardings are on mesh @{name} = {device_mesh.to_sdy()}; "
                    f"planning on it instead of mesh-shape={'x'.join(map(str, self.options.mesh_shape))}",
                )
                return self._mesh(device_mesh.axis_names, device_mesh.shape), name
        return requested, _fresh_mesh_name(module)

    def _mesh(self, names=None, shape=None) -> LogicalMesh:
        options = self.options
        try:
            return logical_mesh(
                shape or options.mesh_shape,
                names or options.axis_names or None,
                preset=options.preset,
                latencies=options.latency or None,
                bandwidths=options.bandwidth or None,
                memory_budget=options.memory_budget,
            )
        except ValueError as error:
            raise DiagnosticError([Diagnostic("error", f"{NAME}: {error}")]) from None

    def _user_shardings(self, module, graph: FuncGraph, mesh_name: str) -> _UserShardings:
        """Shardings in the input: on the planning mesh they are hard constraints of the ILP;
        others (another mesh, sub-axes, unreduced axes) are kept as they are, unplanned."""
        func = graph.mlir_func
        found = _UserShardings()

        trivial = _trivial_meshes(module)

        def spec_of(attr: ir.Attribute, where) -> ShardingSpec | None:
            text = str(attr)
            try:
                sharding = TensorSharding.parse(text)
                if sharding.mesh_name in trivial:
                    return ShardingSpec.replicated(sharding.rank)
                if sharding.mesh_name != mesh_name:
                    raise ValueError(f"it is on mesh @{sharding.mesh_name}, not the planned mesh @{mesh_name}")
                return sharding.to_spec()
            except ValueError as error:
                self.warn(where, f"{NAME}: sharding {text} kept as it is, not planned around: {error}")
                return None

        for key, target, rewritten in (
            ("arg_attrs", found.args, found.rewritten_args),
            ("res_attrs", found.results, found.rewritten_results),
        ):
            if key not in func.attributes:
                continue
            for i, attrs in enumerate(ir.ArrayAttr(func.attributes[key])):
                attrs = ir.DictAttr(attrs)
                if SDY_SHARDING in attrs and (spec := spec_of(attrs[SDY_SHARDING], func)) is not None:
                    target[i] = spec
                    if TensorSharding.parse(str(attrs[SDY_SHARDING])).mesh_name in trivial:
                        rewritten.add(i)
        for op in graph.walk():
            operation = op.mlir_op
            if op.name == "sdy.sharding_constraint":
                spec = spec_of(operation.attributes["sharding"], operation)
                if spec is not None:
                    found.constraint_ops[op.id] = spec
                    if TensorSharding.parse(str(operation.attributes["sharding"])).mesh_name in trivial:
                        operation.attributes["sharding"] = ir.Attribute.parse(
                            TensorSharding.from_spec(mesh_name, spec).format()
                        )
            elif SDY_SHARDING in operation.attributes:
                found.kept_ops.add(op.id)
                text = str(operation.attributes[SDY_SHARDING])
                try:
                    per_value = ShardingPerValue.parse(text)
                except ValueError as error:
                    self.warn(operation, f"{NAME}: sharding {text} kept as it is: {error}")
                    continue
                specs = [spec_of(ir.Attribute.parse(s.format()), operation) for s in per_value]
                if all(spec is not None for spec in specs):
                    found.op_results[op.id] = tuple(specs)
        return found

    def _batch_splits(
        self, graph: FuncGraph, rules, mesh: LogicalMesh, pairs
    ) -> dict[int, tuple[int, tuple[str, ...]]]:
        """With `force-batch-dim` (or `data-parallel`: every mesh axis), the dimension of
        each value that holds the batch's examples (`batch_flow.batch_dims`, from the batch
        arguments: `batch-args`, or the ones `step_io.batch_arguments` finds) must be split
        over the axis (axes)."""
        options = self.options
        if options.data_parallel:
            axes, option = tuple(a.name for a in mesh.axes if a.size > 1), "data-parallel"
        elif options.force_batch_dim is not None:
            axis, option = options.force_batch_dim, "force-batch-dim"
            if axis not in mesh.axis_names:
                _fail(graph.mlir_func, f"force-batch-dim: no mesh axis '{axis}'")
            if mesh.axes[mesh.axis_names.index(axis)].size == 1:
                self.warn(graph.mlir_func, f"{NAME}: force-batch-dim={axis}: the axis has size 1, so it splits nothing")
                return {}
            axes = (axis,)
        else:
            return {}
        if not graph.args or not axes:
            return {}
        if options.batch_args is not None:
            wrong = [i for i in options.batch_args if not 0 <= i < len(graph.args)]
            if wrong:
                _fail(graph.mlir_func, f"batch-args: '{_symbol(graph.mlir_func)}' has no argument {wrong[0]}")
            batch_args = options.batch_args
        else:
            try:
                batch_args = batch_arguments(graph, pairs or None)
            except RolesError as error:
                _fail(graph.mlir_func, f"{option}: {error}")
        if not batch_args:
            self.warn(graph.mlir_func, f"{NAME}: {option}: no argument holds a batch (batch-args=... names it)")
            return {}
        return {v: (d, axes) for v, d in batch_dims(graph, rules, batch_args).items()}


def _symbol(func: ir.Operation) -> str:
    return ir.StringAttr(func.attributes["sym_name"]).value


def _analysable(func: ir.Operation) -> bool:
    """Whether Shardy's rule pass can look at the function: every value has a static shape
    and none is a tuple (jaxlib's `sdy-populate-op-sharding-rules` rejects the first and
    crashes on the second)."""
    found = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        for value in (*op.results, *(a for r in op.regions for b in r.blocks for a in b.arguments)):
            type_ = value.type
            if isinstance(type_, ir.TupleType) or (
                isinstance(type_, ir.ShapedType) and not (type_.has_rank and type_.has_static_shape)
            ):
                found.append(op)
                return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    return not found


def _user_meshes(module: ir.Operation) -> dict[str, DeviceMesh]:
    """The module's meshes with axes (not empty, not maximal)."""
    return {
        name: mesh
        for name, mesh in module_meshes(module).items()
        if mesh is not None and mesh.axes and not all(size == 1 for _, size in mesh.axes)
    }


def _fresh_mesh_name(module: ir.Operation) -> str:
    names = set(module_meshes(module))
    name, counter = "mesh", 0
    while name in names:
        counter += 1
        name = f"mesh_{counter}"
    return name


def _write_plan(
    module,
    func,
    graph: FuncGraph,
    problem: ShardingProblem,
    choices,
    mesh: LogicalMesh,
    mesh_name: str,
    constraints: _UserShardings,
    reshard_constraints: bool = True,
) -> None:
    body = module.regions[0].blocks[0]
    if not any(
        op.operation.name == "sdy.mesh" and ir.StringAttr(op.operation.attributes["sym_name"]).value == mesh_name
        for op in body.operations
    ):
        with ir.InsertionPoint(body.operations[0]):
            sdy.MeshOp(mesh_name, ir.Attribute.parse(f"#sdy.mesh{mesh.to_device_mesh().to_sdy()}"))

    # Each distinct layout (and list of layouts) is formatted and parsed once: a stage's
    # tens of thousands of ops share a few hundred, and the context uniques attributes.
    attributes: dict = {}

    def sharding(spec: ShardingSpec) -> ir.Attribute:
        found = attributes.get(spec)
        if found is None:
            found = attributes[spec] = ir.Attribute.parse(TensorSharding.from_spec(mesh_name, spec).format())
        return found

    chosen = [node.strategies[c] for node, c in zip(problem.nodes, choices)]

    def spec_of_value(value_id: int) -> ShardingSpec | None:
        if value_id not in problem.producer:
            return None
        node, number = problem.producer[value_id]
        return chosen[node].result_specs[number]

    # Values that Shardy's own ops (explicit collectives such as `sdy.all_slice`, manual
    # computations) read must stay on those ops' meshes: the plan leaves them unannotated.
    pinned = _read_by_sdy_ops(graph)

    def annotate(operation: ir.Operation, specs) -> None:
        if specs and all(spec is not None for spec in specs):
            key = ("per value", tuple(specs))
            found = attributes.get(key)
            if found is None:
                per_value = ShardingPerValue(tuple(TensorSharding.from_spec(mesh_name, s) for s in specs))
                found = attributes[key] = ir.Attribute.parse(per_value.format())
            operation.attributes[SDY_SHARDING] = found

    for op_id, node_index in problem.op_node.items():
        op, node = graph.op(op_id), problem.nodes[node_index]
        if op.name == "sdy.sharding_constraint" or not op.results or op_id in constraints.kept_ops or not node.planned:
            continue
        if pinned.intersection(op.results):
            continue
        annotate(op.mlir_op, chosen[node_index].result_specs)
    if reshard_constraints:
        _constrain_reshards(graph, problem, chosen, spec_of_value, sharding, pinned)
    # The `while` ops themselves stay unannotated: XLA's importer miscounts the elements of
    # a sharding written on a while (it expects one more than the op has results). The ops
    # that produce the loop's operands and the body's ops carry the plan.
    value_spec = {v: None if v in pinned else spec_of_value(v) for v in graph.args}
    # A result the plan gives a layout of its own (tied to its argument, or the user's)
    # leaves in that layout: XLA converts it at the return, as the plan priced.
    result_nodes = {node.index: i for i, node in enumerate(problem.nodes) if node.kind == "result"}
    result_specs = [
        chosen[result_nodes[n]].operand_specs[0] if n in result_nodes else spec_of_value(v)
        for n, v in enumerate(graph.results)
    ]
    _set_value_attrs(func, "arg_attrs", [value_spec.get(v) for v in graph.args], sharding, constraints.rewritten_args)
    _set_value_attrs(func, "res_attrs", result_specs, sharding, constraints.rewritten_results)


def _read_by_sdy_ops(graph: FuncGraph) -> set[int]:
    """Values read by Shardy's own ops other than sharding constraints (explicit collectives
    such as `sdy.all_slice`, `sdy.manual_computation`): they verify that their operands live
    on their own mesh, so a plan on another mesh must not annotate or constrain these values."""
    return {
        v for op in graph.walk() if op.dialect == "sdy" and op.name != "sdy.sharding_constraint" for v in op.operands
    }


def _constrain_reshards(
    graph: FuncGraph, problem: ShardingProblem, chosen, spec_of_value, sharding, pinned: set[int] = frozenset()
) -> None:
    """`sdy.sharding_constraint`s that make XLA execute the plan.

    XLA's Shardy import keeps the shardings of arguments, results and sharding constraints,
    and drops those written on other ops (its round-trip import sets them on known custom
    calls only): on its own, XLA would propagate layouts from the boundaries, and convert
    values wherever and however its partitioner sees fit. So every planned op's results get
    a constraint in the chosen layout (the op's uses read the constrained value), and every
    operand whose producer's layout differs from the one the consumer's strategy reads gets
    one in that layout, so that XLA converts the value where and how the plan priced it.
    One conversion per value, layout and block, before the first consumer that needs it; it
    serves the later ones. Loop-carried values get one on each value entering the loop and
    on each the body yields, in the carried layout.

    An `optimization_barrier` (`jax.checkpoint`'s) has no node: result k is operand k, in
    its layout. Its results get constraints in that layout too, or XLA propagates layouts
    to them from their readers and converts the value inside the recomputed forward (two
    all-gathers of a BERT layer's activations per step that the plan does not have)."""

    def constrain_results(op, specs) -> None:
        after = op.mlir_op
        for value_id, value, spec in zip(op.results, op.mlir_op.results, specs):
            if spec is None or not isinstance(value.type, ir.RankedTensorType) or value_id in pinned:
                continue
            if not spec.rank and not spec.unreduced:
                continue  # scalars are whole on every device anyway, unless a sum is pending
            with ir.InsertionPoint.after(after):
                after = sdy.ShardingConstraintOp(value, sharding(spec)).operation
            value.replace_all_uses_except(after.result, after)

    for op_id, node_index in problem.op_node.items():
        op, node = graph.op(op_id), problem.nodes[node_index]
        if op.name == "sdy.sharding_constraint" or not node.planned:
            continue
        constrain_results(op, chosen[node_index].result_specs)
    for node_index, (op_id, number) in problem.shared.items():  # the layout every reader reads
        op, spec = graph.op(op_id), chosen[node_index].result_specs[0]
        value = op.mlir_op.results[number]
        uses = list(value.uses)
        if len(uses) == 1 and uses[0].owner.name == "sdy.sharding_constraint":
            value = uses[0].owner.results[0]
        with ir.InsertionPoint.after(value.owner):
            read = sdy.ShardingConstraintOp(value, sharding(spec)).operation
        value.replace_all_uses_except(read.result, read)
    for op in graph.walk():
        if op.name == "stablehlo.optimization_barrier":
            constrain_results(op, [spec_of_value(v) for v in op.results])

    made: dict[tuple[int, ShardingSpec, ir.Block], ir.Value] = {}

    def convert(consumer, k: int, value_id: int, spec: ShardingSpec | None) -> None:
        have = spec_of_value(value_id)
        if spec is None or have is None or have == spec or value_id in pinned:
            return
        operation = consumer.mlir_op.operation
        key = (value_id, spec, operation.block)  # the block, not the parent op: a loop's cond and body differ
        if key not in made:
            with ir.InsertionPoint(consumer.mlir_op):
                made[key] = sdy.ShardingConstraintOp(consumer.mlir_op.operands[k], sharding(spec)).result
        elif operation.is_before_in_block(made[key].owner.operation):
            # Made for a later consumer (a loop's operands are converted after every op): it
            # moves up to this one, which reads the same value, so it still dominates both.
            made[key].owner.operation.move_before(operation)
        consumer.mlir_op.operands[k] = made[key]

    for op_id, node_index in problem.op_node.items():
        op, node = graph.op(op_id), problem.nodes[node_index]
        if op.name == "sdy.sharding_constraint" or not node.planned:
            continue
        specs = chosen[node_index].operand_specs
        for k, value_id in enumerate(op.operands):
            if k < len(specs):
                convert(op, k, value_id, specs[k])
    _constrain_loops(graph, problem, chosen, convert, constrain_results)


def _constrain_loops(graph: FuncGraph, problem: ShardingProblem, chosen, convert, constrain_results) -> None:
    """`_constrain_reshards` for `while` loops: each value entering the loop and each the body
    yields converted to the carried layout; a carried sum left pending is constrained so after
    the loop too (XLA would otherwise give the loop the layout its first reader wants, and
    reduce the sum in every iteration)."""
    for op_id, carried in problem.loops.items():
        op = graph.op(op_id)
        if op.name != "stablehlo.while":
            continue
        specs = [chosen[i].result_specs[0] for i in carried]
        for k, value_id in enumerate(op.operands):
            convert(op, k, value_id, specs[k])
        (_,), (body,) = op.regions
        yielded = body.ops[-1]
        for k, value_id in enumerate(yielded.operands):
            convert(yielded, k, value_id, specs[k])
        if any(spec is not None and spec.unreduced for spec in specs):
            constrain_results(op, [spec if spec is not None and spec.unreduced else None for spec in specs])


def _trivial_meshes(module: ir.Operation) -> set[str]:
    """Meshes whose axes all have size 1 (or none): shardings on them mean "replicated"."""
    return {
        name
        for name, mesh in module_meshes(module).items()
        if mesh is not None and mesh.size == 1 and mesh.device_ids is None
    }


def _set_value_attrs(func, key: str, specs, sharding, rewritten: set[int]) -> None:
    if key in func.attributes:
        dicts = [{n.name: n.attr for n in ir.DictAttr(a)} for a in ir.ArrayAttr(func.attributes[key])]
    else:
        dicts = [{} for _ in specs]
    for i, (attrs, spec) in enumerate(zip(dicts, specs)):
        if spec is not None and (SDY_SHARDING not in attrs or i in rewritten):
            attrs[SDY_SHARDING] = sharding(spec)
    func.attributes[key] = ir.ArrayAttr.get([ir.DictAttr.get(d) for d in dicts])


def _function_report(
    graph: FuncGraph, problem: ShardingProblem, solution, build_seconds: float, mesh: LogicalMesh
) -> dict:
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
            location = graph.op(node.index).location
            entry["location"] = (
                f"{location.file}:{location.line}:{location.col}" if location and location.file else None
            )
        ops.append(entry)
    reshards = []
    converted = set()  # (value, layout, block): one sdy.sharding_constraint serves every consumer
    for edge, (info, number, k) in zip(problem.problem.edges, problem.edge_values):
        src = problem.nodes[edge.src].strategies[solution.choices[edge.src]].result_specs[number]
        dst = problem.nodes[edge.dst].strategies[solution.choices[edge.dst]].operand_specs[k]
        if src is None or dst is None or src == dst:
            continue
        collectives = resharding_collectives(info.shape, info.dtype_bytes, src, dst, mesh)
        if collectives:
            consumer = problem.nodes[edge.dst]
            key = None
            if consumer.kind == "op":
                op = graph.op(consumer.index)
                key = (op.operands[k], dst, op.parent)
            reshards.append(
                {
                    "from": problem.nodes[edge.src].name,
                    "to": consumer.name,
                    "shape": list(info.shape),
                    "from_spec": str(src),
                    "to_spec": str(dst),
                    "collectives": [str(c) for c in collectives],
                    "cost_s": sum(c.cost(mesh) for c in collectives),
                    "reused": key is not None and key in converted,
                }
            )
            converted.add(key)
    status, gap = solution.status, solution.gap
    if problem.merged and status == "OPTIMAL":
        status, gap = "FEASIBLE", None  # the merged ILP's optimum: no bound on the program's
    return {
        "function": graph.name,
        "objective_s": solution.objective,
        "status": status,
        "gap": gap,
        "solve_s": solution.solve_seconds,
        "build_s": build_seconds,
        "ilp_sizes": solution.sizes,
        "ops": ops,
        "reshards": reshards,
    }
