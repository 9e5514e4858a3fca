"""`hlopar-cross-mesh-resharding`: every inter-mesh `mpmd.transfer` becomes explicit unit ops.

For each transfer between two different meshes of a function's `topology`, the pass plans
the transfer (`hlopar.analysis.resharding.plan_transfer`: unit tasks, a strategy, sender
choice and order under the host model of the cross-mesh resharding paper, §3) and replaces
the transfer by a `hlopar.cross_mesh_transfer` op holding one op per unit task. Physical
devices come from the module's `hlopar.devices` attribute; without it, meshes get
consecutive device ids in topology order, and the pass writes that attribute. Transfers
within one mesh are left alone (they are reshards, done with collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from jaxlib.mlir import ir

from hlopar.analysis.limits import MAX_SECONDS, check_cluster_dimension, check_number, check_positive
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.mpmd import MeshTensorType, argument_sharding, parse_topology
from hlopar.analysis.resharding import HostModel, MeshLayout, SearchBudget, host_model_for, plan_transfer
from hlopar.analysis.resharding.host_model import GBPS
from hlopar.analysis.sharding import ShardingPerValue, ShardingSpec, TensorSharding
from hlopar.dialect.attributes import DEVICES_ATTR
from hlopar.dialect.mpmd import TOPOLOGY_ATTR, TRANSFER, read_devices, write_devices
from hlopar.dialect.transfers import TransferOps, build_transfer_op
from hlopar.ir.diagnostics import source_location
from hlopar.ir.graph import bit_width
from hlopar.passes.base import ModulePass, PassContext, option, report_option

__all__ = ["CrossMeshReshardingPass"]


@dataclass
class CrossMeshReshardingPass(ModulePass):
    name = "hlopar-cross-mesh-resharding"
    summary = "rewrite inter-mesh mpmd.transfer ops as explicit, load-balanced unit ops (one per unit task)"

    strategy: Literal["broadcast", "send-recv", "alpa-local-allgather"] = option(
        "broadcast", "how a unit task is sent: chunked pipelined broadcast, plain send/recv, or Alpa's local all-gather"
    )
    algorithm: Literal["naive", "load-balance", "dfs", "randomized-greedy", "ensemble"] = option(
        "ensemble", "sender choice and order of unit tasks"
    )
    chunks: int = option(0, "broadcast chunks per unit task; 0 picks them per op from the cluster model")
    cluster: str = option(
        "paper",
        "cluster preset: paper (4 GPUs per host over NVLink, 10 Gbps), 8gpu-100g, or a "
        "cost-model preset as stage construction's `preset`",
    )
    devices_per_host: int | None = option(
        None, "overrides the preset's devices per host", check=check_cluster_dimension
    )
    inter_host_gbps: float | None = option(
        None, "overrides the preset's NIC bandwidth per host and direction, Gbit/s", check=check_positive
    )
    intra_host_gbps: float | None = option(
        None, "overrides the preset's device link bandwidth inside a host, Gbit/s", check=check_positive
    )
    inter_host_latency_us: float | None = option(None, "overrides the preset's cross-host latency, microseconds")
    intra_host_latency_us: float | None = option(None, "overrides the preset's intra-host latency, microseconds")
    search_seconds: float = option(
        0.25,
        "time budget of the depth-first search, per transfer",
        check=lambda s: check_number(s, high=MAX_SECONDS, what="a time budget (a week)"),
    )
    seed: int = option(0, "seed of the randomized greedy search")
    report: str | None = report_option("write a JSON report of every planned transfer to this path")

    def host_model(self) -> HostModel:
        model = host_model_for(self.cluster)
        overrides: dict[str, Any] = {}
        if self.devices_per_host is not None:
            overrides["devices_per_host"] = self.devices_per_host
        if self.inter_host_gbps is not None:
            overrides["inter_host_bandwidth"] = self.inter_host_gbps * GBPS
        if self.intra_host_gbps is not None:
            overrides["intra_host_bandwidth"] = self.intra_host_gbps * GBPS
        if self.inter_host_latency_us is not None:
            overrides["inter_host_latency"] = self.inter_host_latency_us * 1e-6
        if self.intra_host_latency_us is not None:
            overrides["intra_host_latency"] = self.intra_host_latency_us * 1e-6
        return replace(model, **overrides)

    def run(self, module: ir.Operation, context: PassContext) -> None:
        try:
            model = self.host_model()
        except ValueError as error:
            self.fail(module, f"invalid cluster: {error}")
        budget = SearchBudget(dfs_seconds=self.search_seconds, seed=self.seed)
        work, topology_meshes = self._collect(module)
        physical, given = self._physical_devices(module, topology_meshes)
        reports = []
        with module.context:
            module.context.allow_unregistered_dialects = True
            for func, transfer, meshes in work:
                planned = self._rewrite(transfer, meshes, physical, model, budget)
                if planned is not None:
                    reports.append({"func": ir.StringAttr(func.attributes["sym_name"]).value, **planned})
            if reports and not given:
                write_devices(module, physical)
        if self.wants_report(context):
            self._write_report(module, context, reports, model)

    # --- reading the module --------------------------------------------------------------

    def _collect(self, module: ir.Operation):
        """(func, transfer, the func's topology) for every `mpmd.transfer` in program order,
        and every mesh of every function's topology, by name."""
        work: list[tuple[ir.Operation, ir.Operation, dict[str, DeviceMesh]]] = []
        all_meshes: dict[str, DeviceMesh] = {}
        for func in module.regions[0].blocks[0].operations:
            func = func.operation
            if func.name != "func.func":
                continue
            meshes: dict[str, DeviceMesh] = {}
            if TOPOLOGY_ATTR in func.attributes:
                try:
                    meshes = parse_topology(str(func.attributes[TOPOLOGY_ATTR]))
                except ValueError as error:
                    self.fail(func, str(error))
            for name, mesh in meshes.items():
                if all_meshes.setdefault(name, mesh) != mesh:
                    self.fail(func, f"mesh '{name}' is {mesh} here but {all_meshes[name]} in another topology")
            transfers: list[ir.Operation] = []

            def visit(op: ir.Operation) -> ir.WalkResult:
                if op.name == TRANSFER:
                    transfers.append(op.operation)  # noqa: B023 (walked within this iteration)
                return ir.WalkResult.ADVANCE

            func.walk(visit)
            if transfers and TOPOLOGY_ATTR not in func.attributes:
                self.fail(transfers[0], "mpmd.transfer in a function without a 'topology' attribute")
            work += [(func, transfer, meshes) for transfer in transfers]
        return work, all_meshes

    def _physical_devices(
        self, module: ir.Operation, meshes: dict[str, DeviceMesh]
    ) -> tuple[dict[str, tuple[int, ...]], bool]:
        """Physical device ids per mesh, and whether the module said them (`hlopar.devices`)."""
        try:
            given = read_devices(module)
        except ValueError as error:
            self.fail(module, str(error))
        if given is None:
            physical, next_id = {}, 0
            for name, mesh in meshes.items():
                physical[name] = tuple(range(next_id, next_id + mesh.size))
                next_id += mesh.size
            return physical, False
        physical = {}
        for name, ids in given.items():
            if name not in meshes:
                known = ", ".join(f"'{n}'" for n in meshes) or "none"
                self.fail(module, f"'{DEVICES_ATTR}' names mesh '{name}', which is in no topology (meshes: {known})")
            if len(ids) != meshes[name].size:
                self.fail(
                    module,
                    f"'{DEVICES_ATTR}' gives {len(ids)} devices to mesh '{name}' of {meshes[name].size} devices",
                )
            if len(set(ids)) != len(ids) or min(ids, default=0) < 0:
                self.fail(module, f"'{DEVICES_ATTR}' entry '{name}' needs distinct non-negative ids, got {list(ids)}")
            physical[name] = ids
        return physical, True

    # --- one transfer -------------------------------------------------------------------

    def _rewrite(self, transfer, meshes, physical, model, budget) -> dict[str, Any] | None:
        src_type = MeshTensorType.parse(str(transfer.operands[0].type))
        dst_type = MeshTensorType.parse(str(transfer.results[0].type))
        if src_type.mesh_name == dst_type.mesh_name:
            return None
        for side in (src_type, dst_type):
            if side.mesh_name not in physical:
                self.fail(transfer, f"mesh '{side.mesh_name}' has no physical devices in '{DEVICES_ATTR}'")
        shared = sorted(set(physical[src_type.mesh_name]) & set(physical[dst_type.mesh_name]))
        if shared:
            self.fail(
                transfer,
                f"meshes '{src_type.mesh_name}' and '{dst_type.mesh_name}' share physical devices "
                f"{shared}; a cross-mesh transfer needs disjoint meshes",
            )
        tensor = ir.RankedTensorType(ir.Type.parse(src_type.tensor_type))
        width = bit_width(tensor.element_type)
        if width is None:
            self.fail(transfer, f"cannot size elements of {src_type.tensor_type}")
        shape = tuple(tensor.shape)
        src_sharding = (
            src_type.sharding or argument_sharding(transfer.operands[0]) or ShardingSpec.replicated(len(shape))
        )
        dst_sharding = dst_type.sharding or _op_sharding(transfer) or ShardingSpec.replicated(len(shape))
        try:
            src = MeshLayout(meshes[src_type.mesh_name], src_sharding, physical[src_type.mesh_name])
            dst = MeshLayout(meshes[dst_type.mesh_name], dst_sharding, physical[dst_type.mesh_name])
            plan = plan_transfer(
                shape,
                (width + 7) // 8,
                src,
                dst,
                model,
                strategy=self.strategy,
                algorithm=self.algorithm,
                chunks=self.chunks,
                budget=budget,
            )
        except ValueError as error:
            self.fail(transfer, str(error))
        where = source_location(transfer.location)
        build_transfer_op(
            TransferOps(
                tuple(p.op for p in plan.ops), plan.strategy, plan.algorithm, plan.predicted_time, plan.lower_bound
            ),
            transfer,
        )
        return {
            "location": str(where) if where else None,
            "src_mesh": src_type.mesh_name,
            "dst_mesh": dst_type.mesh_name,
            "src_sharding": str(src_sharding),
            "dst_sharding": str(dst_sharding),
            **plan.report(),
        }

    def _write_report(
        self, module: ir.Operation, context: PassContext, transfers: list[dict[str, Any]], model: HostModel
    ) -> None:
        report = {
            "pass": self.name,
            "options": self.pipeline_text(),
            "cluster": {
                "devices_per_host": model.devices_per_host,
                "inter_host_bandwidth_bytes_per_s": model.inter_host_bandwidth,
                "intra_host_bandwidth_bytes_per_s": model.intra_host_bandwidth,
                "inter_host_latency_s": model.inter_host_latency,
                "intra_host_latency_s": model.intra_host_latency,
            },
            "transfers": transfers,
        }
        self.emit_report(module, context, report, indent=2)


def _op_sharding(op: ir.Operation) -> TensorSharding | None:
    """The result sharding an `sdy.sharding` attribute on the transfer asks for."""
    if "sdy.sharding" not in op.attributes:
        return None
    return ShardingPerValue.parse(str(op.attributes["sdy.sharding"]))[0]
