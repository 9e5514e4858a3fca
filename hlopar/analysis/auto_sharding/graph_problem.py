"""From a function's graph view to the ILP of Eq. 1: nodes, their strategies, edges.

Nodes are the function's arguments, its top-level ops and its constrained results. Each
node gets its strategies (`strategies.enumerate_strategies` over the op's sdy rule), and each
operand an edge from the node producing it, whose matrix is the resharding cost from every
producer strategy's layout to every consumer strategy's required layout.

Every op keeps its own strategies: the ILP is the program's, and its optimum the program's
optimum. `merge=True` instead gives cheap ops (elementwise, transpose, reshape, reductions,
...) only the strategies that mirror their deepest operand's producer (Alpa §4.2), a smaller
ILP whose optimum can be worse: an op then takes its operand's layout whatever its other
operands and its consumers want. Adam's `mu * b1 + g * (1 - b1)` follows the gradient
`g` (the deeper operand); where `g` comes out replicated, the optimizer state `mu`,
sharded ZeRO-style, is all-gathered to meet it, while the op's own sharded strategy slices
`g` for free and needs nothing of `mu`, and costs a fraction of the compute. No local test
makes such a fold exact in general: the same op with two consumers that want another layout
pays two conversions merged and one unmerged, and the compute of an elementwise op shrinks
with its split. What keeps the optimum and still shrinks the problem is in
`merging.reduce_problem` (dominated strategies, chains folded by dynamic programming,
reduced-cost fixing), which does on the whole problem what merging did by guess.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hlopar.analysis.auto_sharding.cluster import LogicalMesh
from hlopar.analysis.auto_sharding.pending_sums import pending_sums_of
from hlopar.analysis.auto_sharding.problem import Edge, Node, Problem
from hlopar.analysis.auto_sharding.resharding import per_device_bytes, resharding_cost
from hlopar.analysis.auto_sharding.rules import PASS_THROUGH_OPS, OpRule
from hlopar.analysis.auto_sharding.strategies import (
    Strategy,
    TensorInfo,
    enumerate_strategies,
    is_expressible,
    pending_operand_variants,
    pending_result_variant,
    replicated_strategy,
    strategy_for,
)
from hlopar.analysis.loops import trip_count
from hlopar.analysis.sharding import ShardingSpec
from hlopar.ir.graph import FuncGraph, OpNode

# Ops with real work or data movement of their own: they choose; the rest follow.
HEAVY_OPS = frozenset(
    {
        "stablehlo.dot_general",
        "stablehlo.dot",
        "stablehlo.convolution",
        "stablehlo.gather",
        "stablehlo.scatter",
        "stablehlo.dynamic_slice",
        "stablehlo.dynamic_update_slice",
        "stablehlo.custom_call",
        "stablehlo.sort",
        "stablehlo.reduce_window",
        "stablehlo.select_and_scatter",
        "stablehlo.fft",
        "stablehlo.if",
    }
)
# Ops that make a value from nothing: any layout is free (each device builds its own tile).
SOURCE_OPS = frozenset({"stablehlo.constant", "stablehlo.iota", "stablehlo.rng_bit_generator"})
CONSTRAINT_OP = "sdy.sharding_constraint"
WHILE_OP = "stablehlo.while"
CASE_OP = "stablehlo.case"
UNANNOTATED_OPS = frozenset({"stablehlo.custom_call"})
# Seconds charged per byte a device holds: far below any communication or compute cost, it
# only breaks ties toward the plan that uses less memory (e.g. an input that could be sent
# whole to every device and sliced there for free is sent already split).
MEMORY_TIE_BREAK = 1e-15


@dataclass
class PlanNode:
    kind: str  # "arg", "op" or "result"
    index: int  # argument number, top-level op index, or result number
    name: str
    strategies: tuple[Strategy, ...]
    leader: int | None = None
    fixed: int | None = None
    planned: bool = True  # False for ops run replicated only because no rule says how to split them
    scale: float = 1.0  # how many times it runs per step (the trip count of enclosing loops)


@dataclass
class ShardingProblem:
    nodes: list[PlanNode]
    problem: Problem
    op_node: dict[int, int] = field(default_factory=dict)  # op id (graph-wide) -> node
    loops: dict[int, tuple[int, ...]] = field(default_factory=dict)  # while/case op id -> its result nodes
    # Partial sums: a value that may pend and has several readers gets a node of its own, the
    # layout all its readers read (converted once, where it is made): node -> (op id, result number).
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)
    producer: dict[int, tuple[int, int]] = field(default_factory=dict)  # value id -> (node, result number)
    arg_node: dict[int, int] = field(default_factory=dict)
    # Per ILP edge: the value it carries, the producer's result number, the consumer's operand.
    edge_values: list[tuple[TensorInfo, int, int]] = field(default_factory=list)
    warnings: list[tuple[OpNode, str]] = field(default_factory=list)
    # Op nodes given only the strategies that mirror a leader (`merge=True`): with any, the
    # ILP is a restriction of the program's, and its optimum only an upper bound.
    merged: int = 0


def build_problem(
    graph: FuncGraph,
    rules: Mapping[int, OpRule | None],
    mesh: LogicalMesh,
    *,
    arg_shardings: Mapping[int, ShardingSpec] = {},
    result_shardings: Mapping[int, ShardingSpec] = {},
    constraint_specs: Mapping[int, ShardingSpec] = {},
    op_result_shardings: Mapping[int, tuple[ShardingSpec, ...]] = {},
    memory_budget: float | None = None,
    merge: bool = False,
    split_dims: Mapping[int, tuple[int, tuple[str, ...]]] = {},
    tied_results: Mapping[int, int] = {},
    split_args: frozenset[int] = frozenset(),
    preferred_split_args: frozenset[int] = frozenset(),
    replicated_args: frozenset[int] = frozenset(),
    partial_sums: bool = False,
    cache: StrategyCache | None = None,
) -> ShardingProblem:
    """The ILP for one function. `rules` maps top-level op indices to their sdy rules;
    `constraint_specs` the layout each `sdy.sharding_constraint` op (by index) imposes;
    `op_result_shardings` the result layouts the input fixed on other ops;
    `split_dims` maps a value to a dimension and the mesh axes that must split it (the
    batch's flow, `batch_flow.batch_dims`): nodes that choose keep only such strategies
    (all of them, if none is); `merge`: cheap ops mirror their deepest operand (the
    module docstring: faster, not exact); `tied_results` maps
    a result to the argument it replaces in a training loop (new parameters for old): the
    two then get the same layout, so the next step needs no resharding; `split_args` are
    arguments that must be split over the mesh where their shape allows (weight-update
    sharding); `preferred_split_args` pay, for each byte a layout holds per device beyond
    their smallest layout, the time to send that byte once over the mesh's fastest axis: the
    ILP splits them where that costs less than one extra transfer of the bytes it saves (a
    priced `prefer-reduce-scatter`, where a gradient's reduce-scatter and the weight's
    all-gather cost what the all-reduce did); `replicated_args` are arguments every device holds whole (data
    parallelism's parameters); `partial_sums`: a matrix product (or sum) that splits its
    reduction may leave its sums pending, linear ops and loop-carried values carry them, and a
    reader that needs the value whole reduces it (`ShardingSpec.unreduced`,
    `resharding._pending_sums`): a gradient accumulated over a loop's iterations is reduced
    once, after the loop; results leave reduced; `cache` shares strategy work with other
    builds on the same mesh."""

    if cache is not None and cache.mesh != mesh:
        raise ValueError("a StrategyCache serves builds on its own mesh only")
    builder = _Builder(
        graph,
        rules,
        mesh,
        cache or StrategyCache(mesh),
        constraint_specs=constraint_specs,
        op_result_shardings=op_result_shardings,
        merge=merge,
        split_dims=split_dims,
        partial_sums=partial_sums,
    )
    builder.add_arguments(arg_shardings, split_args, preferred_split_args, replicated_args)
    for op in graph.ops:
        builder.visit(op, 1.0)
    builder.add_results(result_shardings, tied_results)
    return builder.finish(memory_budget)


class _Builder:
    """`build_problem`'s state as it walks the function: the nodes so far, which node (and
    result) makes each value, each node's depth, and the reads that become edges."""

    def __init__(
        self,
        graph: FuncGraph,
        rules: Mapping[int, OpRule | None],
        mesh: LogicalMesh,
        memo: StrategyCache,
        *,
        constraint_specs: Mapping[int, ShardingSpec],
        op_result_shardings: Mapping[int, tuple[ShardingSpec, ...]],
        merge: bool,
        split_dims: Mapping[int, tuple[int, tuple[str, ...]]],
        partial_sums: bool = False,
    ):
        self.graph, self.rules, self.mesh, self.memo = graph, rules, mesh, memo
        self.constraint_specs, self.op_result_shardings = constraint_specs, op_result_shardings
        self.merge, self.split_dims, self.partial_sums = merge, split_dims, partial_sums
        self.may_pend: set[tuple[int, int]] = set()  # (node, result number) with a pending-sum layout
        self.nodes: list[PlanNode] = []
        self.producer: dict[int, tuple[int, int]] = {}  # value id -> (node, result number)
        self.depth: list[int] = []
        self.warnings: list[tuple[OpNode, str]] = []
        self.consumers: list[tuple[int, tuple[int, ...], float]] = []  # (node, operand value ids, cost scale)
        self.out = ShardingProblem(self.nodes, Problem((), ()), warnings=self.warnings, producer=self.producer)
        self.infos: dict[int, TensorInfo] = {}  # the edges read again what the ops' strategies read
        self.sources: list[tuple[int, tuple[int, int], int, float]] = []  # shared node, its maker, value, scale

    def filtered(self, strategies: tuple[Strategy, ...], value_ids) -> tuple[Strategy, ...]:
        """The strategies that split each of `value_ids` (the node's results) as `split_dims`
        requires."""
        if not self.split_dims:
            return strategies
        required = tuple(self.split_dims.get(v) for v in value_ids)
        if not any(required):
            return strategies
        return self.memo.filtered(required, strategies)

    def info_of(self, value_id: int) -> TensorInfo:
        info = self.infos.get(value_id)
        if info is None:
            info = self.infos[value_id] = tensor_info(self.graph, value_id)
        return info

    def add(self, node: PlanNode, node_depth: int) -> int:
        self.nodes.append(node)
        self.depth.append(node_depth)
        return len(self.nodes) - 1

    def add_arguments(
        self,
        arg_shardings: Mapping[int, ShardingSpec],
        split_args: frozenset[int],
        preferred_split_args: frozenset[int],
        replicated_args: frozenset[int],
    ) -> None:
        """One node per argument: any layout, the fixed one where the input gives it."""
        out, memo = self.out, self.memo
        for position, value_id in enumerate(self.graph.args):
            info = tensor_info(self.graph, value_id)
            strategies = self.filtered(memo.free_layouts(info), [value_id])
            if position in split_args:
                strategies = tuple(s for s in strategies if not s.result_specs[0].is_replicated) or strategies
            elif position in replicated_args:
                strategies = tuple(s for s in strategies if s.result_specs[0].is_replicated) or strategies
            elif position in preferred_split_args and strategies:
                byte_s = 1.0 / max(axis.bandwidth_bytes_per_s for axis in self.mesh.axes)
                least = min(s.memory for s in strategies)
                strategies = tuple(
                    dataclasses.replace(s, communication_cost=s.communication_cost + (s.memory - least) * byte_s)
                    for s in strategies
                )
            strategies, fixed = _index_of_layout(strategies, arg_shardings.get(position), info, self.mesh)
            out.arg_node[position] = self.add(PlanNode("arg", position, f"arg{position}", strategies, fixed=fixed), 0)
            self.producer[value_id] = (out.arg_node[position], 0)

    def visit(self, op: OpNode, scale: float) -> None:
        """The node of one op (`scale`: how many times it runs per step), or of each value a
        loop or case carries and its inner ops."""
        producer, memo = self.producer, self.memo
        if op.name == WHILE_OP and _rules_cover_loop(op):
            self.visit_loop(op, scale)
            return
        if op.name == CASE_OP and op.regions and all(len(branch) == 1 for branch in op.regions):
            self.visit_case(op, scale)
            return
        if op.name in PASS_THROUGH_OPS and all(v in producer for v in op.operands):
            # Result k is operand k: no choice of its own, no cost; readers of a result read
            # the operand's layout (a checkpointed model plans as its unchecked twin).
            for operand, result in zip(op.operands, op.results, strict=True):
                producer[result] = producer[operand]
            return
        operands = [self.info_of(v) for v in op.operands]
        results = [self.info_of(v) for v in op.results]
        operand_nodes = [producer.get(v) for v in op.operands]
        node_depth = 1 + max((self.depth[p[0]] for p in operand_nodes if p is not None), default=0)
        rule = self.rules.get(op.id)
        strategies, leader = self._strategies(op, rule, operands, results, operand_nodes)
        # Custom calls are opaque to XLA: some reject a sharding outright. Their neighbours
        # carry the plan; XLA places the call itself.
        planned = op.name not in UNANNOTATED_OPS and (
            rule is not None or op.name in SOURCE_OPS or op.name == CONSTRAINT_OP or not op.operands
        )
        if leader is not None and self.nodes[leader].scale != scale:
            leader = None  # a node inside a loop cannot share a choice with one outside: costs differ
            strategies = self.filtered(
                memo.enumerate(rule, operands, results, _flops(op.name, rule, results)), op.results
            )
        index = self.add(
            PlanNode("op", op.id, op.name, strategies, leader=leader, planned=planned, scale=scale), node_depth
        )
        self.out.op_node[op.id] = index
        self.out.merged += leader is not None
        if self.partial_sums:
            self._note_pending(index)
        self.consumers.append((index, op.operands, scale))
        for number, value_id in enumerate(op.results):
            producer[value_id] = (index, number)
            if (index, number) in self.may_pend and len(self.graph.direct_users_of(value_id)) > 1:
                self._share(op, number, value_id, scale, node_depth)

    def _share(self, op: OpNode, number: int, value_id: int, scale: float, node_depth: int) -> None:
        """A node for the layout every reader of a value that may pend reads: the ILP prices an
        edge per reader, so a sum all of them want reduced would be priced once per reader,
        though the plan reduces it once (one conversion per value and layout); converted once
        here, where it is made, it is priced once."""
        source = self.producer[value_id]
        layouts = self.memo.read_layouts(self.nodes[source[0]].strategies, number, self.info_of(value_id))
        index = self.add(
            PlanNode("shared", op.id, f"{op.name}#{number} (read)", layouts, planned=False, scale=scale), node_depth
        )
        self.out.shared[index] = (op.id, number)
        self.sources.append((index, source, value_id, scale))
        self.producer[value_id] = (index, 0)
        self._note_pending(index)

    def _strategies(
        self, op: OpNode, rule: OpRule | None, operands, results, operand_nodes
    ) -> tuple[tuple[Strategy, ...], int | None]:
        """An op's strategies, and the node it follows (Alpa §4.2's merging) or None."""
        memo, mesh = self.memo, self.mesh
        leader = None
        if op.name == CONSTRAINT_OP and op.id in self.constraint_specs:
            spec = self.constraint_specs[op.id]
            strategies = (_pinned(spec, operands, results, mesh),)
        elif op.name in SOURCE_OPS or (not op.operands and all(r.is_tensor for r in results)):
            strategies = (
                memo.free_layouts(results[0]) if len(results) == 1 else (replicated_strategy(operands, results, mesh),)
            )
        elif rule is None:
            strategies = (replicated_strategy(operands, results, mesh, _flops(op.name, rule, results)),)
            self.warnings.append((op, f"no sharding rule for '{op.name}': it runs replicated"))
        elif op.id in self.op_result_shardings:
            wanted = self.op_result_shardings[op.id]
            choices = memo.enumerate(rule, operands, results, _flops(op.name, rule, results))
            strategies = tuple(c for c in choices if c.result_specs == wanted) or (
                _pinned_results(wanted, operands, results, mesh),
            )
        else:
            flops = _flops(op.name, rule, results)
            leader_operand = (
                _leader_operand(op, operand_nodes, self.depth, operands, results)
                if self.merge and op.name not in HEAVY_OPS
                else None
            )
            if leader_operand is not None:
                leader, result_number = operand_nodes[leader_operand]
                strategies = memo.mirror(
                    rule, leader_operand, self.nodes[leader].strategies, result_number, operands, results, flops
                )
            else:
                strategies = memo.enumerate(rule, operands, results, flops)
                if self.partial_sums:
                    contraction, linear = pending_sums_of(op)
                    # Only operands that may arrive pending: pending sums started here would
                    # be reduced again by a reader, never cheaper than reducing nothing.
                    linear = tuple(g for g in linear if any(operand_nodes[k] in self.may_pend for k in g))
                    if contraction or linear:
                        strategies = memo.with_pending_sums(strategies, contraction, linear)
                strategies = self.filtered(strategies, op.results)
        return strategies, leader

    def visit_loop(self, op: OpNode, scale: float) -> None:
        """A `while`: each carried value is one node, whose layout holds at entry, in every
        iteration and at exit; body ops are nodes whose costs count once per iteration."""
        producer = self.producer
        (cond,), (body,) = op.regions
        trips = trip_count(self.graph, op)
        entry_depth = 1 + max((self.depth[producer[v][0]] for v in op.operands if v in producer), default=0)
        carried = []
        for i, (operand, result) in enumerate(zip(op.operands, op.results)):
            info = tensor_info(self.graph, result)
            layouts = self.memo.carried(info)
            if self.partial_sums:  # an accumulator: the sums of every iteration pending until the loop ends
                layouts = self.memo.with_pending_sums(layouts, False, ((0,),))
            index = self.add(
                PlanNode("loop", op.id, f"{op.name}#{i}", layouts, planned=False, scale=scale), entry_depth
            )
            if self.partial_sums:
                self._note_pending(index)
            carried.append(index)
            self.consumers.append((index, (operand,), scale))
            producer[result] = producer[cond.args[i]] = producer[body.args[i]] = (index, 0)
        self.out.loops[op.id] = tuple(carried)
        inner = scale * trips
        for block in (cond, body):
            for inner_op in block.ops:
                if inner_op.name == "stablehlo.return":
                    if block is body:  # the next iteration's values: resharded every iteration
                        for j, value in enumerate(inner_op.operands):
                            self.consumers.append((carried[j], (value,), inner))
                    continue
                self.visit(inner_op, inner)

    def _note_pending(self, index: int) -> None:
        """Remembers which results of node `index` have a pending-sum layout among its strategies."""
        for strategy in self.nodes[index].strategies:
            for number, spec in enumerate(strategy.result_specs):
                if spec is not None and spec.unreduced:
                    self.may_pend.add((index, number))

    def visit_case(self, op: OpNode, scale: float) -> None:
        """A `case`: each result is one node that every branch's yield feeds; one branch runs,
        so each branch's costs count 1/branches (the expected cost, branches equally likely)."""
        producer = self.producer
        entry_depth = 1 + max((self.depth[producer[v][0]] for v in op.operands if v in producer), default=0)
        merged = []
        for i, result in enumerate(op.results):
            info = tensor_info(self.graph, result)
            index = self.add(
                PlanNode("case", op.id, f"{op.name}#{i}", self.memo.carried(info), planned=False, scale=scale),
                entry_depth,
            )
            merged.append(index)
            producer[result] = (index, 0)
        weight = scale / len(op.regions)
        for (branch,) in op.regions:
            for inner_op in branch.ops:
                if inner_op.name == "stablehlo.return":
                    for j, value in enumerate(inner_op.operands):
                        self.consumers.append((merged[j], (value,), weight))
                    continue
                self.visit(inner_op, weight)
        self.out.loops[op.id] = tuple(merged)

    def add_results(self, result_shardings: Mapping[int, ShardingSpec], tied_results: Mapping[int, int]) -> None:
        """A node per result the input fixes a layout for, or tied to the argument it replaces."""
        graph, nodes, mesh = self.graph, self.nodes, self.mesh
        for number, value_id in enumerate(graph.results):
            spec = result_shardings.get(number)
            if value_id not in self.producer:
                continue
            info = tensor_info(graph, value_id)
            if spec is not None:
                self.add(PlanNode("result", number, f"result{number}", (_pinned(spec, [info], [], mesh),)), 0)
            elif number in tied_results and info.is_tensor:
                arg = self.out.arg_node[tied_results[number]]
                layouts = tuple(_pinned(s.result_specs[0], [info], [], mesh) for s in nodes[arg].strategies)
                self.add(PlanNode("result", number, f"result{number}", layouts, leader=arg), 0)
            elif self.partial_sums and info.is_tensor:
                # A result leaves reduced: in a layout its producer can make, its sums done.
                node, k = self.producer[value_id]
                specs = [s.result_specs[k] for s in nodes[node].strategies]
                if any(spec is not None and spec.unreduced for spec in specs):
                    reduced = dict.fromkeys(spec.reduced() for spec in specs if spec is not None)
                    layouts = tuple(_pinned(spec, [info], [], mesh) for spec in reduced)
                    self.add(PlanNode("result", number, f"result{number}", layouts), 0)

    def finish(self, memory_budget: float | None) -> ShardingProblem:
        """The edges, the live sets (with a budget) and the ILP of the nodes built."""
        graph, nodes, out, memo = self.graph, self.nodes, self.out, self.memo
        result_nodes = {node.index: i for i, node in enumerate(nodes) if node.kind == "result"}
        self.consumers += [(result_nodes[n], (graph.results[n],), 1.0) for n in result_nodes]
        edges = _edges(self.info_of, nodes, self.producer, self.consumers, out, memo)
        for index, (source, number), value_id, scale in self.sources:  # a shared read from its maker
            _add_edge(edges, out, memo, nodes, self.info_of(value_id), (source, number), (index, 0), scale)
        live_sets = _live_sets(graph, self.producer, out) if memory_budget is not None else ()
        out.problem = Problem(
            nodes=tuple(
                Node(
                    costs=memo.node_costs(node.strategies, node.scale),
                    memory=memo.node_memory(node.strategies),
                    fixed=node.fixed,
                    follows=node.leader,
                    name=node.name,
                )
                for node in nodes
            ),
            edges=tuple(edges),
            memory_budget=memory_budget,
            live_sets=live_sets,
        )
        return out


def _rules_cover_loop(op: OpNode) -> bool:
    """A loop is planned inside when every value it carries is a tensor or a token."""
    return len(op.regions) == 2 and all(len(region) == 1 for region in op.regions)


def tensor_info(graph: FuncGraph, value_id: int) -> TensorInfo:
    value = graph.values[value_id]
    shape = value.shape
    if shape is None or not value.nbytes or any(d is None for d in shape):
        return TensorInfo(tuple(shape) if shape is not None and all(d is not None for d in shape) else None, 0)
    elements = math.prod(shape)
    return TensorInfo(tuple(shape), max(1, value.nbytes // elements) if elements else 0)


def _flops(name: str, rule: OpRule | None, results) -> float:
    if rule is not None and name in ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"):
        return 2.0 * math.prod(rule.factor_sizes)
    return float(sum(math.prod(r.shape) for r in results if r.is_tensor))


class StrategyCache:
    """Work shared between identical ops: a GPT's layers repeat, and so do their ops'
    strategy lists and edge matrices. Keys use the identity of strategy tuples, which are
    never mutated; the cache keeps every tuple it keyed on alive, so one cache can serve
    several builds on the same mesh (the layers of a pipeline planned one by one)."""

    def __init__(self, mesh: LogicalMesh):
        self.mesh = mesh
        self.cache: dict = {}
        self._keyed_on: list = []
        self._ops: dict = {}  # (rule, operands, results, flops) -> a number that keys its strategies

    def once(self, key, make, keep=None):
        """`make()`, once per key (one lookup: keys hash their rules and tensor infos in
        Python); `keep`: what a key made of identities must keep alive."""
        found = self.cache.get(key, self)
        if found is self:
            if keep is not None:
                self._keyed_on.append(keep)
            found = self.cache[key] = make()
        return found

    def enumerate(self, rule, operands, results, flops) -> tuple[Strategy, ...]:
        key = ("enumerate", rule, tuple(operands), tuple(results), flops)
        return self.once(key, lambda: tuple(enumerate_strategies(rule, operands, results, self.mesh, flops=flops)))

    def free_layouts(self, info: TensorInfo) -> tuple[Strategy, ...]:
        """Every layout of a value that costs nothing to produce (an argument, a constant)."""
        if not info.is_tensor:
            return (replicated_strategy([], [info], self.mesh),)
        return self.enumerate(OpRule.elementwise(info.shape, 0, 1), (), (info,), 0.0)

    def carried(self, info: TensorInfo) -> tuple[Strategy, ...]:
        """Layouts of a loop-carried value: the same going in and coming out."""
        if not info.is_tensor:
            return (replicated_strategy([info], [info], self.mesh),)
        return self.enumerate(OpRule.elementwise(info.shape, 1, 1), (info,), (info,), 0.0)

    def mirror(self, rule, k, leader_strategies, result_number, operands, results, flops) -> tuple[Strategy, ...]:
        op = (rule, tuple(operands), tuple(results), flops)
        key = ("mirror", op, k, id(leader_strategies), result_number)
        return self.once(key, lambda: self._mirror(op, k, leader_strategies, result_number), keep=leader_strategies)

    def _mirror(self, op, k, leader_strategies, result_number) -> tuple[Strategy, ...]:
        """`_mirror` with its strategies and factor axes cached per op: the op's key is
        hashed once here, not once per leader strategy."""
        rule, operands, results, flops = op
        number = self._ops.setdefault(op, len(self._ops))

        def make(rule, factor_axes, operands, results, mesh, flops) -> Strategy:
            return self.once(
                ("strategy", number, factor_axes),
                lambda: strategy_for(rule, factor_axes, operands, results, mesh, flops),
            )

        def factor_axes_for(rule, k, spec, mesh):
            return self.once(("factor axes", number, k, spec), lambda: _factor_axes_for(rule, k, spec, mesh))

        return tuple(
            _mirror(
                rule, k, leader_strategies, result_number, operands, results, self.mesh, flops, make, factor_axes_for
            )
        )

    def with_pending_sums(self, strategies: tuple[Strategy, ...], contraction: bool, linear) -> tuple[Strategy, ...]:
        """`strategies` and their partial-sum variants (`partial_sums`): `contraction`, each
        split reduction's sums left pending; `linear`, the operand groups the op is linear in
        (`strategies.pending_operand_variants`)."""

        def make() -> tuple[Strategy, ...]:
            found = list(strategies)
            for strategy in strategies:
                if contraction:
                    pending = pending_result_variant(strategy, self.mesh)
                    if pending is not None:
                        found.append(pending)
                found += pending_operand_variants(strategy, linear, self.mesh)
            return tuple(found) if len(found) > len(strategies) else strategies

        return self.once(("pending sums", id(strategies), contraction, linear), make, keep=strategies)

    def read_layouts(self, strategies: tuple[Strategy, ...], number: int, info: TensorInfo) -> tuple[Strategy, ...]:
        """The layouts a value's readers may read it in (`_Builder._share`): each its maker's
        strategies give it, and every layout of its shape, pending over any axes or not."""

        def make() -> tuple[Strategy, ...]:
            every = self.with_pending_sums(self.carried(info), False, ((0,),))
            specs = [s.result_specs[number] for s in strategies] + [s.result_specs[0] for s in every]
            return tuple(_pinned(spec, [info], [info], self.mesh) for spec in dict.fromkeys(specs) if spec is not None)

        return self.once(("read layouts", id(strategies), number, info), make, keep=strategies)

    def node_costs(self, strategies: tuple[Strategy, ...], scale: float) -> tuple[float, ...]:
        """An ILP node's costs: each strategy's, run `scale` times, plus the memory tie-break."""
        return self.once(
            ("costs", id(strategies), scale),
            lambda: tuple(scale * s.cost + MEMORY_TIE_BREAK * s.memory for s in strategies),
            keep=strategies,
        )

    def node_memory(self, strategies: tuple[Strategy, ...]) -> tuple[float, ...]:
        return self.once(("memory", id(strategies)), lambda: tuple(s.memory for s in strategies), keep=strategies)

    def filtered(self, required, strategies) -> tuple[Strategy, ...]:
        """`strategies` whose result k splits dim d over `axes` where `required[k]` is
        (d, axes); all of them if none does."""

        def keeps(strategy: Strategy) -> bool:
            return all(
                need is None or (spec is not None and set(need[1]) <= set(spec.dims[need[0]]))
                for need, spec in zip(required, strategy.result_specs)
            )

        key = ("filter", required, id(strategies))
        return self.once(key, lambda: tuple(filter(keeps, strategies)) or strategies, keep=strategies)

    def matrix(self, info: TensorInfo, sources, number: int, targets, k: int) -> np.ndarray:
        return self.once(
            ("matrix", info, id(sources), number, id(targets), k),
            lambda: self._layout_matrix(
                info, self._layouts(sources, "result_specs", number), self._layouts(targets, "operand_specs", k)
            ),
            keep=(sources, targets),
        )

    def _layouts(self, strategies, side: str, number: int) -> tuple:
        """Layout `number` of each strategy's results or operands (`side`), one tuple object per
        distinct list of layouts, so that matrices can be keyed on its identity."""

        def interned() -> tuple:
            layouts = tuple(getattr(s, side)[number] for s in strategies)
            return self.once(("layout list", layouts), lambda: layouts)

        return self.once(("layouts of", id(strategies), side, number), interned, keep=strategies)

    def _layout_matrix(self, info: TensorInfo, sources: tuple, targets: tuple):
        """`_cost_matrix` per distinct (value, layouts) pair: different ops' strategy lists
        often offer one list of layouts, and edges sharing a matrix object convert it once
        (`merging._matrices`). The layout lists are interned (`_layouts`)."""
        return self.once(
            ("layouts", info, id(sources), id(targets)), lambda: _cost_matrix(info, sources, targets, self.mesh)
        )


def _pinned(spec: ShardingSpec, operands, results, mesh: LogicalMesh) -> Strategy:
    """A single strategy that keeps one layout (a user constraint)."""

    def specs(infos) -> tuple[ShardingSpec | None, ...]:
        return tuple(spec if info.is_tensor else None for info in infos)

    memory = sum(per_device_bytes(r.shape, r.dtype_bytes, spec, mesh) for r in results if r.is_tensor)
    return Strategy((), specs(operands), specs(results), (), 0.0, 0.0, float(memory))


def _pinned_results(specs, operands, results, mesh: LogicalMesh) -> Strategy:
    """Results in the layouts the user gave, from whole operands (no strategy of the op gives them)."""
    base = replicated_strategy(operands, results, mesh)
    memory = sum(per_device_bytes(r.shape, r.dtype_bytes, s, mesh) for r, s in zip(results, specs) if r.is_tensor)
    return Strategy((), base.operand_specs, tuple(specs), (), 0.0, base.compute_cost, float(memory))


def _index_of_layout(strategies, spec: ShardingSpec | None, info: TensorInfo, mesh):
    """(strategies, index of the one with this layout), adding it if it is missing."""
    if spec is None:
        return strategies, None
    for i, strategy in enumerate(strategies):
        if strategy.result_specs[0] == spec:
            return strategies, i
    return (*strategies, _pinned(spec, [], [info], mesh)), len(strategies)


def _leader_operand(op: OpNode, operand_nodes, depth, operands, results) -> int | None:
    """The deepest operand (Alpa §4.2) among those as large as the result: following a
    smaller one (the scalar of a broadcast, a bias) would pin the op to that operand's few
    layouts. None when no operand qualifies: the op then chooses its own strategy."""
    size = max((math.prod(r.shape) for r in results if r.is_tensor), default=0)
    best = None
    for k, p in enumerate(operand_nodes):
        if p is None or not operands[k].is_tensor or math.prod(operands[k].shape) < size:
            continue
        if best is None or depth[p[0]] > depth[operand_nodes[best][0]]:
            best = k
    return best


def _mirror(
    rule,
    k,
    leader_strategies,
    result_number,
    operands,
    results,
    mesh,
    flops,
    make=strategy_for,
    factor_axes_for=None,
) -> list[Strategy]:
    """One strategy per leader strategy: the one that takes operand `k` in the layout the
    leader produces it (or, where no strategy can, the replicated one), made by `make`
    (`strategy_for`'s arguments); `factor_axes_for`: `_factor_axes_for` or a cache of it."""
    factor_axes_for = factor_axes_for or _factor_axes_for
    fallback = None
    mirrored = []
    for leader_strategy in leader_strategies:
        spec = leader_strategy.result_specs[result_number]
        factor_axes = factor_axes_for(rule, k, spec, mesh) if spec is not None else None
        if factor_axes is None:
            fallback = fallback or make(rule, tuple(() for _ in rule.factor_sizes), operands, results, mesh, flops)
            mirrored.append(fallback)
        else:
            mirrored.append(make(rule, factor_axes, operands, results, mesh, flops))
    return mirrored


def _factor_axes_for(rule: OpRule, k: int, spec: ShardingSpec, mesh: LogicalMesh):
    factor_axes: list[tuple[str, ...]] = [() for _ in rule.factor_sizes]
    blocked = rule.need_replication | rule.permutation
    present = rule.result_factors() | rule.reduction
    for dim, axes in zip(rule.operands[k], spec.dims):
        if not axes:
            continue
        if not dim:
            return None
        factor = dim[0]
        if factor in blocked or factor not in present or rule.factor_sizes[factor] % mesh.axes_size(axes):
            return None
        factor_axes[factor] = tuple(axes)
    if not all(is_expressible(t, factor_axes, rule.factor_sizes, mesh) for t in (*rule.operands, *rule.results)):
        return None
    return tuple(factor_axes)


def _edges(info_of, nodes, producer, consumers, out, memo: StrategyCache) -> list[Edge]:
    edges = []
    for consumer, operands, scale in consumers:
        for k, value_id in enumerate(operands):
            if value_id not in producer:
                continue
            info = info_of(value_id)
            if not info.is_tensor or producer[value_id][0] == consumer:
                continue
            _add_edge(edges, out, memo, nodes, info, producer[value_id], (consumer, k), scale)
    return edges


def _add_edge(edges, out, memo: StrategyCache, nodes, info, source, target, scale: float) -> None:
    """The edge carrying a value from result `number` of node `source` to operand `k` of node
    `consumer` (`source` = (node, number), `target` = (node, k)), run `scale` times; none where
    every conversion is free."""
    (source, number), (consumer, k) = source, target
    matrix = memo.matrix(info, nodes[source].strategies, number, nodes[consumer].strategies, k)
    if matrix is not None:
        if scale != 1.0:
            matrix = tuple(tuple(scale * c for c in row) for row in matrix)
        edges.append(Edge(source, consumer, matrix))
        out.edge_values.append((info, number, k))


def _cost_matrix(info: TensorInfo, sources, targets, mesh) -> tuple[tuple[float, ...], ...] | None:
    """Resharding costs, computed once per distinct (source, target) layout pair; None if all zero."""
    source_ids, unique_sources = _intern(sources)
    target_ids, unique_targets = _intern(targets)
    unique = np.array(
        [
            [
                0.0
                if src is None or dst is None or src == dst
                else resharding_cost(info.shape, info.dtype_bytes, src, dst, mesh)
                for dst in unique_targets
            ]
            for src in unique_sources
        ],
        dtype=float,
    ).reshape(len(unique_sources), len(unique_targets))
    matrix = unique[np.ix_(source_ids, target_ids)]
    return tuple(map(tuple, matrix.tolist())) if matrix.any() else None


def _intern(specs) -> tuple[list[int], list]:
    ids: dict = {}
    return [ids.setdefault(spec, len(ids)) for spec in specs], list(ids)


def _live_sets(graph, producer, out) -> tuple[tuple[int, ...], ...]:
    """The nodes whose outputs are alive just before each op that frees something: memory
    peaks there (it only grows between frees), so these sets bound every program point.
    Program points are positions in `graph.ops` (a subgraph's ops keep their own indices)."""
    last_use: dict[int, int] = {}
    for position, op in enumerate(graph.ops):
        for value_id in op.operands:
            if value_id in producer:
                last_use[producer[value_id][0]] = position
    end = len(graph.ops)
    for value_id in graph.results:
        if value_id in producer:
            last_use[producer[value_id][0]] = end
    dying: dict[int, list[int]] = {}
    for node, position in last_use.items():
        dying.setdefault(position, []).append(node)
    live = set(out.arg_node.values())
    sets = []
    for position, op in enumerate(graph.ops):
        made = {producer[v][0] for v in op.results if v in producer}
        live |= made
        for node in made - set(last_use):  # never used: freed right after it is made
            dying.setdefault(position, []).append(node)
        if position in dying:
            sets.append(tuple(sorted(live)))
            live.difference_update(dying[position])
    sets.append(tuple(sorted(live)))
    return tuple(sets)
