"""Cross-mesh transfers as collectives among the workers' processes (`transport="collective"`).

The object-store transport (`transports.ObjectStoreTransport`) hands each unit op's box to
Ray; this one runs it as a collective of the processes that own the op's sending device
and its receiving devices, as the cross-mesh resharding paper's system does with NCCL
(§3, §5). One code path for both device kinds: jax's collectives, NCCL between GPUs
(jax's CUDA plugin), gloo between CPU processes, so every line but the backend runs here.

The runtime. jax allows one distributed runtime per process, so every worker of a plan
joins ONE (`mesh_processes.join_runtime`, process k = the k-th worker of the layout, the
first worker the coordinator), set up when the workers start and rebuilt with them after
a failure. A mesh's fragments still run on its own devices only; on CPUs XLA then carries
a mesh's own collectives over gloo too (slower than in one process: the object store stays
the CPU default, `transports.transport_for`).

One collective per unit op, of the group [sending device, receiving devices] (a 1-D jax
mesh over them): a `ppermute` where there is one receiver, else an all-reduce of the box
against zeros (the sender's bytes reach every receiver). The box travels as its bytes
(uint8), so any element type moves bit for bit and a receiver needs no type to take part;
it reads the transfer's element type (`ProgramTransfer.element`) to view them. What the
unit op's kind becomes: a ring all-reduce is a reduce-scatter and then an all-gather, so a
`scatter_allgather` op moves what it plans (2(n-1)/n of the box per device of n); jax has no
broadcast collective, so a `broadcast` op (a chain, one box per link, pipelined in
`chunks`) runs as the same all-reduce, up to twice its bytes per link; `send_recv` to one
receiver is a `ppermute`, exactly; chunking is left to the library (NCCL's and gloo's rings
pipeline their own chunks).
Each group's program is compiled once per plan, on first use, and reused every step.

The order. A collective blocks until all of its processes call it, so the workers must
call theirs in one order that no stream can deadlock on. `collective_order` runs the
streams once with sends that never block (as the object store's do) and takes the SENDs
in the order they ran; every worker runs the collectives it takes part in in that order,
in a thread of its own (`CollectiveChannel`): a SEND only hands the boxes to it, a RECV
waits for what it received (in the worker's mailbox, as the object store delivers). Why
this cannot deadlock: take the first collective c not done. Its receivers' threads have
done every earlier one of theirs and wait at c. Its sender's stream reaches the SEND of c:
every RECV before it in that stream ran, in the reference run, before the SEND of c, so
its collective comes earlier in the order and is done.

Values moved once (a sum over microbatches that another mesh's update reads, an update's
result read on another mesh: not carried by a SEND/RECV pair) go the same way, after the
streamed ones: `moved_once_order` runs the update phase once (each mesh's update fragments
in program order, then its results, each waiting for what it reads) and takes the moves in
the order they are first read; the sender's thread waits for the value to be made (as a
pull of the object store does) and the reader's read waits in the mailbox. The streams
never read such a value (only updates and results do), so this order comes after theirs.
An argument's copy is the driver's to send, as with the object store. The boxes are cut
and assembled in host memory, as the object store's are (`transports.pack`, `unpack`): on
GPUs that is a copy to and from the host per box around the NCCL collective (never run
here: no GPU).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hlopar.analysis.schedules.instructions import SEND, MeshStream
from hlopar.codegen.pipeline_program import UPDATE, PipelineProgram, ProgramTransfer
from hlopar.codegen.spmd import numpy_dtype
from hlopar.runtime.interpreter import argument_origin
from hlopar.runtime.mesh_processes import WorkerLayout
from hlopar.runtime.transports import Payload, TransportError

__all__ = [
    "CollectiveChannel",
    "GroupOp",
    "as_bytes",
    "collective_order",
    "from_bytes",
    "moved_once",
    "moved_once_order",
    "worker_collectives",
]


def collective_order(streams: Sequence[MeshStream]) -> list[tuple[str, int | None]]:
    """(transfer, microbatch) of every SEND of a step's streams, in the order a run whose
    sends never block issues them (module docstring): mesh by mesh in turn, each stream as
    far as its instructions' dependencies allow."""
    done: set[str] = set()
    cursors = [0] * len(streams)
    order: list[tuple[str, int | None]] = []
    while any(c < len(s.instructions) for c, s in zip(cursors, streams)):
        progressed = False
        for k, stream in enumerate(streams):
            instructions = stream.instructions
            while cursors[k] < len(instructions) and all(d in done for d in instructions[cursors[k]].deps):
                inst = instructions[cursors[k]]
                if inst.op == SEND:
                    order.extend((name, inst.microbatch) for name in inst.transfers)
                done.add(inst.id)
                cursors[k] += 1
                progressed = True
        if not progressed:
            stuck = {s.mesh: str(s.instructions[c]) for c, s in zip(cursors, streams) if c < len(s.instructions)}
            raise RuntimeError(f"the instruction streams deadlock at {stuck}")
    return order


