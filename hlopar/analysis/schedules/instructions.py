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
    cross-mesh transfers, in order); `build_streams` leaves both empty. On a mesh holding
    several stages, `stage` says which one an instruction is of (not UPDATE: the mesh's).
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
    stage: int | None = None  # the stage it is of, on a mesh that holds several (else None)
    peer_stage: int | None = None  # with `stage`: the stage at the other end of a SEND/RECV
    # The mesh it runs on, the id's part before its last ":" (read per instruction by the
    # simulator and the runners, so taken from the id once).
    mesh: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown instruction {self.op!r}; valid: {', '.join(OPS)}")
        object.__setattr__(self, "mesh", self.id.rpartition(":")[0])

    def describe(self) -> str:
        """The instruction without its id and deps: `SEND act mb=3 -> m2 (3.8 MiB)`."""
        mb = f" mb={self.microbatch}" if self.microbatch is not None else ""
        if self.stage is not None and self.op != FREE:
            mb += f" s={self.stage}"
        if self.op == RUN:
            return f"RUN {self.kind}{mb}" + (f" [{', '.join(self.executables)}]" if self.executables else "")
        if self.op in (SEND, RECV):
            arrow = "->" if self.op == SEND else "<-"
            carried = f" [{', '.join(self.transfers)}]" if self.transfers else ""
            peer = self.peer + (f" s={self.peer_stage}" if self.peer_stage is not None else "")
            return f"{self.op} {self.kind}{mb} {arrow} {peer} ({format_bytes(self.nbytes)}){carried}"
        if self.op == FREE:
            return f"FREE {self.buffer} ({format_bytes(self.nbytes)})"
        return f"{self.op}{mb}"

    def __str__(self) -> str:
        after = f"  after {', '.join(self.deps)}" if self.deps else ""
        return f"{self.id}  {self.describe()}{after}"

    def to_dict(self) -> dict:
        out: dict = {"id": self.id, "op": self.op}
        for name in ("kind", "microbatch", "peer", "nbytes", "buffer", "stage", "peer_stage"):
            value = getattr(self, name)
            if value not in ("", None, 0) or (name in ("microbatch", "stage", "peer_stage") and value == 0):
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
            stage=data.get("stage"),
            peer_stage=data.get("peer_stage"),
        )


@dataclass(frozen=True)
class MeshStream:
    """The instructions of one mesh (running one pipeline stage, or `stages`), in issue order."""

    mesh: str
    stage: int  # its first stage
    instructions: tuple[Instruction, ...]
    stages: tuple[int, ...] = ()  # every stage it runs, chunk order (default: `stage`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages) or (self.stage,))

    def __str__(self) -> str:
        held = f"stage {self.stage}" if len(self.stages) == 1 else f"stages {', '.join(map(str, self.stages))}"
        return "\n".join([f"mesh {self.mesh} ({held})"] + [f"  {i}" for i in self.instructions])

    def stage_of(self, inst: Instruction) -> int | None:
        """The stage an instruction of this stream is of (None: an UPDATE of several)."""
        if inst.stage is not None:
            return inst.stage
        return self.stage if len(self.stages) == 1 else None

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
                    {
                        "mesh": s.mesh,
                        "stage": s.stage,
                        **({"stages": list(s.stages)} if len(s.stages) > 1 else {}),
                        "instructions": [i.to_dict() for i in s.instructions],
                    }
                    for s in self.streams
                ],
            },
            indent=indent,
        )

    @classmethod
    def from_json(cls, text: str) -> PipelineStreams:
        data = json.loads(text)
        streams = tuple(
            MeshStream(
                m["mesh"],
                int(m["stage"]),
                tuple(Instruction.from_dict(i) for i in m["instructions"]),
                tuple(m.get("stages", ())),
            )
            for m in data["meshes"]
        )
        return cls(data["schedule"], int(data["num_microbatches"]), bool(data["split_backward"]), streams)


