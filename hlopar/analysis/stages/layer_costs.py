"""t_intra per layer: the intra-op ILP of each layer on each logical mesh, solved once per shape.

Alpa's Algorithm 1 asks the intra-op pass for the latency of every span of layers on every
(submesh, logical mesh) pair. Solving one ILP per span is quadratic in the number of layers;
here each *layer* (its forward, backward and update ops) is planned alone on each logical
mesh, and a span's cost is composed from its layers' plans plus the resharding between their
boundary layouts (`span_costs`). Layers with the same structure (a GPT's blocks) share one
solve: the key is a structural signature of the layer's ops, operands numbered locally.

Per (layer, mesh) the plan gives what the stage DP and the memory check need: the ILP's
objective (communication plus compute, Alpa §4.2 with compute costs from FLOPs), the part of
it that does not shrink with the microbatch (collective start-up latency), and per-device
bytes of the state the layer reads, of its gradients, of the forward values its backward
reads (the activations a pipeline schedule stashes per microbatch in flight), of the new
state its update makes (none for state the user donates: the update fragment writes it into
the old state's buffers, `codegen.pipeline_program`), and of the temporaries its forward and its backward hold at once
(`fragment_memory`'s model, each value at the plan's layout), and the share of the latency
that its forward ops make (what a rematerialized stage runs a second time).

A layer whose forward the user already checkpoints (`jax.checkpoint`: the backward holds an
`optimization_barrier` and a second copy of the forward ops) is charged as it is: the copies
are backward ops (they are no ancestors of the loss, `training_roles`), so their time is in
the backward's share and their values are no activations; only the checkpoint's residuals
are stashed.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hlopar.analysis.auto_sharding import ilp
from hlopar.analysis.auto_sharding.cluster import LogicalMesh
from hlopar.analysis.auto_sharding.graph_problem import HEAVY_OPS, StrategyCache, TensorInfo, build_problem, tensor_info
from hlopar.analysis.auto_sharding.problem import Edge, Problem
from hlopar.analysis.auto_sharding.resharding import per_device_bytes
from hlopar.analysis.auto_sharding.rules import OpRule
from hlopar.analysis.fragment_memory import TUPLE_POINTER_BYTES, Temporaries
from hlopar.analysis.loops import trip_count
from hlopar.analysis.sharding import ShardingSpec
from hlopar.analysis.stages.ilp_pool import IlpPool
from hlopar.ir.graph import FuncGraph

__all__ = ["LayerPlan", "boundary_values", "kernel_counts", "layer_signature", "plan_layer", "value_bytes"]

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
ROLES = (FORWARD, BACKWARD, UPDATE)
MATMUL_OPS = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})
# Ops that root a kernel of their own once XLA has fused the elementwise ops around them.
KERNEL_OPS = HEAVY_OPS | {"stablehlo.reduce"}


@dataclass(frozen=True)
class LayerPlan:
    """One layer planned on one logical mesh (times in seconds per step, bytes per device)."""

    latency: float  # the ILP's objective: compute plus intra-mesh communication
    fixed_latency: float  # the part paid per microbatch whatever its size: collective start-ups
    state_bytes: float  # function arguments the layer reads (parameters, optimizer state, batch)
    gradient_bytes: float  # backward values its update ops read (summed over microbatches)
    activation_bytes: float  # forward values its backward reads: stashed per microbatch in flight
    updated_state_bytes: (
        float  # the new buffers its update ops hand back (new state not written into donated old state)
    )
    temporary_bytes: float  # the most its forward or its backward holds at once besides operands and results
    forward_latency: float  # the forward ops' share of `latency` (their nodes, the edges into them)
    forward_fixed_latency: float  # the forward ops' share of `fixed_latency`
    arg_layouts: tuple[ShardingSpec | None, ...]  # per `subgraph.args`, the layout the plan wants
    result_layouts: tuple[ShardingSpec | None, ...]  # per `subgraph.results`, the layout made
    status: str  # the ILP's status (FEASIBLE where merging made it a restriction of the layer's)
    solve_seconds: float


def layer_signature(
    graph: FuncGraph, rules: Mapping[int, OpRule | None], roles: Sequence[str], donated: frozenset[int] = frozenset()
) -> tuple:
    """What a layer's plan depends on, independent of where it sits in the program: per op
    (nested ones included) its name, role, operands numbered locally, result types, decoded
    attributes and sharding rule; per argument its type; which results are donated."""
    local: dict[int, int] = {}
    for v in graph.args:
        local[v] = len(local)
    items: list = [tuple(graph.values[v].type for v in graph.args)]
    for top in graph.ops:
        role = roles[top.index]
        for op in top.walk():
            for block in (b for region in op.regions for b in region):
                for v in block.args:
                    local.setdefault(v, len(local))
            operands = tuple(local.get(v, -1) for v in op.operands)
            for v in op.results:
                local[v] = len(local)
            items.append(
                (
                    op.name,
                    role,
                    operands,
                    tuple(graph.values[v].type for v in op.results),
                    repr(op.attrs),
                    repr(rules.get(op.id)),
                )
            )
    items.append(tuple(local[v] for v in graph.results))
    items.append(tuple(local[v] for v in graph.results if v in donated))
    return tuple(items)


def plan_layer(
    layer: FuncGraph,
    rules: Mapping[int, OpRule | None],
    roles: Sequence[str],
    mesh: LogicalMesh,
    *,
    time_limit: float = 10.0,
    cache: StrategyCache | None = None,
    split_state: bool = False,
    new_state: Mapping[int, int] | None = None,
    donated: frozenset[int] = frozenset(),
) -> LayerPlan:
    """The ILP plan of one layer (a `FuncGraph.subgraph`) on one logical mesh. `roles` is
    indexed by top-level op index of the whole function; `cache` shares strategy work between
    the layers planned on one mesh. With `split_state`, the function arguments the layer reads
    (parameters, optimizer state) are split over the mesh wherever their shape allows: the
    weight-update-sharding plan (ZeRO-like), slower but lighter, which Algorithm 1 weighs
    against the default plan as one more intra-op option (its line 14). `new_state`: function
    result → the argument it is the new value of (`step_io.state_pairs`, value ids):
    the new state is held at its argument's layout, which it takes for the next step.
    `donated`: the results of `new_state` whose argument the user donates (`tf.aliasing_output`
    pairs them): an update that reads the argument writes the new value into its buffers."""
    return plan_layer_options(
        layer,
        rules,
        roles,
        mesh,
        (split_state,),
        time_limit=time_limit,
        cache=cache,
        new_state=new_state,
        donated=donated,
    )[0]


def plan_layer_options(
    layer: FuncGraph,
    rules: Mapping[int, OpRule | None],
    roles: Sequence[str],
    mesh: LogicalMesh,
    split_state: Sequence[bool],
    *,
    time_limit: float = 10.0,
    cache: StrategyCache | None = None,
    new_state: Mapping[int, int] | None = None,
    donated: frozenset[int] = frozenset(),
) -> list[LayerPlan]:
    """`plan_layer` for several `split_state` options from one ILP build: the weight-update
    sharding problem is the default one with the replicated layouts of the state arguments
    (and of the nodes that mirror them) taken out. The new state among the layer's results
    takes its argument's layout (`new_state`, as the stage's own plan ties them)."""
    new_state = new_state or {}
    start = time.perf_counter()
    problem, options = _build(layer, rules, mesh, split_state, cache, new_state)
    plans = []
    views = LayerViews(layer, roles)
    for allowed, restricted in options:
        solution = ilp.solve(restricted, time_limit=time_limit, num_workers=1)
        plans.append(_finish(views, mesh, problem, allowed, solution, start, new_state, donated))
        start = time.perf_counter()
    return plans


def _build(layer: FuncGraph, rules, mesh: LogicalMesh, split_state: Sequence[bool], cache, new_state) -> tuple:
    """The layer's ILP on `mesh` and, per `split_state` option, (the strategies it keeps, the
    problem restricted to them)."""
    position = {v: k for k, v in enumerate(layer.args)}
    tied = {k: position[new_state[v]] for k, v in enumerate(layer.results) if new_state.get(v) in position}
    # Merged (Alpa §4.2): a layer's cost is an estimate for the stage DP, and the exact ILP
    # of every layer on every submesh would cost stage construction ~1.6x in solves; each
    # stage's own plan (`intra_op_plan`) is exact. Its status says FEASIBLE, not OPTIMAL.
    problem = build_problem(layer, rules, mesh, cache=cache, tied_results=tied, merge=True)
    options = []
    for split in split_state:
        allowed = _split_state_choices(layer, problem) if split else {}
        options.append((allowed, _restricted(problem.problem, allowed)))
    return problem, options


class LayerViews:
    """What pricing a layer's plans reads of the layer whatever the mesh, found once per
    layer: its forward's and its backward's temporaries model (`fragment_memory.Temporaries`),
    each op's role, each value's `TensorInfo`."""

    def __init__(self, layer: FuncGraph, roles: Sequence[str]):
        self.layer, self.roles = layer, roles
        self.temporaries = tuple(
            Temporaries(layer.subgraph([op.index for op in layer.ops if roles[op.index] == role]))
            for role in (FORWARD, BACKWARD)
        )
        self.role_of = {op.id: roles[top.index] for top in layer.ops for op in top.walk()}
        self._infos: dict[int, TensorInfo] = {}

    def info(self, value_id: int) -> TensorInfo:
        found = self._infos.get(value_id)
        if found is None:
            found = self._infos[value_id] = tensor_info(self.layer, value_id)
        return found


def _finish(views: LayerViews, mesh, problem, allowed, solution, start: float, new_state, donated) -> LayerPlan:
    """The plan of one option from its ILP's solution."""
    if solution.status not in ("OPTIMAL", "FEASIBLE"):
        raise RuntimeError(f"the intra-op ILP of a layer found no plan on mesh {mesh}: {solution.message}")
    choices = tuple(allowed[v][c] if v in allowed else c for v, c in enumerate(solution.choices))
    return _layer_plan(views, mesh, problem, choices, solution, time.perf_counter() - start, new_state, donated)