def moved_once(program: PipelineProgram, t: ProgramTransfer) -> bool:
    """Whether an update or a result reads `t`'s result moved once, through the transport (a
    sum, or a value no SEND/RECV carries), rather than received per microbatch or sent by
    the driver (an argument's copy) or handed over between two stages of one mesh. The
    interpreter's read rule for `once` reads."""
    if t.src_mesh == t.dst_mesh or argument_origin(program, t.source) is not None:
        return False
    return program.values[t.source].accumulated or not t.streamed


def moved_once_order(program: PipelineProgram) -> list[tuple[str, None]]:
    """(transfer, None) of every value moved once per step, in the order a run of the update
    phase first reads them (module docstring): mesh by mesh in turn, each mesh's update
    fragments in program order and then its results, as far as what they read is made."""
    values, transfers = program.values, program.transfers
    ran: set[int] = set()  # update fragments run
    moved: set[int] = set()  # transfers moved
    order: list[tuple[str, None]] = []

    def made(v: int) -> bool:
        value = values[v]
        if value.transfer is not None:
            t = transfers[value.transfer]
            if not moved_once(program, t):  # received, sent by the driver, or handed over here
                return t.src_mesh != t.dst_mesh or made(t.source)
            if t.index not in moved:
                if not made(t.source):
                    return False
                moved.add(t.index)
                order.append((t.name, None))
            return True
        if value.producer is None:
            return True
        fragment = program.fragments[value.producer]
        return fragment.role != UPDATE or value.producer in ran

    queues = {
        mesh: [("fragment", k) for k, f in enumerate(program.fragments) if f.role == UPDATE and f.mesh == mesh]
        + [("result", v) for v in program.results if values[v].mesh == mesh]
        for mesh in program.meshes
    }
    while any(queues.values()):
        progressed = False
        for queue_ in queues.values():
            while queue_:
                kind, item = queue_[0]
                reads = program.fragments[item].operands if kind == "fragment" else (item,)
                if not all(made(v) for v in reads):
                    break
                if kind == "fragment":
                    ran.add(item)
                queue_.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the update fragments wait for each other's values: no order for their moves")
    return order


@dataclass(frozen=True)
class GroupOp:
    """One collective of a step: unit op `op` of a transfer (None: the whole value of an
    unplanned one) for one microbatch, from `sender` to `receivers` ((mesh, device id) each)."""

    transfer: str
    microbatch: int | None
    op: int | None
    sender: tuple[str, int]
    receivers: tuple[tuple[str, int], ...]
    nbytes: int
    box: tuple[int, ...]  # the box's shape (the whole value's for op None)
    element: str  # MLIR element type of the transfer


