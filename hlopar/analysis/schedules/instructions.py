"""The static instruction stream of each mesh for one training step over B microbatches.

A stage's tasks (from its schedule) become, in order: the RECVs its RUN needs, the RUN, a SEND
per consumer of what the RUN produced (issued at once, so transfers overlap the RUNs that
follow), an ACCUMULATE after the RUN that finishes a microbatch's weight gradients (B, or W
when backwards are split), and FREEs of buffers whose last user ran; one UPDATE ends the step.

Every instruction names the instructions it waits for (`deps`), across meshes for a RECV (it
waits for its SEND). Instruction ids are "<mesh>:<position>". Buffers are per mesh:
`stash.m` (what F(m) keeps for B(m)/W(m)), `carry.m` (what B(m) hands to W(m), when
backwards are split), `act.m->m3` / `grad.m->m1` (produced, until sent), `act.m<-m1` /
`grad.m<-m3` (received, until the stage's last task of microbatch m ran).
FREE is asynchronous: it releases the buffer once its deps are done and blocks no stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from hlopar.analysis.schedules.registry import get_schedule
from hlopar.analysis.schedules.tasks import BACKWARD, FORWARD, WEIGHT, Schedule
from hlopar.analysis.schedules.topology import PipelineTopology
from hlopar.units import format_bytes

__all__ = [
    "RUN",
    "SEND",
    "RECV",
    "ACCUMULATE",
    "FREE",
    "UPDATE",
    "Instruction",
    "MeshStream",
    "PipelineStreams",
    "build_streams",
]

RUN, SEND, RECV, ACCUMULATE, FREE, UPDATE = "RUN", "SEND", "RECV", "ACCUMULATE", "FREE", "UPDATE"
OPS = (RUN, SEND, RECV, ACCUMULATE, FREE, UPDATE)
ACT, GRAD = "act", "grad"


@dataclass(frozen=True)
class Instruction:
    """One step of a mesh's stream.

    `kind` is F/B/W for RUN and act/grad for SEND/RECV; `peer` the other mesh of a SEND/RECV;
    `nbytes` what a SEND/RECV moves or a FREE releases; `buffer` what a FREE releases;
    `allocates` the (buffer, bytes) an instruction creates when it starts. A stream bound to
    a program (`codegen.pipeline_program`) also names what a RUN executes (`executables`,
    the fragments' names, in order) and what a SEND/RECV carries (`transfers`, the program's
    cross-mesh transfers, in order); `build_streams` leaves both empty.
    """

    id: str
    op: str
    kind: str = ""
    microbatch: int | None = None
    peer: str = ""
    nbytes: int = 0
    buffer: str = ""
    allocates: tuple[tuple[str, int], ...] = ()
    deps: tuple[str, ...] = ()
    executables: tuple[str, ...] = ()
    transfers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown instruction {self.op!r}; valid: {', '.join(OPS)}")

    @property
    def mesh(self) -> str:
        return self.id.rpartition(":")[0]

    def describe(self) -> str:
        """The instruction without its id and deps: `SEND act mb=3 -> m2 (3.8 MiB)`."""
        mb = f" mb={self.microbatch}" if self.microbatch is not None else ""
        if self.op == RUN:
            return f"RUN {self.kind}{mb}" + (f" [{', '.join(self.executables)}]" if self.executables else "")
        if self.op in (SEND, RECV):
            arrow = "->" if self.op == SEND else "<-"
            carried = f" [{', '.join(self.transfers)}]" if self.transfers else ""
            return f"{self.op} {self.kind}{mb} {arrow} {self.peer} ({format_bytes(self.nbytes)}){carried}"
        if self.op == FREE:
            return f"FREE {self.buffer} ({format_bytes(self.nbytes)})"
        return f"{self.op}{mb}"

    def __str__(self) -> str:
        after = f"  after {', '.join(self.deps)}" if self.deps else ""
        return f"{self.id}  {self.describe()}{after}"

    def to_dict(self) -> dict:
        out: dict = {"id": self.id, "op": self.op}
        for name in ("kind", "microbatch", "peer", "nbytes", "buffer"):
            value = getattr(self, name)
            if value not in ("", None, 0) or (name == "microbatch" and value == 0):
                out[name] = value
        if self.allocates:
            out["allocates"] = [list(a) for a in self.allocates]
        if self.deps:
            out["deps"] = list(self.deps)
        if self.executables:
            out["executables"] = list(self.executables)
        if self.transfers:
            out["transfers"] = list(self.transfers)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Instruction:
        return cls(
            id=data["id"],
            op=data["op"],
            kind=data.get("kind", ""),
            microbatch=data.get("microbatch"),
            peer=data.get("peer", ""),
            nbytes=int(data.get("nbytes", 0)),
            buffer=data.get("buffer", ""),
            allocates=tuple((str(n), int(b)) for n, b in data.get("allocates", ())),
            deps=tuple(data.get("deps", ())),
            executables=tuple(data.get("executables", ())),
            transfers=tuple(data.get("transfers", ())),
        )


@dataclass(frozen=True)
class MeshStream:
    """The instructions of one mesh (running one pipeline stage), in issue order."""

    mesh: str
    stage: int
    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        return "\n".join([f"mesh {self.mesh} (stage {self.stage})"] + [f"  {i}" for i in self.instructions])

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)


@dataclass(frozen=True)
class PipelineStreams:
    """All meshes' streams for one step, and the schedule they came from."""

    schedule: str
    num_microbatches: int
    split_backward: bool
    streams: tuple[MeshStream, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "streams", tuple(self.streams))
        self.validate()

    def __str__(self) -> str:
        plural = "" if self.num_microbatches == 1 else "es"
        head = f"# schedule {self.schedule}, {len(self.streams)} meshes, {self.num_microbatches} microbatch{plural}"
        return "\n".join([head] + [str(s) for s in self.streams]) + "\n"

    def __getitem__(self, mesh: str) -> MeshStream:
        for stream in self.streams:
            if stream.mesh == mesh:
                return stream
        raise KeyError(mesh)

    @property
    def meshes(self) -> tuple[str, ...]:
        return tuple(s.mesh for s in self.streams)

    def instructions(self) -> Iterator[Instruction]:
        for stream in self.streams:
            yield from stream.instructions

    def by_id(self) -> dict[str, Instruction]:
        return {i.id: i for i in self.instructions()}

    def validate(self) -> None:
        """Ids unique and on their mesh, deps known, every FREE names a buffer allocated on its mesh."""
        ids: set[str] = set()
        for stream in self.streams:
            allocated: set[str] = set()
            for inst in stream.instructions:
                if inst.mesh != stream.mesh:
                    raise ValueError(f"instruction {inst.id} listed on mesh {stream.mesh}")
                if inst.id in ids:
                    raise ValueError(f"duplicate instruction id {inst.id}")
                ids.add(inst.id)
                allocated.update(name for name, _ in inst.allocates)
            for inst in stream.instructions:
                if inst.op == FREE and inst.buffer not in allocated:
                    raise ValueError(
                        f"{inst.id} frees {inst.buffer!r}, which no instruction on {stream.mesh} allocates"
                    )
        for inst in self.instructions():
            unknown = [d for d in inst.deps if d not in ids]
            if unknown:
                raise ValueError(f"{inst.id} waits for unknown instructions {unknown}")

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(
            {
                "schedule": self.schedule,
                "num_microbatches": self.num_microbatches,
                "split_backward": self.split_backward,
                "meshes": [
                    {"mesh": s.mesh, "stage": s.stage, "instructions": [i.to_dict() for i in s.instructions]}
                    for s in self.streams
                ],
            },
            indent=indent,
        )

    @classmethod
    def from_json(cls, text: str) -> PipelineStreams:
        data = json.loads(text)
        streams = tuple(
            MeshStream(m["mesh"], int(m["stage"]), tuple(Instruction.from_dict(i) for i in m["instructions"]))
            for m in data["meshes"]
        )
        return cls(data["schedule"], int(data["num_microbatches"]), bool(data["split_backward"]), streams)