def _layer_plan(
    views: LayerViews,
    mesh,
    problem,
    choices,
    solution,
    seconds: float,
    new_state: Mapping[int, int],
    donated: frozenset[int],
) -> LayerPlan:
    layer, roles = views.layer, views.roles
    nodes = problem.nodes

    def layout(value_id: int) -> ShardingSpec | None:
        found = problem.producer.get(value_id)
        if found is None:
            return None
        node, number = found
        specs = nodes[node].strategies[choices[node]].result_specs
        return specs[number] if number < len(specs) else None

    sizes: dict[int, float] = {}

    def nbytes(value_id: int) -> float:
        found = sizes.get(value_id)
        if found is None:
            found = sizes[value_id] = value_bytes(views.info(value_id), layout(value_id), mesh)
        return found

    activation, gradient = _stash_bytes(layer, roles, nbytes)
    state = sum(nbytes(v) for v in layer.args if layer.values[v].is_arg)
    temporaries = max(model.peak(nbytes) for model in views.temporaries)
    role_of = views.role_of
    forward = [node.kind in ("op", "loop", "case") and role_of.get(node.index) == FORWARD for node in nodes]
    return LayerPlan(
        latency=solution.objective,
        fixed_latency=_start_up_latency(problem, choices, mesh),
        state_bytes=state,
        gradient_bytes=gradient,
        activation_bytes=activation,
        updated_state_bytes=_updated_state_bytes(layer, roles, nbytes, new_state, donated),
        temporary_bytes=temporaries,
        forward_latency=_objective_share(problem.problem, choices, forward),
        forward_fixed_latency=_start_up_latency(problem, choices, mesh, forward),
        arg_layouts=tuple(layout(v) for v in layer.args),
        result_layouts=tuple(layout(v) for v in layer.results),
        status="FEASIBLE" if problem.merged and solution.status == "OPTIMAL" else solution.status,
        solve_seconds=seconds,
    )


