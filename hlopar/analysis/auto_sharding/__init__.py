"""Intra-op auto-sharding (Alpa §4) as pure functions over plain data.

- `cluster`: a logical device mesh with per-axis latency and bandwidth, device speed and memory.
- `collectives`: alpha-beta costs of all-reduce, all-gather, reduce-scatter, all-to-all.
- `resharding`: the collectives (and cost) that turn one sharding spec into another.
- `rules`: each op's factor structure, decoded from Shardy's `sdy.op_sharding_rule`.
- `strategies`: the parallel algorithms of an op: mesh axes assigned to its factors.
- `ilp`: Eq. 1 in CP-SAT, with merging of cheap nodes and the memory constraint.

`hlopar.passes.auto_sharding` adapts a module to these and writes the chosen plan back.
"""
