"""Cross-mesh resharding (the cross-mesh resharding paper, MLSys'23, §3; Alpa §6).

`plan_transfer` turns one transfer of a tensor between two disjoint meshes into unit tasks,
one unit op per task (broadcast, send/recv or Alpa's local all-gather), a sender and a slot
for each, with the completion time the host model predicts and a lower bound.
"""

from hlopar.analysis.resharding.host_model import PRESETS, HostModel, host_model_for, paper_cluster, place_meshes
from hlopar.analysis.resharding.plan import PlannedOp, TransferPlan, plan_transfer
from hlopar.analysis.resharding.scheduling import ALGORITHMS, SearchBudget
from hlopar.analysis.resharding.simulator import lower_bound, op_cost, simulate
from hlopar.analysis.resharding.strategies import STRATEGIES
from hlopar.analysis.resharding.unit_tasks import MeshLayout, UnitTask, unit_tasks

__all__ = [
    "ALGORITHMS",
    "PRESETS",
    "host_model_for",
    "STRATEGIES",
    "HostModel",
    "MeshLayout",
    "PlannedOp",
    "SearchBudget",
    "TransferPlan",
    "UnitTask",
    "lower_bound",
    "op_cost",
    "paper_cluster",
    "place_meshes",
    "plan_transfer",
    "simulate",
    "unit_tasks",
]