def _stash_bytes(layer: FuncGraph, roles, nbytes) -> tuple[float, float]:
    """The bytes of the activations the layer's backward reads and of the gradients its
    update reads, at the plan's layouts (`nbytes`)."""
    values = layer.values
    inside = {op.index for op in layer.ops}
    activation = gradient = 0.0
    for op in layer.ops:
        role = roles[op.index]
        if role not in (FORWARD, BACKWARD):
            continue
        for v in op.results:
            readers = {roles[u] for u in values[v].users if u in inside}
            if role == FORWARD and BACKWARD in readers:
                activation += nbytes(v)
            elif role == BACKWARD and UPDATE in readers:
                gradient += nbytes(v)
    # Gradients other layers' backward ops make for this layer's update (a weight used twice).
    gradient += sum(
        nbytes(v)
        for v in layer.args
        if not values[v].is_arg
        and roles[values[v].producer] == BACKWARD
        and any(roles[u] == UPDATE for u in values[v].users if u in inside)
    )
    return activation, gradient


def _updated_state_bytes(
    layer: FuncGraph, roles, nbytes, new_state: Mapping[int, int], donated: frozenset[int]
) -> float:
    """The bytes of the new state the layer's update returns: at the layout of the state it
    replaces (the layer's plan does not tie the two; the stage's does), with XLA's table of
    result pointers as `fragment_memory` counts outputs. A donated argument that the update
    reads holds its new value (aliased: the pointer only)."""
    values = layer.values
    inside = {op.index for op in layer.ops}
    results = set(layer.results)
    in_place = {
        v
        for v in donated & results
        if v in new_state and any(roles[u] == UPDATE for u in values[new_state[v]].users if u in inside)
    }
    return sum(
        (0.0 if v in in_place else nbytes(new_state.get(v, v))) + TUPLE_POINTER_BYTES
        for op in layer.ops
        if roles[op.index] == UPDATE
        for v in op.results
        if v in results
    )


