// RUN: hlopar-opt %s --split-input-file --verify-diagnostics

// What jaxlib's mpmd dialect checks in the programs hlopar writes: a fragment only takes
// values on its own mesh (a value from another mesh needs an mpmd.transfer), and a mesh
// tensor's layout uses axes of its topology mesh and divides the dimensions.

!m0 = !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>
!m1 = !mpmd.mesh_tensor<"m1", tensor<8x16xf32>>
func.func @operand_on_another_mesh(%arg0: !m0) -> !m1
    attributes {topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=4]>>>} {
  // expected-error @+1 {{expected the mesh name of the operand to match that of the fragment op: m0 != m1}}
  %0 = mpmd.fragment<mesh="m1", origin=["stage1"], stage=1> (%arg0) (%arg1: tensor<8x16xf32>) {
    mpmd.return %arg1 : tensor<8x16xf32>
  } : (!m0) -> !m1
  return %0 : !m1
}

// -----

!m0 = !mpmd.mesh_tensor<"m0", tensor<8x16xf32>>
!m1 = !mpmd.mesh_tensor<"m1", tensor<8x16xf32>, sharding=<@m1, [{"y"}, {}]>>
func.func @unknown_axis(%arg0: !m0) -> !m1
    attributes {topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=4]>>>} {
  // expected-error @+1 {{unknown axis name: "y"}}
  %0 = mpmd.transfer %arg0 : (!m0) -> !m1
  return %0 : !m1
}

// -----

!m0 = !mpmd.mesh_tensor<"m0", tensor<6x16xf32>>
!m1 = !mpmd.mesh_tensor<"m1", tensor<6x16xf32>, sharding=<@m1, [{"x"}, {}]>>
func.func @not_divisible(%arg0: !m0) -> !m1
    attributes {topology = #mpmd.topology<<"m0" : <["x"=4]>>, <"m1" : <["x"=4]>>>} {
  // expected-error @+1 {{dim 0 with size 6 is not divisible by its sharded size 4}}
  %0 = mpmd.transfer %arg0 : (!m0) -> !m1
  return %0 : !m1
}
