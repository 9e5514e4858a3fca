"""Reading Shardy's mpmd topology attribute and mesh tensor types as jaxlib prints them."""

from __future__ import annotations

import pytest

from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.mpmd import MeshTensorType, parse_topology
from hlopar.analysis.sharding import TensorSharding


def test_topology():
    meshes = parse_topology('#mpmd.topology<<"m1" : <["x"=2, "y"=4]>>, <"m 2" : <["z"=3], device_ids=[2, 0, 1]>>>')
    assert meshes == {"m1": DeviceMesh.of((2, 4), ("x", "y")), "m 2": DeviceMesh.of((3,), ("z",), device_ids=(2, 0, 1))}
    assert list(meshes) == ["m1", "m 2"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('#mpmd.topology<<"m1" : <["x"=2]>>, <"m1" : <["x"=2]>>>', "mesh 'm1' appears twice"),
        ('#mpmd.topology<<"m1" <["x"=2]>>>', "expected ':'"),
    ],
)
def test_bad_topologies(text, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(text)


def test_mesh_tensor_types():
    plain = MeshTensorType.parse('!mpmd.mesh_tensor<"m1", tensor<12x16xf32>>')
    assert plain == MeshTensorType("m1", "tensor<12x16xf32>", None)
    sharded = MeshTensorType.parse('!mpmd.mesh_tensor<"m>2", tensor<4x8xbf16>, sharding=<@mesh, [{"x"}, {?}]>>')
    assert sharded.mesh_name == "m>2" and sharded.tensor_type == "tensor<4x8xbf16>"
    assert sharded.sharding == TensorSharding.parse('#sdy.sharding<@mesh, [{"x"}, {?}]>')
    kinds = MeshTensorType.parse(
        '!mpmd.mesh_tensor<"m", tensor<4xf32>, sharding=<@mesh, [{}]>, memory_kind="pinned_host">'
    )
    assert kinds.memory_kind == "pinned_host" and kinds.sharding is not None


def test_bad_mesh_tensor_types():
    with pytest.raises(ValueError, match="unexpected 'layout'"):
        MeshTensorType.parse('!mpmd.mesh_tensor<"m", tensor<4xf32>, layout=<1>>')
    with pytest.raises(ValueError, match="unbalanced"):
        MeshTensorType.parse('!mpmd.mesh_tensor<"m", tensor<4xf32')
