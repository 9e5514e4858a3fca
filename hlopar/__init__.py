"""hlopar: automatic parallelization of JAX programs on StableHLO.

`hlopar.parallelize(fn, cluster=hlopar.Cluster.local(...))` runs a JAX training step
pipelined and sharded over a cluster (`hlopar.api`); `fn` may be an exported StableHLO
module instead, a `.mlir` / `.mlirbc` path (`hlopar.ModuleStep`). Imported on first use, so that
`import hlopar` stays light.
"""

__all__ = [
    "CheckpointError",
    "Cluster",
    "HloparWarning",
    "ModuleStep",
    "PlanningError",
    "WorkerError",
    "calibrate",
    "parallelize",
]


def __getattr__(name: str):
    if name == "parallelize":
        from hlopar.api import parallelize

        return parallelize
    if name == "ModuleStep":
        from hlopar.module_step import ModuleStep

        return ModuleStep
    if name == "calibrate":
        from hlopar.runtime.calibrate import calibrate

        return calibrate
    if name == "Cluster":
        from hlopar.analysis.cluster import Cluster

        return Cluster
    if name in ("HloparWarning", "PlanningError"):
        from hlopar import messages

        return getattr(messages, name)
    if name == "WorkerError":
        from hlopar.runtime.ray_runtime import WorkerError

        return WorkerError
    if name == "CheckpointError":
        from hlopar.runtime.checkpoint import CheckpointError

        return CheckpointError
    raise AttributeError(f"module 'hlopar' has no attribute {name!r}")