def build_streams(topology: PipelineTopology, schedule: str | Schedule, num_microbatches: int) -> PipelineStreams:
    """Each mesh's instruction stream for `schedule` over `num_microbatches` on `topology`
    (several stages per mesh where its meshes repeat, placed as the schedule places them)."""
    schedule = get_schedule(schedule)
    names, chunks = topology.mesh_names, topology.chunks
    if chunks == 1:
        orders = [[(k, task) for task in order] for k, order in enumerate(schedule.tasks(len(names), num_microbatches))]
    else:
        placed = schedule.placed(len(names), chunks)
        wrong = [k for k, mesh in enumerate(topology.meshes) if mesh != names[placed[k]]]
        if wrong:
            k = wrong[0]
            raise ValueError(
                f"{schedule.name} places stage {k} on mesh {names[placed[k]]}, the topology on {topology.meshes[k]}"
            )
        orders = []
        for j, mesh in enumerate(names):
            stages = topology.stages_on(mesh)
            tasks = schedule.mesh_tasks(len(names), chunks, j, num_microbatches)
            orders.append([(stages[task.chunk], task) for task in tasks])
    builders = [_MeshBuilder(topology, mesh, schedule.split_backward) for mesh in names]
    for builder, order in zip(builders, orders):
        for stage, task in order:
            builder.add_task(stage, task.kind, task.microbatch)
        builder.add_update()
    ids = {key: f"{b.mesh}:{pos}" for b in builders for pos, (key, _, _) in enumerate(b.items)}
    streams = []
    for b in builders:
        insts = tuple(
            Instruction(id=ids[key], deps=tuple(ids[d] for d in deps), **fields) for key, fields, deps in b.items
        )
        streams.append(MeshStream(b.mesh, b.stages[0], insts, b.stages))
    return PipelineStreams(schedule.name, num_microbatches, schedule.split_backward, tuple(streams))


