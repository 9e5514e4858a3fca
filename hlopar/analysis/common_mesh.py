"""One mesh for all the GSPMD shardings of a program.

GSPMD strings name devices, not mesh axes; converted one by one they give one mesh each
(`{devices=[2,4]<=[8]}` and `{devices=[4,2]<=[8]}` need axes of 2x4 and 4x2). XLA and the
planning passes want a single mesh per program. When every sharding's device list is an
iota (possibly reshaped and transposed), each splits the device id's mixed-radix digits at
some cut points (device strides); if all cut points together form a divisibility chain
1 | c1 | c2 | ... | N, the chain's steps are the axes of a mesh on which every sharding
is expressible. Each result is checked by converting it back.
"""

from __future__ import annotations

from collections.abc import Sequence

from hlopar.analysis.gspmd import GspmdSharding, format_gspmd, iota_factors, sdy_to_gspmd
from hlopar.analysis.mesh import DeviceMesh
from hlopar.analysis.sharding import AxisRef, DimSharding, TensorSharding


def common_mesh(
    shardings: Sequence[GspmdSharding], mesh_name: str = "mesh"
) -> tuple[DeviceMesh, list[TensorSharding]] | None:
    """A mesh and every tiled sharding on it, in order, or None when there is none."""
    tiled = [gs.canonical() for gs in shardings]
    if not tiled or any(gs.kind != "tiled" or set(gs.last_tile_dims) - {"replicated"} for gs in tiled):
        return None
    sizes = {len(gs.devices) for gs in tiled}
    if len(sizes) != 1:
        return None
    (count,) = sizes
    factors = {}
    cuts = {1, count}
    for gs in tiled:
        found = iota_factors(gs)
        if found is None:
            return None
        factors[id(gs)] = found
        for size, _, stride in found:
            cuts |= {stride, stride * size}
    chain = sorted(cuts)
    if any(b % a for a, b in zip(chain, chain[1:])):
        return None
    # Axis k spans device strides [chain[k], chain[k+1]); the mesh lists them major first.
    steps = [(chain[k], chain[k + 1] // chain[k]) for k in range(len(chain) - 1)]
    steps.reverse()
    names = {stride: f"axis_{k}" for k, (stride, _) in enumerate(steps)}
    mesh = DeviceMesh(tuple((names[stride], size) for stride, size in steps))
    result = []
    for gs in tiled:
        sharding = _on_mesh(gs, factors[id(gs)], steps, names, mesh_name)
        if format_gspmd(GspmdSharding.parse(sdy_to_gspmd(mesh, sharding, sharding.rank)).canonical()) != format_gspmd(
            gs
        ):
            return None
        result.append(sharding)
    return mesh, result


def _on_mesh(gs, factors, steps, names, mesh_name) -> TensorSharding:
    """The sharding on the common mesh: each factor's digits become the axes covering them."""
    rank = gs.rank
    dims: list[list[AxisRef]] = [[] for _ in range(rank)]
    for size, group, stride in factors:
        if group >= rank:
            continue  # replication: axes no dim uses
        covered = [s for s, _ in steps if stride <= s < stride * size]
        dims[group] += [AxisRef(names[s]) for s in sorted(covered, reverse=True)]
    return TensorSharding(mesh_name, tuple(DimSharding(tuple(d)) for d in dims))
