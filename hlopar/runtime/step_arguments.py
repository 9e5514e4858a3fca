"""The arguments a split step's `@main` takes, from the caller's: one home for what the
executors add or convert, so that the in-process executors, the Ray runtime and
`hlopar.parallelize` hand the same values.

- The microbatch index the split appends when an iota counts the batch's rows
  (`dialect.split.microbatch_index_values`): arange(B), cut per microbatch like any batch argument.
- Typed random keys (`jax.random.key`): the lowered step takes their key data (uint32
  words), which `jax.random.key_data` gives; `np.asarray` of a key array fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from hlopar.dialect.split import microbatch_index_values

__all__ = ["check_batch", "key_data_of", "step_arguments", "wrap_keys"]


def key_data_of(x):
    """An argument as the lowered step takes it (key arrays as their key data)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def wrap_keys(values: Sequence, leaves: Sequence) -> list:
    """Results made in this process as `fn` returns them: typed keys (`leaves`: per value, its
    `jax.ShapeDtypeStruct` and name) wrapped back from their key data."""
    from hlopar.runtime.remote_array import is_key, key_impl

    return [
        jax.random.wrap_key_data(x, impl=key_impl(out.dtype)) if is_key(out.dtype) else x
        for x, (out, _) in zip(values, leaves)
    ]


def step_arguments(arguments: Sequence, num_args: int, index_arg: int | None, microbatches: int) -> list:
    """`arguments` (the step's own, in order) completed to `@main`'s `num_args`; the caller
    may also pass the index itself (all `num_args`)."""
    arguments = [key_data_of(x) for x in arguments]
    if index_arg is not None and len(arguments) == num_args - 1:
        arguments.insert(index_arg, microbatch_index_values(microbatches))
    if len(arguments) != num_args:
        own = num_args - (index_arg is not None)
        raise ValueError(f"the step takes {own} arguments, got {len(arguments)}")
    return arguments


def check_batch(program, arguments: Sequence, skip=()) -> None:
    """Raises ValueError where a batch argument of `program` (a `PipelineProgram`) is not
    its microbatches' whole batch; `skip`: argument numbers not given (kept elsewhere)."""
    for i in program.batch_args:
        if i in skip:
            continue
        shape, whole = program.argument_shapes[i], np.shape(arguments[i])
        expected = (shape[0] * program.microbatches, *shape[1:])
        if tuple(whole) != expected:
            raise ValueError(
                f"batch argument {i} has shape {tuple(whole)}; {program.microbatches} microbatches "
                f"of {tuple(shape)} make {expected}"
            )
