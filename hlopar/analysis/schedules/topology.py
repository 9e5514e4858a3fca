"""The pipeline as a stage graph: which stage's forward feeds which, and how many bytes.

An edge (src, dst, nbytes) says stage src's forward sends nbytes of activations per microbatch
to stage dst > src, and so stage dst's backward sends as many gradient bytes back (or
`grad_nbytes`, when given: a program's gradients need not be its activations' size). A plain
pipeline is the chain k -> k+1; skip connections (a U-Transformer's stage i -> #stages-1-i)
are more edges. Each stage also stashes `activation_bytes[k]` per microbatch between its
forward and backward, and, when a schedule splits backwards, holds `carry_bytes[k]` from
its B to its W (what B computed that W reads; for the memory estimate). Each stage runs on
`meshes[k]`: one stage per mesh, or, with virtual stages, the same number of stages (chunks)
on each mesh, placed as a schedule places them (`Schedule.placed`); an edge between two
stages of one mesh is a hand-over on that mesh, not a transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Edge", "PipelineTopology"]


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    nbytes: int
    grad_nbytes: int | None = None  # what dst's backward sends back; None: nbytes

    @property
    def backward_bytes(self) -> int:
        return self.nbytes if self.grad_nbytes is None else self.grad_nbytes


@dataclass(frozen=True)
class PipelineTopology:
    """Stages 0..S-1 on `meshes` (default m1..mS; a name repeats where a mesh holds several
    stages), the forward edges between them, stash sizes."""

    num_stages: int
    edges: tuple[Edge, ...]
    activation_bytes: tuple[int, ...] = ()
    meshes: tuple[str, ...] = ()
    carry_bytes: tuple[int, ...] = ()  # per stage, held from B to W per microbatch (default 0)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"need at least one stage, got {self.num_stages}")
        object.__setattr__(self, "edges", tuple(self.edges))
        if not self.activation_bytes:
            object.__setattr__(self, "activation_bytes", (0,) * self.num_stages)
        object.__setattr__(self, "activation_bytes", tuple(int(b) for b in self.activation_bytes))
        object.__setattr__(self, "carry_bytes", tuple(int(b) for b in self.carry_bytes or (0,) * self.num_stages))
        if not self.meshes:
            object.__setattr__(self, "meshes", tuple(f"m{k + 1}" for k in range(self.num_stages)))
        object.__setattr__(self, "meshes", tuple(self.meshes))
        if any(len(t) != self.num_stages for t in (self.activation_bytes, self.carry_bytes, self.meshes)):
            raise ValueError("activation_bytes, carry_bytes and meshes need one entry per stage")
        held = [self.meshes.count(mesh) for mesh in self.mesh_names]
        if len(set(held)) != 1:
            raise ValueError(f"every mesh must hold as many stages as the others, got {self.meshes}")
        seen = set()
        for e in self.edges:
            if not (0 <= e.src < e.dst < self.num_stages):
                raise ValueError(f"edge {e.src}->{e.dst}: need 0 <= src < dst < {self.num_stages}")
            if e.nbytes < 0 or e.backward_bytes < 0:
                raise ValueError(f"edge {e.src}->{e.dst}: negative size {min(e.nbytes, e.backward_bytes)}")
            if (e.src, e.dst) in seen:
                raise ValueError(f"edge {e.src}->{e.dst} given twice; give its total bytes once")
            seen.add((e.src, e.dst))

    @classmethod
    def chain(
        cls,
        num_stages: int,
        nbytes: int | Sequence[int],
        activation_bytes: int | Sequence[int] = 0,
        skips: Sequence[Edge] = (),
        meshes: Sequence[str] = (),
    ) -> PipelineTopology:
        """Stage k -> k+1 with `nbytes` (one value, or one per boundary), plus `skips`."""
        per_edge = [nbytes] * (num_stages - 1) if isinstance(nbytes, int) else list(nbytes)
        if len(per_edge) != num_stages - 1:
            raise ValueError(f"need {num_stages - 1} chain edge sizes, got {len(per_edge)}")
        stash = [activation_bytes] * num_stages if isinstance(activation_bytes, int) else list(activation_bytes)
        chain = [Edge(k, k + 1, b) for k, b in enumerate(per_edge)]
        extra = {(e.src, e.dst): e for e in skips}
        merged = [
            Edge(e.src, e.dst, e.nbytes + extra.pop((e.src, e.dst)).nbytes) if (e.src, e.dst) in extra else e
            for e in chain
        ]
        return cls(num_stages, tuple(merged) + tuple(extra.values()), tuple(stash), tuple(meshes))

    # Read per instruction while streams are built (a step of 1024 microbatches reads them
    # millions of times): computed once per topology, which is immutable.
    def inputs(self, stage: int) -> tuple[Edge, ...]:
        """Edges into `stage`, by source stage."""
        return self._ends[0][stage]

    def outputs(self, stage: int) -> tuple[Edge, ...]:
        """Edges out of `stage`, by destination stage."""
        return self._ends[1][stage]

    @functools.cached_property
    def _ends(self) -> tuple[tuple[tuple[Edge, ...], ...], tuple[tuple[Edge, ...], ...]]:
        inputs = tuple(
            tuple(sorted((e for e in self.edges if e.dst == k), key=lambda e: e.src)) for k in range(self.num_stages)
        )
        outputs = tuple(
            tuple(sorted((e for e in self.edges if e.src == k), key=lambda e: e.dst)) for k in range(self.num_stages)
        )
        return inputs, outputs

    @functools.cached_property
    def mesh_names(self) -> tuple[str, ...]:
        """The distinct meshes, in order of their first stage."""
        return tuple(dict.fromkeys(self.meshes))

    @functools.cached_property
    def chunks(self) -> int:
        """Stages per mesh (1 unless virtual stages)."""
        return self.num_stages // len(self.mesh_names)

    def stages_on(self, mesh: str) -> tuple[int, ...]:
        """The stages of `mesh`, in order: its chunks 0, 1, ..."""
        return tuple(k for k, m in enumerate(self.meshes) if m == mesh)

    def stage_of(self, mesh: str) -> int:
        """The stage of a mesh that holds one."""
        stages = self.stages_on(mesh)
        if len(stages) != 1:
            raise ValueError(f"mesh {mesh} holds stages {stages}, not one")
        return stages[0]