def _split_state_choices(layer: FuncGraph, problem) -> dict[int, list[int]]:
    """Per node, the strategies left when the state arguments must be split: an argument node
    loses its replicated layouts (unless it has nothing else), and so does every node that
    mirrors it strategy for strategy (`follows`, transitively)."""
    allowed: dict[int, list[int]] = {}
    for position, node in problem.arg_node.items():
        if not layer.values[layer.args[position]].is_arg:
            continue
        strategies = problem.nodes[node].strategies
        keep = [k for k, s in enumerate(strategies) if s.result_specs[0] is None or not s.result_specs[0].is_replicated]
        if keep and len(keep) < len(strategies):
            allowed[node] = keep
    if not allowed:
        return allowed
    ilp_nodes = problem.problem.nodes
    for v in range(len(ilp_nodes)):
        root = v
        while ilp_nodes[root].follows is not None:
            root = ilp_nodes[root].follows
        if root != v and root in allowed:
            allowed[v] = allowed[root]
    return allowed


def _restricted(problem: Problem, allowed: Mapping[int, Sequence[int]]) -> Problem:
    """The problem with node v limited to strategies `allowed[v]` (renumbered 0..). Edges
    that shared one matrix object share its restriction (`merging._matrices` converts each
    object once)."""
    if not allowed:
        return problem

    def pick(v: int, seq):
        return tuple(seq[k] for k in allowed[v]) if v in allowed and seq else tuple(seq)

    nodes = tuple(
        replace(
            node,
            costs=pick(v, node.costs),
            memory=pick(v, node.memory),
            fixed=None
            if node.fixed is None
            else allowed.get(v, range(len(node.costs))).index(node.fixed)
            if v not in allowed or node.fixed in allowed[v]
            else None,
        )
        for v, node in enumerate(problem.nodes)
    )
    picked: dict = {}

    def matrix(edge: Edge):
        rows, cols = allowed.get(edge.src), allowed.get(edge.dst)
        if rows is None and cols is None:
            return edge.costs
        key = (id(edge.costs), id(rows), id(cols))
        if key not in picked:
            whole = np.asarray(edge.costs, dtype=np.float64)
            kept = whole[
                np.ix_(range(whole.shape[0]) if rows is None else rows, range(whole.shape[1]) if cols is None else cols)
            ]
            picked[key] = tuple(map(tuple, kept.tolist()))
        return picked[key]

    edges = tuple(Edge(e.src, e.dst, matrix(e)) for e in problem.edges)
    return replace(problem, nodes=nodes, edges=edges)