class _MeshBuilder:
    """One mesh's instructions with symbolic keys; `build_streams` turns keys into ids. On a
    mesh of several stages, buffers are named after their stages (`s4:stash.0`,
    `s4:act.0->s5`: two stages of one mesh may feed two of another), and an edge
    between two of its stages is a hand-over: the reader's RUN waits for the maker's, and the
    maker's buffer (`s3:act.0->s4`) lives until the reader's last task of the microbatch."""

    def __init__(self, topology: PipelineTopology, mesh: str, split: bool):
        self.topology, self.mesh, self.split = topology, mesh, split
        self.stages = topology.stages_on(mesh)
        self.several = len(self.stages) > 1
        self.items: list[tuple[tuple, dict, list[tuple]]] = []  # (key, fields, dep keys)

    def _emit(self, key: tuple, deps: list[tuple], stage: int, peer_stage: int | None = None, **fields) -> tuple:
        if self.several and fields["op"] != UPDATE:
            fields["stage"] = stage
            if peer_stage is not None:
                fields["peer_stage"] = peer_stage
        self.items.append((key, fields, deps))
        return key

    def _mesh(self, stage: int) -> str:
        return self.topology.meshes[stage]

    def _local(self, stage: int) -> bool:
        return self._mesh(stage) == self.mesh

    def _name(self, stage: int, buffer: str) -> str:
        return f"s{stage}:{buffer}" if self.several else buffer

    def add_task(self, k: int, kind: str, m: int) -> None:
        ins, outs = self.topology.inputs(k), self.topology.outputs(k)
        stash = self._name(k, f"stash.{m}")
        if kind == FORWARD:
            waits = [
                ("run", e.src, FORWARD, m) if self._local(e.src) else self._recv(ACT, m, e.src, k, e.nbytes)
                for e in ins
            ]
            allocs = [(stash, self.topology.activation_bytes[k])]
            allocs += [(self._sent(ACT, m, k, e.dst), e.nbytes) for e in outs]
            run = self._emit(
                ("run", k, FORWARD, m), waits, k, op=RUN, kind=FORWARD, microbatch=m, allocates=tuple(allocs)
            )
            for e in outs:
                if not self._local(e.dst):
                    self._send(ACT, m, k, e.dst, e.nbytes, run)
        elif kind == BACKWARD:
            waits = [
                ("run", e.dst, BACKWARD, m) if self._local(e.dst) else self._recv(GRAD, m, e.dst, k, e.backward_bytes)
                for e in outs
            ]
            allocs = tuple((self._sent(GRAD, m, k, e.src), e.backward_bytes) for e in ins)
            if self.split:
                allocs += ((self._name(k, f"carry.{m}"), self.topology.carry_bytes[k]),)
            run = self._emit(
                ("run", k, BACKWARD, m),
                [("run", k, FORWARD, m)] + waits,
                k,
                op=RUN,
                kind=BACKWARD,
                microbatch=m,
                allocates=allocs,
            )
            for e in ins:
                if not self._local(e.src):
                    self._send(GRAD, m, k, e.src, e.backward_bytes, run)
            if not self.split:
                self._finish(k, m, run)
        elif kind == WEIGHT:
            run = self._emit(("run", k, WEIGHT, m), [("run", k, BACKWARD, m)], k, op=RUN, kind=WEIGHT, microbatch=m)
            self._finish(k, m, run)
        else:
            raise ValueError(f"unknown task kind {kind!r}")

    def _peer(self, stage: int) -> str:
        """How a buffer names the other end: its mesh, or with virtual stages the stage."""
        return f"s{stage}" if self.topology.chunks > 1 else self._mesh(stage)

    def _sent(self, what: str, m: int, src: int, dst: int) -> str:
        """The buffer stage `src` makes for `dst`: sent, or handed over on this mesh."""
        return self._name(src, f"{what}.{m}->{self._peer(dst)}")

    def _received(self, what: str, m: int, src: int, dst: int) -> str:
        return self._name(dst, f"{what}.{m}<-{self._peer(src)}")

    # Transfer keys name (sending stage, receiving stage), gradients going backwards.
    def _recv(self, what: str, m: int, src: int, dst: int, nbytes: int) -> tuple:
        buffer = self._received(what, m, src, dst)
        return self._emit(
            ("recv", what, m, src, dst),
            [("send", what, m, src, dst)],
            dst,
            src,
            op=RECV,
            kind=what,
            microbatch=m,
            peer=self._mesh(src),
            nbytes=nbytes,
            allocates=((buffer, nbytes),),
        )

    def _send(self, what: str, m: int, src: int, dst: int, nbytes: int, run: tuple) -> None:
        send = self._emit(
            ("send", what, m, src, dst),
            [run],
            src,
            dst,
            op=SEND,
            kind=what,
            microbatch=m,
            peer=self._mesh(dst),
            nbytes=nbytes,
        )
        self._free(src, self._sent(what, m, src, dst), nbytes, send)

    def _free(self, stage: int, buffer: str, nbytes: int, after: tuple) -> None:
        self._emit(("free", stage, buffer), [after], stage, op=FREE, buffer=buffer, nbytes=nbytes)

    def _finish(self, k: int, m: int, last: tuple) -> None:
        """Accumulate microbatch m's weight gradients and free what only its backward needed
        (and what another stage of this mesh handed over to it)."""
        self._emit(("acc", k, m), [last], k, op=ACCUMULATE, microbatch=m)
        self._free(k, self._name(k, f"stash.{m}"), self.topology.activation_bytes[k], last)
        if self.split:
            self._free(k, self._name(k, f"carry.{m}"), self.topology.carry_bytes[k], last)
        for e in self.topology.inputs(k):
            if self._local(e.src):
                self._free(k, self._sent(ACT, m, e.src, k), e.nbytes, last)
            else:
                self._free(k, self._received(ACT, m, e.src, k), e.nbytes, last)
        for e in self.topology.outputs(k):
            if self._local(e.dst):
                self._free(k, self._sent(GRAD, m, e.dst, k), e.backward_bytes, last)
            else:
                self._free(k, self._received(GRAD, m, e.dst, k), e.backward_bytes, last)

    def add_update(self) -> None:
        accs = [key for key, fields, _ in self.items if fields["op"] == ACCUMULATE]
        self._emit(("update", self.stages[0]), accs, self.stages[0], op=UPDATE)
