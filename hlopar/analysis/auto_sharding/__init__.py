"""Intra-op auto-sharding (Alpa §4) as pure functions over plain data.

- `cluster`: a logical device mesh with per-axis latency and bandwidth, device speed and memory.
- `collectives`: alpha-beta costs of all-reduce, all-gather, reduce-scatter, all-to-all.
- `resharding`: the collectives (and cost) that turn one sharding spec into another.
- `rules`: each op's factor structure, decoded from Shardy's `sdy.op_sharding_rule`.
- `strategies`: the parallel algorithms of an op: mesh axes assigned to its factors.
- `graph_problem`: from a function's graph view to the ILP's nodes, strategies and edges.
- `ilp`: Eq. 1 in CP-SAT, with the memory constraint; `merging` holds its exact
  simplifications (followers folded into leaders, dominated strategies, small nodes eliminated),
  `dual` the LP lower bound that proves most plans optimal before CP-SAT is needed.

A module's plan from end to end (its functions to the ILP, the choice written back as `sdy`
shardings) is IR rewriting: `hlopar.passes.intra_op_plan`, shared by two passes.
"""
