// RUN: hlopar-opt %s --split-input-file --verify-diagnostics --pass-pipeline='builtin.module(hlopar-cross-mesh-resharding)'

// A cross-mesh transfer needs disjoint meshes.

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x"}]>>
!b = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1>, m2 = array<i64: 1, 2>}} {
  func.func @overlap(%arg0: !a) -> !b attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    // expected-error @+1 {{meshes 'm1' and 'm2' share physical devices [1]; a cross-mesh transfer needs disjoint meshes}}
    %0 = mpmd.transfer %arg0 : (!a) -> !b
    return %0 : !b
  }
}

// -----

// hlopar.devices may only name meshes of a topology.

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
!b = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
// expected-error @+1 {{'hlopar.devices' names mesh 'm3', which is in no topology (meshes: 'm1', 'm2')}}
module attributes {hlopar.devices = {m1 = array<i64: 0, 1>, m2 = array<i64: 2, 3>, m3 = array<i64: 4>}} {
  func.func @unknown_mesh(%arg0: !a) -> !b attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    %0 = mpmd.transfer %arg0 : (!a) -> !b
    return %0 : !b
  }
}

// -----

// Every mesh a transfer touches needs its physical devices.

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
!b = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
module attributes {hlopar.devices = {m1 = array<i64: 0, 1>}} {
  func.func @missing_mesh(%arg0: !a) -> !b attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    // expected-error @+1 {{mesh 'm2' has no physical devices in 'hlopar.devices'}}
    %0 = mpmd.transfer %arg0 : (!a) -> !b
    return %0 : !b
  }
}

// -----

// One physical device per device of the mesh.

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
!b = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
// expected-error @+1 {{'hlopar.devices' gives 3 devices to mesh 'm2' of 2 devices}}
module attributes {hlopar.devices = {m1 = array<i64: 0, 1>, m2 = array<i64: 2, 3, 4>}} {
  func.func @wrong_size(%arg0: !a) -> !b attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    %0 = mpmd.transfer %arg0 : (!a) -> !b
    return %0 : !b
  }
}

// -----

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
!b = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
// expected-error @+1 {{'hlopar.devices' entry 'm1' must be an array<i64: ...>, got [0, 1]}}
module attributes {hlopar.devices = {m1 = [0, 1], m2 = array<i64: 2, 3>}} {
  func.func @not_an_array(%arg0: !a) -> !b attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    %0 = mpmd.transfer %arg0 : (!a) -> !b
    return %0 : !b
  }
}


// -----

// A mesh name means one mesh in the whole program (hlopar.devices is per name).

!a = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
func.func @first(%arg0: !a) -> !a attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>>} {
  return %arg0 : !a
}
// expected-error @+1 {{mesh 'm1' is <["x"=4]> here but <["x"=2]> in another topology}}
func.func @second(%arg0: !a) -> !a attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>>} {
  return %arg0 : !a
}
