"""Time the auto-sharding ILP on a synthetic GPT-like training step.

    python tools/bench_ilp.py [--layers N] [--mesh 2x4] [--workers W] [--time-limit S] [--seed K]
                              [--budget-fraction F [--live-window W]] [--no-bound]

The problem is built like the pass builds one: every op is an einsum whose strategies assign each
mesh axis to one of its loops (or none), costs are alpha-beta collective times (all-reduce for a
sharded reduction loop, all-gather / all-to-all / nothing between a producer's layout and the
layout a consumer wants) plus compute time divided over the axes that split the work, and
memory is the output's bytes per device. A layer is a transformer block (attention and MLP),
its backward pass, and the weight updates; the elementwise op after the first MLP matmul
follows it, as Alpa's merging would make it. `--layers 72` gives about 3,000 nodes and
5,700 edges with 9 to 25 strategies each. Prints sizes before and after simplification, and
the build and solve times.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import sys
import time
from dataclasses import dataclass

from hlopar.analysis.auto_sharding.ilp import solve
from hlopar.analysis.auto_sharding.merging import Simplify
from hlopar.analysis.auto_sharding.problem import Edge, Node, Problem

BYTES = 2  # fp16
FLOPS = 1e14  # per device
SIZES = {"b": 8, "s": 1024, "t": 1024, "h": 2048, "n": 2048, "f": 8192}


@dataclass
class _Op:
    loops: str
    out: str
    strategies: list[tuple[str | None, ...]]  # per mesh axis, the loop it splits


class GptLikeBuilder:
    """Accumulates einsum nodes and the resharding edges between them."""

    def __init__(self, mesh: tuple[int, ...], seed: int):
        self.mesh = mesh
        self.rng = random.Random(seed)
        self.bandwidth = [25e9 if a == 0 and len(mesh) > 1 else 150e9 for a in range(len(mesh))]
        self.latency = [5e-6 if a == 0 and len(mesh) > 1 else 1e-6 for a in range(len(mesh))]
        self.ops: list[_Op] = []
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self._matrices: dict[tuple, tuple[tuple[float, ...], ...]] = {}

    def _spec(self, dims: str, assign: tuple[str | None, ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(a for a, loop in enumerate(assign) if loop == d) for d in dims)

    def _shards(self, spec: tuple[tuple[int, ...], ...]) -> int:
        count = 1
        for axes in spec:
            for a in axes:
                count *= self.mesh[a]
        return count

    def _bytes(self, dims: str) -> float:
        total = BYTES
        for d in dims:
            total *= SIZES[d]
        return total

    def _reshard(self, src, dst, full_bytes: float) -> float:
        """Per mesh axis: all-gather where dst wants it replicated, all-to-all where it moves."""
        shard = full_bytes / self._shards(src)
        where_src = {a: d for d, axes in enumerate(src) for a in axes}
        where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
        cost = 0.0
        for a, n in enumerate(self.mesh):
            s, d = where_src.get(a), where_dst.get(a)
            if s is None or s == d:
                continue
            beta = shard * (n - 1) / self.bandwidth[a]
            cost += self.latency[a] + (beta if d is None else beta / n)
        return cost

    def op(self, spec: str, operands: list[int], follows: int | None = None, name: str = "") -> int:
        """An einsum `spec` ("bsh,hn->bsn") over the outputs of `operands`; returns its node."""
        ins, out = spec.split("->")
        in_dims = ins.split(",") if ins else []
        loops = "".join(sorted(set("".join(in_dims) + out)))
        if follows is not None:
            strategies = self.ops[follows].strategies
        else:
            strategies = list(itertools.product([None, *loops], repeat=len(self.mesh)))
        reduce_loops = set(loops) - set(out)
        work = 2.0 if reduce_loops else 1.0
        for d in loops:
            work *= SIZES[d]
        efficiency = self.rng.uniform(0.9, 1.1)
        costs, memory = [], []
        for assign in strategies:
            split = 1
            for a, loop in enumerate(assign):
                if loop is not None:
                    split *= self.mesh[a]
            out_spec = self._spec(out, assign)
            out_shard = self._bytes(out) / self._shards(out_spec)
            cost = work / split / FLOPS * efficiency
            for a, loop in enumerate(assign):
                if loop in reduce_loops:
                    n = self.mesh[a]
                    cost += self.latency[a] + 2 * (n - 1) / n * out_shard / self.bandwidth[a]
            costs.append(cost)
            memory.append(out_shard)
        node = len(self.nodes)
        self.ops.append(_Op(loops, out, strategies))
        self.nodes.append(Node(tuple(costs), tuple(memory), follows=follows, name=name or spec))
        for src, dims in zip(operands, in_dims):
            producer = self.ops[src]
            key = (producer.out, tuple(producer.strategies), dims, tuple(strategies))
            if key not in self._matrices:
                self._matrices[key] = tuple(
                    tuple(
                        self._reshard(self._spec(producer.out, sp), self._spec(dims, sc), self._bytes(dims))
                        for sc in strategies
                    )
                    for sp in producer.strategies
                )
            self.edges.append(Edge(src, node, self._matrices[key]))
        return node

    def layer(self, x: int) -> tuple[int, dict[str, int]]:
        """Forward of one transformer block; returns its output and the values backward needs."""
        w = {
            k: self.op(f"->{d}", [], name=k)
            for k, d in [("wq", "hn"), ("wk", "hn"), ("wv", "hn"), ("wo", "nh"), ("w1", "hf"), ("w2", "fh")]
        }
        q, k, v = (self.op("bsh,hn->bsn", [x, w[n]]) for n in ("wq", "wk", "wv"))
        s = self.op("bsn,btn->bst", [q, k])
        a = self.op("bst,btn->bsn", [s, v])
        o = self.op("bsn,nh->bsh", [a, w["wo"]])
        r = self.op("bsh,bsh->bsh", [x, o])
        m1 = self.op("bsh,hf->bsf", [r, w["w1"]])
        g = self.op("bsf->bsf", [m1], follows=m1, name="gelu")
        m2 = self.op("bsf,fh->bsh", [g, w["w2"]])
        y = self.op("bsh,bsh->bsh", [r, m2])
        return y, dict(w, x=x, q=q, k=k, v=v, s=s, a=a, r=r, m1=m1, g=g)

    def backward(self, dy: int, saved: dict[str, int]) -> int:
        """Gradients of one block and the weight updates; returns the input's gradient."""
        t = saved
        dg = self.op("bsh,fh->bsf", [dy, t["w2"]])
        dw2 = self.op("bsf,bsh->fh", [t["g"], dy])
        dm1 = self.op("bsf,bsf->bsf", [dg, t["m1"]])
        dr = self.op("bsf,hf->bsh", [dm1, t["w1"]])
        dw1 = self.op("bsh,bsf->hf", [t["r"], dm1])
        dr2 = self.op("bsh,bsh->bsh", [dy, dr])
        da = self.op("bsh,nh->bsn", [dr2, t["wo"]])
        dwo = self.op("bsn,bsh->nh", [t["a"], dr2])
        ds = self.op("bsn,btn->bst", [da, t["v"]])
        dv = self.op("bst,bsn->btn", [t["s"], da])
        dq = self.op("bst,btn->bsn", [ds, t["k"]])
        dk = self.op("bst,bsn->btn", [ds, t["q"]])
        grads = {"wo": dwo, "w1": dw1, "w2": dw2}
        dxs = [dr2]
        for name, dz in (("wq", dq), ("wk", dk), ("wv", dv)):
            dxs.append(self.op("bsn,hn->bsh", [dz, t[name]]))
            grads[name] = self.op("bsh,bsn->hn", [t["x"], dz])
        for name, grad in grads.items():
            dims = "nh" if name == "wo" else ("fh" if name == "w2" else ("hf" if name == "w1" else "hn"))
            self.op(f"{dims},{dims}->{dims}", [t[name], grad], name=f"update {name}")
        return self.op("bsh,bsh,bsh,bsh->bsh", dxs)