def _start_up_latency(problem, choices: Sequence[int], mesh: LogicalMesh, only: Sequence[bool] | None = None) -> float:
    """Alpha terms of the chosen plan: each collective of a chosen strategy at its axes'
    latency, each resharding edge that costs anything at the mesh's largest latency. With
    `only`, of the nodes it marks and the edges into them."""
    fast = _start_ups_only(mesh)
    start_ups: dict[int, float] = {}  # by strategy: nodes share strategy objects
    total = 0.0
    for v, (node, choice) in enumerate(zip(problem.nodes, choices)):
        if only is None or only[v]:
            strategy = node.strategies[choice]
            found = start_ups.get(id(strategy))
            if found is None:
                found = start_ups[id(strategy)] = sum(c.cost(fast) for c in strategy.collectives)
            total += node.scale * found
    worst = max((a.latency_s for a in mesh.axes if a.size > 1), default=0.0)
    for edge in problem.problem.edges:
        if (only is None or only[edge.dst]) and edge.costs[choices[edge.src]][choices[edge.dst]] > 0:
            total += worst
    return total


@functools.lru_cache(maxsize=256)
def _start_ups_only(mesh: LogicalMesh) -> LogicalMesh:
    """`mesh` with links of unbounded bandwidth: a collective's cost on it is its start-up."""
    return replace(mesh, axes=tuple(replace(a, bandwidth_bytes_per_s=1e30) for a in mesh.axes))


def _objective_share(problem: Problem, choices: Sequence[int], only: Sequence[bool]) -> float:
    """The part of the ILP objective at `choices` that the marked nodes and the edges into
    them make."""
    total = sum(node.costs[c] for node, c, keep in zip(problem.nodes, choices, only) if keep)
    return total + sum(e.costs[choices[e.src]][choices[e.dst]] for e in problem.edges if only[e.dst])


def value_bytes(info: TensorInfo, spec: ShardingSpec | None, mesh: LogicalMesh) -> float:
    """Per-device bytes of a value laid out as `spec` on `mesh` (whole without a layout that
    fits its rank)."""
    if not info.is_tensor or not info.shape:
        return float(info.dtype_bytes)
    if spec is None or len(spec.dims) != len(info.shape):
        return float(math.prod(info.shape) * info.dtype_bytes)
    return float(per_device_bytes(info.shape, info.dtype_bytes, spec, mesh))