def build_streams(topology: PipelineTopology, schedule: str | Schedule, num_microbatches: int) -> PipelineStreams:
    """Each mesh's instruction stream for `schedule` over `num_microbatches` on `topology`."""
    schedule = get_schedule(schedule)
    orders = schedule.tasks(topology.num_stages, num_microbatches)
    builders = [_StageBuilder(topology, k, schedule.split_backward) for k in range(topology.num_stages)]
    for builder, order in zip(builders, orders):
        for task in order:
            builder.add_task(task.kind, task.microbatch)
        builder.add_update()
    ids = {key: f"{b.mesh}:{pos}" for b in builders for pos, (key, _, _) in enumerate(b.items)}
    streams = []
    for b in builders:
        insts = tuple(
            Instruction(id=ids[key], deps=tuple(ids[d] for d in deps), **fields) for key, fields, deps in b.items
        )
        streams.append(MeshStream(b.mesh, b.stage, insts))
    return PipelineStreams(schedule.name, num_microbatches, schedule.split_backward, tuple(streams))


class _StageBuilder:
    """One stage's instructions with symbolic keys; `build_streams` turns keys into ids."""

    def __init__(self, topology: PipelineTopology, stage: int, split: bool):
        self.topology, self.stage, self.split = topology, stage, split
        self.mesh = topology.meshes[stage]
        self.ins, self.outs = topology.inputs(stage), topology.outputs(stage)
        self.items: list[tuple[tuple, dict, list[tuple]]] = []  # (key, fields, dep keys)

    def _emit(self, key: tuple, deps: list[tuple], **fields) -> tuple:
        self.items.append((key, fields, deps))
        return key

    def _mesh(self, stage: int) -> str:
        return self.topology.meshes[stage]

    def add_task(self, kind: str, m: int) -> None:
        k = self.stage
        if kind == FORWARD:
            recvs = [self._recv(ACT, m, e.src, k, e.nbytes) for e in self.ins]
            allocs = [(f"stash.{m}", self.topology.activation_bytes[k])]
            allocs += [(f"act.{m}->{self._mesh(e.dst)}", e.nbytes) for e in self.outs]
            run = self._emit(("run", k, FORWARD, m), recvs, op=RUN, kind=FORWARD, microbatch=m, allocates=tuple(allocs))
            for e in self.outs:
                self._send(ACT, m, k, e.dst, e.nbytes, run)
        elif kind == BACKWARD:
            recvs = [self._recv(GRAD, m, e.dst, k, e.backward_bytes) for e in self.outs]
            allocs = tuple((f"grad.{m}->{self._mesh(e.src)}", e.backward_bytes) for e in self.ins)
            if self.split:
                allocs += ((f"carry.{m}", self.topology.carry_bytes[k]),)
            run = self._emit(
                ("run", k, BACKWARD, m),
                [("run", k, FORWARD, m)] + recvs,
                op=RUN,
                kind=BACKWARD,
                microbatch=m,
                allocates=allocs,
            )
            for e in self.ins:
                self._send(GRAD, m, k, e.src, e.backward_bytes, run)
            if not self.split:
                self._finish(m, run)
        elif kind == WEIGHT:
            run = self._emit(("run", k, WEIGHT, m), [("run", k, BACKWARD, m)], op=RUN, kind=WEIGHT, microbatch=m)
            self._finish(m, run)
        else:
            raise ValueError(f"unknown task kind {kind!r}")

    # Transfer keys name (sending stage, receiving stage), gradients going backwards.
    def _recv(self, what: str, m: int, src: int, dst: int, nbytes: int) -> tuple:
        buffer = f"{what}.{m}<-{self._mesh(src)}"
        return self._emit(
            ("recv", what, m, src, dst),
            [("send", what, m, src, dst)],
            op=RECV,
            kind=what,
            microbatch=m,
            peer=self._mesh(src),
            nbytes=nbytes,
            allocates=((buffer, nbytes),),
        )

    def _send(self, what: str, m: int, src: int, dst: int, nbytes: int, run: tuple) -> None:
        send = self._emit(
            ("send", what, m, src, dst), [run], op=SEND, kind=what, microbatch=m, peer=self._mesh(dst), nbytes=nbytes
        )
        self._free(f"{what}.{m}->{self._mesh(dst)}", nbytes, send)

    def _free(self, buffer: str, nbytes: int, after: tuple) -> None:
        self._emit(("free", self.stage, buffer), [after], op=FREE, buffer=buffer, nbytes=nbytes)

    def _finish(self, m: int, last: tuple) -> None:
        """Accumulate microbatch m's weight gradients and free what only its backward needed."""
        k = self.stage
        self._emit(("acc", k, m), [last], op=ACCUMULATE, microbatch=m)
        self._free(f"stash.{m}", self.topology.activation_bytes[k], last)
        if self.split:
            self._free(f"carry.{m}", self.topology.carry_bytes[k], last)
        for e in self.ins:
            self._free(f"act.{m}<-{self._mesh(e.src)}", e.nbytes, last)
        for e in self.outs:
            self._free(f"grad.{m}<-{self._mesh(e.dst)}", e.backward_bytes, last)

    def add_update(self) -> None:
        accs = [key for key, fields, _ in self.items if fields["op"] == ACCUMULATE]
        self._emit(("update", self.stage), accs, op=UPDATE)
