"""What `hlopar.parallelize`'s callable (`api.ParallelizedFunction`) asks of a runtime, so
that it never asks which runtime it has: the in-process one (`in_process.InProcessRuntime`,
the plan's one executable run here, as `jax.jit` runs it) and the Ray one
(`ray_runtime.RayRuntime`, a driver and its mesh workers) both are a `Runtime`.

A step's output is the runtime's own (its results as jax arrays here, or the step's number
and the few values that came back with it from the workers); `outputs` turns it into `fn`'s
result leaves, which are `jax.Array`s or `remote_array.RemoteArray`s the caller passes back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from hlopar.runtime.step_stats import StepStats

__all__ = ["OutputLeaf", "Runtime"]

OutputLeaf = tuple[jax.ShapeDtypeStruct, str]  # a result leaf of `fn`: its shape and dtype, and its name


class Runtime(Protocol):
    step_id: int  # steps run (or restored) since it was made
    last_stats: StepStats | None  # the last step's timing
    holds_workers: bool  # it runs worker processes while alive (`api.MAX_WORKER_SETS` bounds them)
    restart_message: str  # what the log says when it starts again after a stop

    @property
    def alive(self) -> bool:
        """Started, and not stopped since (by a failure, `shutdown` or a lost cluster)."""

    def connect(self) -> None:
        """Reaches what it runs on before a start (Ray: the cluster, started again where a
        local one died under this process)."""

    def start(self) -> None:
        """Compiles the plan where it runs (and starts the workers); stops what ran before."""

    def shutdown(self) -> None:
        """Stops it; what it held is let go. `start` again makes it run."""

    def set_aside(self) -> None:
        """Another signature's runtime runs the calls for now: lets go what the caller dropped."""

    def run(self, arguments: Sequence, resident: Mapping[int, tuple[int, int]] | None = None) -> Any:
        """One step on @main's arguments; `resident`: argument number -> (step, result
        position) of a result it still keeps (sent nothing for). Returns its output."""

    def outputs(self, output: Any, leaves: Sequence[OutputLeaf], parts: Sequence[tuple[int, ...]]) -> list:
        """`fn`'s result leaves from a step's output (of `run` or `load`); `parts`: per leaf,
        the positions of @main's results it is made of."""

    def save(self, directory: str | Path, record: Mapping) -> dict:
        """Writes the last step's results into a save's staging directory (`checkpoint.save`)."""

    def save_start(self, directory: str | Path, record: Mapping) -> Callable[[], dict]:
        """`save` in the background; the function returned waits for it."""

    def load(self, directory: str | Path, keys: Sequence[str] = ()) -> Any:
        """What `save` wrote, as the output of a new step."""

    def worker_meshes(self) -> dict[str, str]:
        """The parts of a save: each worker's mesh, by the worker's name."""