def worker_collectives(
    program: PipelineProgram, order: Sequence[tuple[str, int | None]], layout: WorkerLayout, worker: str
) -> list[GroupOp]:
    """The collectives of a step `worker` takes part in (it owns the sender or a receiver),
    in `order`'s order, each transfer's unit ops in plan order."""
    transfers = {t.name: t for t in program.transfers}
    slot = layout.slots[worker]
    out = []
    for name, microbatch in order:
        t = transfers[name]
        if t.plan is None:
            src, dst = program.devices[t.src_mesh][0], program.devices[t.dst_mesh][0]
            ops = [(None, src, (dst,), t.nbytes, t.shape)]
        else:
            ops = [
                (k, op.sender, tuple(dict.fromkeys(op.receivers)), op.nbytes, tuple(hi - lo for lo, hi in op.box))
                for k, op in enumerate(t.plan.ops)
            ]
        for k, sender, receivers, nbytes, box in ops:
            group = [(t.src_mesh, sender)] + [(t.dst_mesh, r) for r in receivers]
            if any(mesh == slot.mesh and device in slot.devices for mesh, device in group):
                out.append(GroupOp(name, microbatch, k, group[0], tuple(group[1:]), nbytes, box, t.element))
    return out


class CollectiveChannel:
    """A worker's side of the collective transport: the thread that runs, step after step,
    the collectives it takes part in (`ops`, in the plan's order), taking the boxes its
    SENDs post (`post`), or for a value moved once (microbatch None) what `made` cuts from it
    once it exists, and putting what it receives in the worker's mailbox under the keys the
    object store delivers with ((step, transfer, microbatch, sending worker))."""

    def __init__(
        self,
        ops: Sequence[GroupOp],
        devices: Mapping[tuple[str, int], object],
        layout: WorkerLayout,
        worker: str,
        mailbox,
        timeout: float,
        made: Callable[[int, str], Mapping[int | None, np.ndarray]] | None = None,
    ):
        self.ops = list(ops)
        self.devices = devices  # (mesh, plan id) -> jax device, every mesh of the plan
        self.layout, self.worker, self.mailbox, self.timeout = layout, worker, mailbox, timeout
        self.slot = layout.slots[worker]
        self.made = made  # (step, transfer) -> its boxes this worker sends, once the value is made
        self.outbox: dict = {}
        self.posted = threading.Condition()
        self.steps: queue.Queue = queue.Queue()
        self.programs: dict = {}  # group -> its compiled collective
        self.failure: str | None = None
        self.seconds = 0.0  # in collectives, waits for their boxes included
        self.done = 0  # collectives run
        self._thread = threading.Thread(target=self._serve, name=f"hlopar-collectives-{worker}", daemon=True)
        self._thread.start()

    def mine(self, mesh: str, device: int) -> bool:
        return mesh == self.slot.mesh and device in self.slot.devices

    def begin(self, step: int) -> None:
        """The worker starts `step`: its collectives run once their boxes are posted."""
        if self.failure:
            raise TransportError(f"{self.worker}: the collective transport failed: {self.failure}")
        self.steps.put(step)

    def post(self, step: int, transfer: str, microbatch: int | None, boxes: Mapping[int | None, np.ndarray]) -> None:
        """A SEND's boxes (unit op -> its data; None: the whole value), for the thread to send."""
        with self.posted:
            self.outbox[(step, transfer, microbatch)] = dict(boxes)
            self.posted.notify_all()

    def _boxes(self, step: int, transfer: str, microbatch: int | None) -> dict:
        deadline = time.monotonic() + self.timeout
        with self.posted:
            while (step, transfer, microbatch) not in self.outbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{transfer} (microbatch {microbatch}) was not sent in {self.timeout:g} s")
                self.posted.wait(left)
            return self.outbox[(step, transfer, microbatch)]

    def _serve(self) -> None:
        while True:
            step = self.steps.get()
            try:
                self._run_step(step)
            except Exception as error:  # noqa: BLE001 - the receiving streams time out and say so
                self.failure = f"{type(error).__name__}: {error}"
                return

    def _run_step(self, step: int) -> None:
        received: dict[tuple, dict] = {}  # (transfer, microbatch, sending worker) -> op -> box
        once: dict[str, Mapping] = {}  # transfer moved once -> the boxes this worker sends
        expected: dict[tuple, int] = {}
        for g in self.ops:
            if not self.mine(*g.sender):
                owner = self.layout.owner(*g.sender)
                key = (g.transfer, g.microbatch, owner)
                expected[key] = expected.get(key, 0) + 1
        for g in self.ops:
            clock = time.perf_counter()
            data = None
            if self.mine(*g.sender):
                if g.microbatch is not None:  # a SEND posts them
                    boxes = self._boxes(step, g.transfer, g.microbatch)
                else:  # moved once: taken when made
                    if g.transfer not in once:
                        once[g.transfer] = self.made(step, g.transfer)
                    boxes = once[g.transfer]
                data = as_bytes(boxes[g.op])
            got = self._collective(g, data)
            self.seconds += time.perf_counter() - clock
            self.done += 1
            if got is None:
                continue
            owner = self.layout.owner(*g.sender)
            key = (g.transfer, g.microbatch, owner)
            received.setdefault(key, {})[g.op] = got
            if len(received[key]) == expected[key]:
                self.mailbox.put((step, *key), self._payload(g, received.pop(key)))
        with self.posted:
            for key in [k for k in self.outbox if k[0] <= step]:
                del self.outbox[key]

    def _payload(self, g: GroupOp, boxes: Mapping[int | None, np.ndarray]) -> Payload:
        """What the object store would have delivered: the boxes of one sending worker's ops."""
        if None in boxes:
            return Payload(array=from_bytes(boxes[None], g.element, g.box))
        ops = tuple(sorted(boxes))
        shapes = {o.op: o.box for o in self.ops if (o.transfer, o.microbatch) == (g.transfer, g.microbatch)}
        return Payload(boxes=tuple(from_bytes(boxes[k], g.element, shapes[k]) for k in ops), ops=ops)

    def _collective(self, g: GroupOp, data: np.ndarray | None) -> np.ndarray | None:
        """Runs `g`'s collective with this process's devices of its group (`data`: the box's
        bytes where this process sends it); the bytes received, or None (the sender)."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        group = (g.sender, *g.receivers)
        nbytes = math.prod(g.box) * _itemsize(g.element)
        fn, mesh = self._program(group, nbytes)
        rows = []
        for place in group:
            if self.mine(*place):
                row = data if place == g.sender else np.zeros(nbytes, np.uint8)
                rows.append(jax.device_put(row.reshape(1, nbytes), self.devices[place]))
        array = jax.make_array_from_single_device_arrays((len(group), nbytes), NamedSharding(mesh, P("g")), rows)
        out = fn(array)
        if self.mine(*g.sender):
            jax.block_until_ready(out)
            return None
        shard = next(s for s in out.addressable_shards if s.device == self.devices[self._first_mine(g.receivers)])
        return np.asarray(shard.data).reshape(-1)

    def _first_mine(self, receivers: Sequence[tuple[str, int]]) -> tuple[str, int]:
        return next(r for r in receivers if self.mine(*r))

    def _program(self, group: tuple[tuple[str, int], ...], nbytes: int):
        """The group's collective, compiled on first use (the same in every process of it)."""
        key = (group, nbytes)
        found = self.programs.get(key)
        if found is None:
            import jax
            from jax.sharding import Mesh
            from jax.sharding import PartitionSpec as P

            mesh = Mesh(np.array([self.devices[place] for place in group]), ("g",))
            if len(group) == 2:

                def body(x):
                    return jax.lax.ppermute(x, "g", [(0, 1)])
            else:

                def body(x):
                    return jax.lax.psum(x, "g")

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("g"), out_specs=P("g")))
            found = self.programs[key] = (fn, mesh)
        return found


def _itemsize(element: str) -> int:
    return numpy_dtype(element).itemsize


def as_bytes(box) -> np.ndarray:
    """A box's bytes, flat (what a collective carries, whatever the element type)."""
    return np.ascontiguousarray(np.asarray(box)).reshape(-1).view(np.uint8)


def from_bytes(data: np.ndarray, element: str, shape: Sequence[int]) -> np.ndarray:
    """The box `as_bytes` made, from its bytes, its element type (MLIR's) and its shape."""
    return np.ascontiguousarray(data).view(numpy_dtype(element)).reshape(tuple(shape))