def kernel_counts(layer: FuncGraph, roles: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per role, the kernels the layer's ops launch per step and how many are matrix products:
    one per op that roots a fusion (`KERNEL_OPS`; elementwise ops fuse into them), ops inside
    a `while` once per trip. An estimate of what an accelerator launches, for the per-kernel
    overheads of `ClusterPreset.op_seconds`."""
    counts = {role: [0.0, 0.0] for role in ROLES}

    def visit(op, role: str, scale: float) -> None:
        if op.name in KERNEL_OPS:
            counts[role][0] += scale
            counts[role][1] += scale * (op.name in MATMUL_OPS)
        inner = scale * trip_count(layer, op) if op.name == "stablehlo.while" else scale
        for region in op.regions:
            for block in region:
                for child in block.ops:
                    visit(child, role, inner)

    for top in layer.ops:
        if roles[top.index] in counts:
            visit(top, roles[top.index], 1.0)
    return {role: (k, m) for role, (k, m) in counts.items()}


def boundary_values(
    graph: FuncGraph, layer_of_op: Sequence[int], roles: Sequence[str], l: int, layer: FuncGraph
) -> dict[str, int]:
    """Per role, the values layer `l` (of `graph`, its top-level ops' layers `layer_of_op`)
    reads from outside it or makes for outside it with ops of that role: what a fragment of the
    layer alone hands over per run (values passed between layers of one stage are counted
    too: an estimate from above), for `ClusterPreset.value_launch_s`."""
    counts = dict.fromkeys(ROLES, 0)
    for v in layer.args:
        for role in {roles[u] for u in graph.values[v].users if layer_of_op[u] == l}:
            if role in counts:
                counts[role] += 1
    for v in layer.results:
        producer = graph.values[v].producer
        role = roles[producer] if producer is not None else None
        if role in counts:
            counts[role] += 1
    return counts


def trivial_axes_key(mesh: LogicalMesh) -> tuple:
    """Meshes that differ only by axes of size 1 plan identically."""
    return (
        tuple((a.size, a.latency_s, a.bandwidth_bytes_per_s) for a in mesh.axes if a.size > 1),
        mesh.device_flops,
        mesh.device_memory_bandwidth,
    )


def useful_axes(mesh: LogicalMesh, dims: frozenset[int]) -> tuple[str, ...]:
    """The mesh axes that can split some dimension of a layer: an axis whose size divides no
    dimension can split nothing (nor can any group of axes containing it), so the layer's plan
    and costs on the mesh are those on the mesh without it."""
    return tuple(a.name for a in mesh.axes if a.size > 1 and any(d % a.size == 0 for d in dims))


def plan_key(mesh: LogicalMesh, dims: frozenset[int]) -> tuple:
    """Meshes with the same key plan a layer with these dimensions identically (axes renamed)."""
    kept = useful_axes(mesh, dims)
    return (
        tuple((a.size, a.latency_s, a.bandwidth_bytes_per_s) for a in mesh.axes if a.name in kept),
        mesh.device_flops,
        mesh.device_memory_bandwidth,
    )


def layer_dims(layer: FuncGraph) -> frozenset[int]:
    """Every dimension size of every value the layer reads or makes."""
    dims: set[int] = set()
    for op in layer.ops:
        for inner in op.walk():
            for v in (*inner.operands, *inner.results):
                shape = layer.values[v].shape
                if shape:
                    dims.update(d for d in shape if d)
    return frozenset(dims)


def renamed(plan: LayerPlan, names: Mapping[str, str]) -> LayerPlan:
    """The same plan with mesh axes renamed (for another mesh of the same `plan_key`)."""

    def spec(layout: ShardingSpec | None) -> ShardingSpec | None:
        return (
            None
            if layout is None
            else ShardingSpec(tuple(tuple(names.get(a, a) for a in axes) for axes in layout.dims))
        )

    return replace(
        plan, arg_layouts=tuple(map(spec, plan.arg_layouts)), result_layouts=tuple(map(spec, plan.result_layouts))
    )


@dataclass(frozen=True)
class LayerTable:
    """plans[l][g] for every layer l and (logical mesh, option) g, how many ILPs it took and
    whether they were solved in spawned processes (`ilp_pool`)."""

    plans: tuple[tuple[LayerPlan, ...], ...]
    solved: int
    spawned: bool = False


def plan_layers(
    layers: Sequence[FuncGraph],
    rules: Mapping[int, OpRule | None],
    roles: Sequence[str],
    meshes: Sequence[tuple[LogicalMesh, bool]],
    *,
    time_limit: float = 10.0,
    workers: int = 1,
    new_state: Mapping[int, int] | None = None,
    donated: frozenset[int] = frozenset(),
) -> LayerTable:
    """Every layer on every (mesh, split_state) pair, each distinct problem solved once.

    Two pairs are one problem when the layers have one `layer_signature` and the meshes one
    `plan_key` for the layer's dimensions (its plan is renamed onto the other mesh's axes);
    the options of one problem share one ILP build (`plan_layer_options`), and builds share
    strategy work between the layers of one mesh. The builds read the IR, here; the ILPs are
    plain data, solved once per content (`ilp_pool`), here or, where that pays and
    `workers > 1`, in spawned processes. `new_state`, `donated`: as `plan_layer`'s."""
    # Each distinct signature by a number: the signatures are long tuples, hashed once here.
    numbered: dict[tuple, int] = {}
    signatures = [numbered.setdefault(layer_signature(layer, rules, roles, donated), len(numbered)) for layer in layers]
    dims = {sig: None for sig in signatures}
    for k, layer in enumerate(layers):
        if dims[signatures[k]] is None:
            dims[signatures[k]] = layer_dims(layer)
    distinct: list[LogicalMesh] = []
    mesh_id = [distinct.index(m) if m in distinct else distinct.append(m) or len(distinct) - 1 for m, _ in meshes]
    keys = {  # (signature, mesh number) -> its problem's key
        (sig, g): (sig, plan_key(mesh, dims[sig])) for sig in dims for g, (mesh, _) in enumerate(meshes)
    }
    first: dict = {}  # (signature, plan_key) -> (layer, mesh id) whose build solves it
    splits: dict = {}  # the same key -> the split_state options asked for
    for k in range(len(layers)):
        for g, (_, split) in enumerate(meshes):
            key = keys[(signatures[k], g)]
            first.setdefault(key, (k, mesh_id[g]))
            splits.setdefault(key, set()).add(split)
    groups: dict[int, list] = {}
    for key, (k, m) in first.items():
        groups.setdefault(m, []).append((k, tuple(sorted(splits[key]))))
    new_state = dict(new_state or {})
    solved = {}
    pending: list = []  # (layer, mesh id, split, problem, allowed, solution getter, start)

    views: dict[int, LayerViews] = {}  # by layer: each is planned on many meshes

    def finish(done: list) -> None:
        for k, m, split, problem, allowed, solution, start in done:
            if k not in views:
                views[k] = LayerViews(layers[k], roles)
            plan = _finish(views[k], distinct[m], problem, allowed, solution(), start, new_state, donated)
            solved[(k, m, split)] = plan

    with IlpPool(time_limit, workers, expected=sum(len(options) for _, options in splits.items())) as pool:
        for m, items in sorted(groups.items()):
            cache = StrategyCache(distinct[m])
            for k, options in items:
                start = time.perf_counter()
                problem, built = _build(layers[k], rules, distinct[m], options, cache, new_state)
                for split, (allowed, restricted) in zip(options, built):
                    pending.append((k, m, split, problem, allowed, pool.submit(restricted), start))
                # Solved here already: plan it now and let the build go. In workers: keep
                # a few builds waiting, no more (each holds its problem).
                keep = 2 * workers if pool.spawned else 0
                if len(pending) > keep:
                    finish(pending[: len(pending) - keep])
                    del pending[: len(pending) - keep]
        finish(pending)
        count, spawned = pool.solved, pool.spawned
    rows: dict[int, tuple[LayerPlan, ...]] = {}  # layers of one signature share their row
    for sig in dims:
        row = []
        for g, (mesh, split) in enumerate(meshes):
            source_k, source_m = first[keys[(sig, g)]]
            plan = solved[(source_k, source_m, split)]
            if source_m != mesh_id[g]:
                names = dict(zip(useful_axes(distinct[source_m], dims[sig]), useful_axes(mesh, dims[sig])))
                plan = renamed(plan, names)
            row.append(plan)
        rows[sig] = tuple(row)
    return LayerTable(tuple(rows[sig] for sig in signatures), count, spawned)
