"""The table of hlopar's passes, by pipeline name."""

from __future__ import annotations

from hlopar.passes.auto_parallel import AutoParallelPass
from hlopar.passes.auto_sharding import AutoShardingPass
from hlopar.passes.base import ModulePass
from hlopar.passes.cluster_operators import ClusterOperatorsPass
from hlopar.passes.cross_mesh_resharding import CrossMeshReshardingPass
from hlopar.passes.import_program import ImportPass
from hlopar.passes.rematerialize import RematerializePass
from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass
from hlopar.passes.split_microbatches import SplitMicrobatchesPass
from hlopar.passes.stage_construction import StageConstructionPass
from hlopar.passes.unstack_layer_scans import UnstackLayerScansPass

HLOPAR_PASSES: dict[str, type[ModulePass]] = {
    cls.name: cls
    for cls in (
        ImportPass,
        AutoShardingPass,
        ClusterOperatorsPass,
        StageConstructionPass,
        CrossMeshReshardingPass,
        AutoParallelPass,
        SplitMicrobatchesPass,
        UnstackLayerScansPass,
        RematerializePass,
        RerollStageLoopsPass,
    )
}


def passes_help() -> str:
    """The pass list `hlopar-opt --help` prints."""
    lines = ["hlopar passes (in --pass-pipeline as name{option=value ...}):"]
    for name in sorted(HLOPAR_PASSES):
        lines += HLOPAR_PASSES[name].help_lines()
    lines += [
        "",
        "Any pass registered in jaxlib's MLIR can appear in the same pipeline, e.g. canonicalize,",
        "cse, inline, symbol-dce, func.func(chlo-legalize-to-stablehlo), and the sdy-* passes.",
    ]
    return "\n".join(lines)
