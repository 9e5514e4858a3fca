"""`hlopar-cross-mesh-resharding` on modules: the ops it writes round-trip, decode, and execute correctly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jaxlib.mlir import ir

from hlopar.analysis.device_slices import all_device_slices
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.resharding import MeshLayout
from hlopar.analysis.sharding import TensorSharding
from hlopar.dialect.attributes import CROSS_MESH_TRANSFER
from hlopar.dialect.transfers import read_transfer_op
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.ir.module import parse_module, print_module
from hlopar.passes.base import PassContext
from hlopar.passes.cross_mesh_resharding import CrossMeshReshardingPass
from hlopar.passes.pipeline import Pipeline
from hlopar.runtime.local_transfer import execute_ops, shard_array

SRC_SHARDING = '<@mesh, [{"a"}, {"b"}]>'
DST_SHARDING = '<@mesh, [{}, {"x", "y"}]>'
MODULE = f"""
!src = !mpmd.mesh_tensor<"m1", tensor<6x8xf32>, sharding={SRC_SHARDING}>
!dst = !mpmd.mesh_tensor<"m2", tensor<6x8xf32>, sharding={DST_SHARDING}>
module attributes {{hlopar.devices = {{m1 = array<i64: 0, 1, 2, 3>, m2 = array<i64: 7, 6, 5, 4>}}}} {{
  func.func @main(%arg0: !src) -> !dst attributes {{
      topology = #mpmd.topology<<"m1" : <["a"=2, "b"=2]>>, <"m2" : <["x"=2, "y"=2], device_ids=[3, 1, 2, 0]>>>}} {{
    %0 = mpmd.transfer %arg0 : (!src) -> !dst
    return %0 : !dst
  }}
}}
"""
SRC = MeshLayout(DeviceMesh.of((2, 2), ("a", "b")), TensorSharding.parse(SRC_SHARDING), (0, 1, 2, 3))
DST = MeshLayout(
    DeviceMesh.of((2, 2), ("x", "y"), device_ids=(3, 1, 2, 0)), TensorSharding.parse(DST_SHARDING), (7, 6, 5, 4)
)


def run_pass(text: str, options: str = "devices-per-host=2") -> ir.Operation:
    module = parse_module(text)
    Pipeline.parse(f"builtin.module(hlopar-cross-mesh-resharding{{{options}}})", module.context).run(
        module, PassContext()
    )
    return module


def containers(module: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(op):
        if op.name == CROSS_MESH_TRANSFER:
            found.append(op.operation)
        return ir.WalkResult.ADVANCE

    module.walk(visit)
    return found


@pytest.mark.parametrize("strategy", ["broadcast", "send-recv", "alpa-local-allgather"])
def test_the_ops_in_the_ir_carry_out_the_transfer(strategy):
    """Plan, print, parse back, decode the ops and run them on the local devices."""
    printed = print_module(run_pass(MODULE, f"devices-per-host=2 strategy={strategy} chunks=3"))
    reparsed = parse_module(printed)
    assert print_module(reparsed) == printed
    (container,) = containers(reparsed)
    decoded = read_transfer_op(container, dtype_bytes=4)
    assert decoded.strategy == strategy and decoded.lower_bound <= decoded.predicted_time
    array = np.arange(48, dtype=np.float32).reshape(6, 8)
    result = execute_ops(decoded.ops, (6, 8), SRC, DST, shard_array(array, SRC))
    for logical, index in all_device_slices((6, 8), DST.sharding, DST.mesh).items():
        np.testing.assert_array_equal(np.asarray(result[DST.physical(logical)]), array[index])


def test_report(tmp_path):
    path = tmp_path / "plan.json"
    run_pass(MODULE, f"devices-per-host=2 report={path}")
    report = json.loads(path.read_text())
    assert report["pass"] == "hlopar-cross-mesh-resharding"
    assert report["cluster"]["devices_per_host"] == 2
    (transfer,) = report["transfers"]
    assert (transfer["func"], transfer["src_mesh"], transfer["dst_mesh"]) == ("main", "m1", "m2")
    assert transfer["location"].endswith(":7:10")
    assert transfer["unit_tasks"] == len(transfer["ops"]) == 8  # 2x2 source boxes, 4 destination columns
    assert transfer["lower_bound_s"] <= transfer["predicted_time_s"]


def test_an_unwritable_report_is_an_error(tmp_path):
    with pytest.raises(
        DiagnosticError,
        match="option 'report' of pass 'hlopar-cross-mesh-resharding': invalid value "
        "'.*plan.json': cannot write output: the directory '.*missing' does not exist",
    ):
        run_pass(MODULE, f"devices-per-host=2 report={tmp_path / 'missing' / 'plan.json'}")


def test_cluster_options_change_the_prediction():
    def predicted(options):
        (container,) = containers(run_pass(MODULE, options))
        return ir.FloatAttr(container.attributes["predicted_time"]).value

    slow = predicted("devices-per-host=2 inter-host-latency-us=0 intra-host-latency-us=0")
    fast = predicted("devices-per-host=2 inter-host-latency-us=0 intra-host-latency-us=0 inter-host-gbps=100")
    assert fast == pytest.approx(slow / 10, rel=0.05)

    # A cost-model preset (as stage construction plans with): its NIC is 8 A100s x 200 Gbit/s.
    a100 = predicted("devices-per-host=2 inter-host-latency-us=0 intra-host-latency-us=0 cluster=a100-80g-nvlink")
    assert a100 == pytest.approx(slow / 160, rel=0.05)


def test_bad_cluster_options_are_errors():
    with pytest.raises(
        DiagnosticError,
        match="option 'devices-per-host' of pass 'hlopar-cross-mesh-resharding': "
        "invalid value '0': expected a positive integer, got 0",
    ):
        run_pass(MODULE, "devices-per-host=0")
    with pytest.raises(DiagnosticError, match="unknown cluster preset 'tpu'; known presets: paper, 8gpu-100g, cpu"):
        run_pass(MODULE, "cluster=tpu")


def test_pipeline_text_round_trips():
    text = "hlopar-cross-mesh-resharding{strategy=send-recv algorithm=dfs chunks=4 report=r.json}"
    (step,) = Pipeline.parse(f"builtin.module({text})", parse_module(MODULE).context).steps
    assert step.hlopar_pass == CrossMeshReshardingPass(strategy="send-recv", algorithm="dfs", chunks=4, report="r.json")
    assert step.hlopar_pass.pipeline_text() == text


def malformed(ops: str) -> tuple[ir.Operation, ir.Operation]:
    """A module with one container holding `ops`, and the container (the module keeps it alive)."""
    text = f"""
    func.func @f(%arg0: !mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m2", tensor<4xf32>>
        attributes {{topology = #mpmd.topology<<"m1" : <["x"=1]>>, <"m2" : <["x"=1]>>>}} {{
      %0 = "hlopar.cross_mesh_transfer"(%arg0) ({{
        {ops}
      }}) {{strategy = "broadcast", algorithm = "ensemble", predicted_time = 1.0 : f64, lower_bound = 1.0 : f64}}
        : (!mpmd.mesh_tensor<"m1", tensor<4xf32>>) -> !mpmd.mesh_tensor<"m2", tensor<4xf32>>
      return %0 : !mpmd.mesh_tensor<"m2", tensor<4xf32>>
    }}"""
    module = parse_module(text)
    (container,) = containers(module)
    return module, container


def read(ops: str):
    module, container = malformed(ops)
    return read_transfer_op(container, dtype_bytes=4)


def test_reading_checks_the_ops():
    good = '"hlopar.broadcast"() {sender = 0 : i64, receivers = array<i64: 1>, start = array<i64: 0>, limit = array<i64: 4>, chunks = 2 : i64, slot = 0 : i64} : () -> ()'
    (op,) = read(good).ops
    assert (op.kind, op.sender, op.receivers, op.box, op.nbytes, op.chunks) == ("broadcast", 0, (1,), ((0, 4),), 16, 2)
    with pytest.raises(DiagnosticError, match="has slot 3 but is op 0"):
        read(good.replace("slot = 0", "slot = 3"))
    with pytest.raises(DiagnosticError, match="missing or malformed attribute"):
        read(good.replace("chunks = 2 : i64, ", ""))
    with pytest.raises(DiagnosticError, match="empty or malformed box"):
        read(good.replace("limit = array<i64: 4>", "limit = array<i64: 0>"))
    with pytest.raises(DiagnosticError, match="unexpected 'hlopar.multicast'"):
        read(good.replace("hlopar.broadcast", "hlopar.multicast"))
    with pytest.raises(DiagnosticError, match="must be distinct devices"):
        read(good.replace("array<i64: 1>", "array<i64: 0>"))
