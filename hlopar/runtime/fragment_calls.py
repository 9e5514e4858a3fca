"""One planned fragment run for one microbatch, and the FREE of a microbatch's stash, as both
executor core does them (`interpreter.StepInterpreter`, for the local runtime
`local_executor.PipelinedStep` and the Ray workers of `ray_worker`).

The fragment's accumulated results are summed inside its executable: the running sums go in
first (donated; zeros at the first microbatch) and come back updated. Its other results are
stored per microbatch when they depend on it, once otherwise; the values it keeps for its
own backward (`keep`) follow its results.

Per step, no work `jax.jit` would not do on its arguments: each (array, layout) an
executable reads is placed once per step (`Placements`, shared by every fragment of the
step: a parameter the update leaves sharded and the forward, the backward and the update
read replicated is laid out once, not three times). Where the devices are the host's CPU,
an array goes to another layout through host memory (`jax.device_put`: a replicated copy
of a host array is that array, aliased by every device), which is 8x faster there than a
compiled identity whose collectives wait on every device's thread (17 parameters of the
GPT of `tools/bench_runtime.py`, 8 CPU devices on 2 busy cores: 10 ms against 85 ms);
on accelerators, by that compiled identity (device to device, one program for all of a
fragment's inputs), and the zero accumulators of the first microbatch are made there by
one compiled program instead of copied from the host.
"""

from __future__ import annotations

import functools
from collections.abc import MutableMapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.pipeline_program import PipelineProgram, ProgramFragment

__all__ = ["Placements", "free_stash", "run_fragment"]


class Placements:
    """One step's placed inputs: (array, layout) -> the array so laid out (module docstring).
    Holds the arrays it was asked about, so that their ids stay theirs for the step."""

    def __init__(self):
        self.placed: dict[tuple[int, Sharding], tuple[object, jax.Array]] = {}
        self.moved = 0  # arrays placed (copied from the host or moved between layouts), in all

    def inputs(self, ex: DeviceExecutable, inputs: Sequence, offset: int, donated: Sequence[int] = ()) -> list:
        """`inputs`, `ex`'s arguments from number `offset` on, as `ex` reads them. A
        donated input (an operand position in `donated`) is the step's last use of its
        placed copy: the copy leaves the cache."""
        out: list = list(inputs)
        moves: list[int] = []
        for k, x in enumerate(inputs):
            sharding = ex.input_shardings[offset + k]
            if isinstance(x, jax.Array) and (x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)):
                continue  # as it is (`ex.run` rewraps an equivalent layout, no copy)
            hit = self.placed.pop((id(x), sharding), None) if k in donated else self.placed.get((id(x), sharding))
            if hit is not None:
                out[k] = hit[1]
            elif isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set:
                moves.append(k)
            else:
                out[k] = ex.place(offset + k, x)
                self._keep(x, sharding, out[k], k in donated)
        if moves:
            layouts = tuple(ex.input_shardings[offset + k] for k in moves)
            arrays = [inputs[k] for k in moves]
            placed = jax.device_put(arrays, list(layouts)) if _on_host(layouts) else _relayout(layouts)(*arrays)
            for k, moved in zip(moves, placed):
                out[k] = moved
                self._keep(inputs[k], layouts[moves.index(k)], moved, k in donated)
        return out

    def _keep(self, x, sharding: Sharding, placed: jax.Array, donated: bool) -> None:
        self.moved += 1
        if not donated:
            self.placed[(id(x), sharding)] = (x, placed)


def _on_host(layouts: Sequence[Sharding]) -> bool:
    """Whether the devices of `layouts` are the host's CPU (their memory is the host's)."""
    return all(device.platform == "cpu" for layout in layouts[:1] for device in layout.device_set)


def _identity(*xs):
    return xs


@functools.lru_cache(maxsize=256)
def _relayout(layouts: tuple[Sharding, ...]):
    """Arrays already on the devices, laid out as `layouts` (one program: XLA's collectives)."""
    return jax.jit(_identity, out_shardings=layouts)


@functools.lru_cache(maxsize=256)
def _zeros_program(types: tuple[tuple[tuple[int, ...], object], ...], layouts: tuple[Sharding, ...]):
    """A program making zeros of `types` laid out as `layouts`, on their devices."""
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in types), out_shardings=layouts)


def _zeros(types: tuple[tuple[tuple[int, ...], object], ...], layouts: tuple[Sharding, ...]) -> list[jax.Array]:
    """Fresh zeros of `types` laid out as `layouts` (the host's, on CPU devices: module docstring)."""
    if _on_host(layouts):
        return jax.device_put([np.zeros(shape, dtype) for shape, dtype in types], list(layouts))
    return list(_zeros_program(types, layouts)())


def run_fragment(
    program: PipelineProgram,
    ex: DeviceExecutable,
    fragment: ProgramFragment,
    inputs: Sequence,
    m: int,
    sums: MutableMapping[int, jax.Array],
    store: MutableMapping[tuple[int, int | None], object],
    placements: Placements | None = None,
) -> list[jax.Array]:
    """Runs `ex` (the executable of `program`'s `fragment`) on `inputs` (its operands, as
    read for microbatch `m`), updating `sums` (value -> running sum) and `store` ((value,
    microbatch or None) -> array). `placements`: the step's (module docstring; default:
    this call's own). Returns the outputs, not waited for."""
    count = len(fragment.accumulate)
    if any(fragment.results[position] not in sums for position in fragment.accumulate):
        types = tuple((tuple(ex.spmd.input_types[k][0]), ex.spmd.input_types[k][1]) for k in range(count))
        made = _zeros(types, tuple(ex.input_shardings[:count]))
        for k, position in enumerate(fragment.accumulate):
            sums.setdefault(fragment.results[position], made[k])
    accumulators = [sums[fragment.results[position]] for position in fragment.accumulate]
    inputs = (placements or Placements()).inputs(ex, inputs, count, tuple(fragment.donated))
    outputs = ex.run(accumulators + inputs)
    count = len(fragment.results)
    for position, v in enumerate(fragment.results):
        if position in fragment.accumulate:
            sums[v] = outputs[position]
        else:
            store[(v, m if program.values[v].per_microbatch else None)] = outputs[position]
    for j, position in enumerate(fragment.keep):
        store[(fragment.results[position], m)] = outputs[count + j]
    return outputs


def free_stash(
    program: PipelineProgram,
    store: MutableMapping[tuple[int, int | None], object],
    mesh: str,
    buffer: str,
    freed: MutableMapping[tuple[str, int], int] | None = None,
) -> None:
    """Drops what a FREE of `buffer` says is dead on `mesh`: at a stash's FREE (after the
    stage's last task of the microbatch, so what B hands to W too), the microbatch's values
    of this mesh that no update reads; other buffers free nothing here. On a mesh of several
    stages (`s<k>:stash.<m>`), at the last of its stages' stash FREEs of the microbatch
    (counted in `freed`): a value of one stage may be another's hand-over."""
    stage, _, name = buffer.rpartition(":")
    if not name.startswith("stash."):
        return
    m = int(name.split(".")[1])
    if stage:
        if freed is None:
            raise ValueError(f"FREE {buffer}: a mesh of several stages needs the step's count of stash FREEs")
        freed[mesh, m] = freed.get((mesh, m), 0) + 1
        if freed[mesh, m] < len(program.stages_of_mesh[mesh]):
            return
    for v, mb in list(store):
        value = program.values[v]
        if mb == m and value.mesh == mesh and value.per_microbatch and v not in program.needed_once:
            del store[(v, mb)]
