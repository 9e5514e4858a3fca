"""Every `hlopar.*` name in the IR, and the values some of them take (docs/ir.md).

Names only: the readers and writers are in the module of their concept (`split`,
`layers`, `mpmd`, `transfers`).
"""

from __future__ import annotations

# --------------------------------------------------------------------------- layering (`layers`)

LAYER_ATTR = "hlopar.layer"  # top-level op: its layer, i64 (hlopar-cluster-operators)
ROLE_ATTR = "hlopar.role"  # top-level op: "forward" | "backward" | "update" (hlopar-cluster-operators)
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"  # the roles, also the fragments'
ROLES = (FORWARD, BACKWARD, UPDATE)
LAYER_PIECES_ATTR = "hlopar.layer_pieces"  # @main: how its signature maps to the step's (hlopar-unstack-layer-scans)
LAYER_ITERATION_ATTR = "hlopar.layer_iteration"  # op: [loop, iteration] of an unrolled layer loop it came from
LAYER_LOOP_ATTR = "hlopar.layer_loop"  # stablehlo.while: a stage's layer range rerolled (hlopar-reroll-stage-loops)

# --------------------------------------------------------------------------- microbatch split (`split`)

KIND_ATTR = "hlopar.microbatch"  # top-level op of a split @main: the kind of its results, below
BATCH, SUM, STEP = "batch", "sum", "step"  # the kinds: per microbatch, summed over microbatches, once on the sums
MICROBATCHES_ATTR = "hlopar.microbatches"  # split @main: B, the number of microbatches, i64
BATCH_ARGS_ATTR = "hlopar.batch_args"  # split @main: the arguments cut along dim 0, array<i64>
MAIN_ARGS_ATTR = "hlopar.main_args"  # functions form: the @main arguments a function takes first, array<i64>
INDEX_ARG_ATTR = "hlopar.microbatch_index_arg"  # split @main: the argument number of the microbatch index
PER_EXAMPLE_ATTR = "hlopar.per_example_dim"  # op: a result placing its microbatch's rows, along this dim

# --------------------------------------------------------------------------- MPMD programs (`mpmd`)

DEVICES_ATTR = "hlopar.devices"  # module: physical device ids of each topology mesh, {name = array<i64>}
REMAT_ATTR = "hlopar.remat"  # backward fragment: recompute the forward (unit or "stage"; "layers": per layer)
REMAT_STAGE, REMAT_LAYERS = "stage", "layers"  # the forms of `hlopar.remat`

# --------------------------------------------------------------------------- cross-mesh transfers (`transfers`)

CROSS_MESH_TRANSFER = "hlopar.cross_mesh_transfer"  # op: replaces an inter-mesh mpmd.transfer, holds the unit ops
BROADCAST_OP = "hlopar.broadcast"  # unit op: one sender to receivers, in chunks
SEND_RECV_OP = "hlopar.send_recv"  # unit op: point to point
SCATTER_ALLGATHER_OP = "hlopar.scatter_allgather"  # unit op: scatter over the receivers, then all-gather
