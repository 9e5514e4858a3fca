"""One planned fragment run for one microbatch, and the FREE of a microbatch's stash, as both
executors do them (the in-process `local_executor.PipelinedStep` and the Ray workers of
`ray_runtime`).

The fragment's accumulated results are summed inside its executable: the running sums go in
first (donated; zeros at the first microbatch) and come back updated. Its other results are
stored per microbatch when they depend on it, once otherwise; the values it keeps for its
own backward (`keep`) follow its results.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import jax
import numpy as np

from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.pipeline_program import PipelineProgram, ProgramFragment

__all__ = ["free_stash", "run_fragment"]


def run_fragment(program: PipelineProgram, ex: DeviceExecutable, fragment: ProgramFragment, inputs: Sequence,
                 m: int, sums: MutableMapping[int, jax.Array],
                 store: MutableMapping[tuple[int, int | None], object]) -> list[jax.Array]:
    """Runs `ex` (the executable of `program`'s `fragment`) on `inputs` (its operands, as
    read for microbatch `m`), updating `sums` (value -> running sum) and `store` ((value,
    microbatch or None) -> array). Returns the outputs, not waited for."""
    accumulators = []
    for position in fragment.accumulate:
        v = fragment.results[position]
        if v not in sums:
            shape, dtype = ex.spmd.input_types[len(accumulators)]
            sums[v] = jax.device_put(np.zeros(shape, dtype), ex.input_shardings[len(accumulators)])
        accumulators.append(sums[v])
    outputs = ex.run(accumulators + list(inputs))
    count = len(fragment.results)
    for position, v in enumerate(fragment.results):
        if position in fragment.accumulate:
            sums[v] = outputs[position]
        else:
            store[(v, m if program.values[v].per_microbatch else None)] = outputs[position]
    for j, position in enumerate(fragment.keep):
        store[(fragment.results[position], m)] = outputs[count + j]
    return outputs


def free_stash(program: PipelineProgram, store: MutableMapping[tuple[int, int | None], object], mesh: str,
               buffer: str) -> None:
    """Drops what a FREE of `buffer` says is dead on `mesh`: at a stash's FREE (after the
    stage's last task of the microbatch, so what B hands to W too), the microbatch's values
    of this mesh that no update reads; other buffers free nothing here."""
    if not buffer.startswith("stash."):
        return
    m = int(buffer.split(".")[1])
    for (v, mb) in list(store):
        value = program.values[v]
        if mb == m and value.mesh == mesh and value.per_microbatch and v not in program.needed_once:
            del store[(v, mb)]