def gpt_like_problem(
    layers: int, mesh: tuple[int, ...] = (2, 4), seed: int = 0, memory_budget: float | None = None, live_window: int = 0
) -> Problem:
    """A synthetic training step of `layers` transformer blocks (see the module docstring).

    With `live_window > 0`, each node's live set is itself and the `live_window` nodes before
    it (a crude stand-in for liveness), constrained by `memory_budget`.
    """
    builder = GptLikeBuilder(mesh, seed)
    x = builder.op("->bsh", [], name="input")
    saved = []
    for _ in range(layers):
        x, values = builder.layer(x)
        saved.append(values)
    dy = builder.op("bsh->bsh", [x], name="loss grad")
    for values in reversed(saved):
        dy = builder.backward(dy, values)
    n = len(builder.nodes)
    lives = tuple(tuple(range(max(0, v - live_window), v + 1)) for v in range(n)) if live_window else ()
    return Problem(tuple(builder.nodes), tuple(builder.edges), memory_budget, lives)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="CP-SAT workers (default: `ilp.solve`'s rule by model size, as the passes run it)",
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="deterministic seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="print CP-SAT's search log")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=None,
        help="memory budget as a fraction of the unconstrained plan's peak",
    )
    parser.add_argument("--live-window", type=int, default=10, help="nodes per live set (with a budget)")
    parser.add_argument(
        "--no-bound", action="store_true", help="skip reduced-cost fixing: CP-SAT solves the simplified model"
    )
    args = parser.parse_args(argv)

    mesh = tuple(int(d) for d in args.mesh.split("x"))
    start = time.perf_counter()
    problem = gpt_like_problem(args.layers, mesh, args.seed)
    if args.budget_fraction is not None:
        problem = gpt_like_problem(args.layers, mesh, args.seed, live_window=args.live_window)
        free = solve(problem, num_workers=args.workers)
        peak = max(sum(problem.nodes[v].memory[free.choices[v]] for v in live) for live in problem.live_sets)
        problem = dataclasses.replace(problem, memory_budget=args.budget_fraction * peak)
        print(f"budget:      {args.budget_fraction} x {peak:.4g} bytes (unconstrained: {free.objective:.6g} s)")
    generate_s = time.perf_counter() - start
    counts = sorted({len(n.costs) for n in problem.nodes})
    print(
        f"problem:     {len(problem.nodes)} nodes, {len(problem.edges)} edges, strategies {counts} "
        f"(generated in {generate_s:.2f} s)"
    )
    solution = solve(
        problem,
        time_limit=args.time_limit,
        num_workers=args.workers,
        seed=args.seed,
        simplify=Simplify(bound=not args.no_bound),
        log=args.log,
    )
    sizes = solution.sizes
    print(f"eq. 1 ilp:   {sizes['variables_eq1']} variables, {sizes['constraints_eq1']} constraints")
    if "nodes_merged" in sizes:  # absent where the simplification proved the budget infeasible
        _print_model(sizes, solution.timings, solution.solve_seconds)
    print(
        f"result:      {solution.status}, objective {solution.objective:.6g} s, gap {solution.gap:.3g} "
        f"{solution.message}"
    )
    return 0


def _print_model(sizes: dict, t: dict, total_s: float) -> None:
    """The sizes of the model after each simplification and the times of each step."""
    print(f"merged:      {sizes['nodes_merged']} nodes, {sizes['edges_merged']} edges")
    print(
        f"simplified:  {sizes['nodes_simplified']} nodes, {sizes['edges_simplified']} edges "
        f"(exact steps: dominance, elimination of degree <= 2)"
    )
    print(
        f"core:        {sizes['nodes_core']} nodes, {sizes['edges_core']} edges after the bound "
        f"({sizes['sweeps']} sweeps); {sizes['strategies_removed']} strategies removed "
        f"({sizes['fixed_by_bound']} by the bound), {sizes['eliminated']} nodes eliminated"
    )
    print(f"cp-sat:      {sizes['variables']} variables, {sizes['constraints']} constraints")
    print(
        f"times:       simplify {t['simplify']:.2f} s, build {t['build']:.2f} s, "
        f"cp-sat {t['cpsat']:.2f} s, total {total_s:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
