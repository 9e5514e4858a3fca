"""Moving values between mesh workers: the unit ops of a planned transfer, and the CPU transport.

## What crosses processes

A value that leaves a mesh is a transfer of the program (`codegen.pipeline_program`): a
plain `mpmd.transfer` (the whole array moves), or a `hlopar.cross_mesh_transfer` planned by
`hlopar-cross-mesh-resharding` as unit ops (`codegen.transfers.PlannedTransfer`). For a
planned one, the sending worker cuts exactly the unit ops' boxes out of the source layout
(`pack`: each box read from the shard of the op's sending device, checked to hold it), and
the receiving worker fills each receiving device's shard from the boxes it was sent
(`unpack`: a box only lands on a device of the destination layout that needs it, and at
the end every element of every destination shard must have arrived; replicas must agree),
as `runtime.local_transfer` does in one process. Only the unit ops' bytes travel.

Every unit-op kind ends with each of its receivers holding the op's whole box
(`broadcast`: down a chain, `send_recv`: one by one, `scatter_allgather`: parts then a ring).
Between processes the box is sent ONCE per op and receiving worker, whatever the number of
receivers on it: the worker reads the one copy and places it on each of them. A mesh that
spans hosts has one worker per host (`mesh_processes`): an op leaves from the worker owning
its sending device (`pack` from that worker's `Pieces`) and goes to each worker owning one
of its receivers (`mesh_processes.routes`), which fills only its own devices' shards
(`unpack_shards`). Chunking (`UnitOp.chunks`) pipelines a chain of device links; it has
nothing to pipeline here and is not reproduced.

## The object-store transport: Ray's object store, through actor method calls

`ObjectStoreTransport` sends a payload (numpy arrays) as the argument of a method call on
the receiving actor (`deliver`, streamed SEND/RECV pairs), or returns it from one
(`fetch`, values moved once and pulled by the reader). Ray serializes numpy arrays
zero-copy into its shared-memory object store (arrays over 100 KiB; smaller ones travel
inline in the call), and the receiver maps them without a copy; across nodes Ray's object
manager moves each object once per node. Why this and not the alternatives:

- it is already there: the runtime is built on Ray, whose object store is a real
  inter-process, inter-node transport with flow control and failure reporting (a call on a
  dead actor fails, `ray.get` takes a timeout), which the fault handling relies on;
- jax's transfer server (`jax.experimental.transfer`) is experimental and its API moves
  between jaxlib releases.

It costs a serialization and a copy into shared memory per box; `tools/bench_runtime.py`
measures it against an in-process copy of the same bytes.

## The collective transport

`transport="collective"` (`collective_transport`): every worker of the plan joins one jax
runtime and each unit op of a streamed transfer runs as a collective of the processes that
own its devices: NCCL between GPUs, gloo between CPU processes. `transport_kind` chooses:
the collective transport on GPUs (where the object store stages every box through host
memory), the object store on CPUs (one machine's shared memory; in one jax runtime a mesh's
own collectives would also go through gloo).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hlopar.analysis.resharding.unit_tasks import box_contains, box_slices
from hlopar.codegen.transfers import PlannedTransfer
from hlopar.runtime.local_transfer import gather_shards
from hlopar.runtime.mesh_processes import Pieces

__all__ = [
    "Mailbox",
    "ObjectStoreTransport",
    "Payload",
    "TransportError",
    "pack",
    "TRANSPORTS",
    "transport_kind",
    "unpack",
    "unpack_shards",
]


class TransportError(RuntimeError):
    """A transfer that cannot be carried out, or that does not arrive in time."""


@dataclass(frozen=True)
class Payload:
    """What one transfer sends: the whole array (`boxes` None: an `mpmd.transfer`), or one box
    per unit op, in the plan's order."""

    array: np.ndarray | None = None
    boxes: tuple[np.ndarray, ...] | None = None
    ops: tuple[int, ...] | None = None  # the plan's unit ops the boxes are (None: all, in order)

    @property
    def nbytes(self) -> int:
        if self.array is not None:
            return int(self.array.nbytes)
        return int(sum(b.nbytes for b in self.boxes or ()))


def pack(plan: PlannedTransfer | None, array, ops: Sequence[int] | None = None) -> Payload:
    """The sender's side: the boxes of `plan`'s unit ops (`ops`: only those; None: all) cut
    from the global value `array`, or from `Pieces` of it that this worker holds (each box
    read where the source layout puts it on the op's sending device), or the whole array for
    an unplanned transfer."""
    if plan is None:
        if isinstance(array, Pieces):
            raise TransportError("an unplanned transfer needs the whole array on one worker")
        return Payload(array=np.ascontiguousarray(np.asarray(array)))
    pieces = array if isinstance(array, Pieces) else Pieces.whole(np.asarray(array).reshape(plan.shape))
    held = plan.src.device_boxes(plan.shape)
    boxes = []
    for k in range(len(plan.ops)) if ops is None else ops:
        op = plan.ops[k]
        piece = None
        if op.sender in held and box_contains(held[op.sender], op.box):
            piece = next((i for i, b in enumerate(pieces.boxes) if box_contains(b, op.box)), None)
        if piece is None:
            raise TransportError(f"unit op of task {op.task}: device {op.sender} does not hold box {list(op.box)}")
        boxes.append(np.ascontiguousarray(pieces.arrays[piece][box_slices(op.box, pieces.boxes[piece])]))
    return Payload(boxes=tuple(boxes), ops=None if ops is None else tuple(ops))


def unpack_shards(
    plan: PlannedTransfer, payloads: Sequence[Payload], devices: Collection[int] | None = None
) -> dict[int, np.ndarray]:
    """The receiver's side: each destination device of `devices` (None: all) gets its shard
    filled from the boxes its ops give it (the payloads of every sender), checked complete."""
    needs = plan.dst.device_boxes(plan.shape)
    mine = set(needs) if devices is None else set(devices)
    received: dict[int, np.ndarray] = {}
    for payload in payloads:
        if payload.boxes is None or (payload.ops is None and len(payload.boxes) != len(plan.ops)):
            raise TransportError(
                f"expected {len(plan.ops)} unit-op boxes, got "
                f"{'a whole array' if payload.boxes is None else len(payload.boxes)}"
            )
        received.update(zip(range(len(plan.ops)) if payload.ops is None else payload.ops, payload.boxes))
    dtype = next(iter(received.values())).dtype if received else np.float32
    shards = {d: np.zeros([hi - lo for lo, hi in needs[d]], dtype) for d in mine}
    seen = {d: np.zeros(shards[d].shape, bool) for d in mine}
    for k, data in received.items():
        op = plan.ops[k]
        for receiver in op.receivers:
            if receiver not in needs:
                raise TransportError(f"unit op of task {op.task}: device {receiver} is not in the destination mesh")
            if receiver not in mine:
                continue
            if not box_contains(needs[receiver], op.box):
                raise TransportError(f"unit op of task {op.task}: device {receiver} does not need box {list(op.box)}")
            where = box_slices(op.box, needs[receiver])
            shards[receiver][where] = data.reshape(shards[receiver][where].shape)
            seen[receiver][where] = True
    for device, mask in seen.items():
        if not mask.all():
            raise TransportError(
                f"device {device} is missing {int(mask.size - mask.sum())} of its {mask.size} "
                "elements after the transfer"
            )
    return shards


def unpack(plan: PlannedTransfer | None, payload: Payload | Sequence[Payload]) -> np.ndarray:
    """The receiver's side on one worker holding the whole destination: every shard filled
    (`unpack_shards`); returns the global value put together from them (replicas must agree)."""
    payloads = [payload] if isinstance(payload, Payload) else list(payload)
    if plan is None:
        if len(payloads) != 1 or payloads[0].array is None:
            raise TransportError("a whole-array transfer received unit-op boxes")
        return payloads[0].array
    needs = plan.dst.device_boxes(plan.shape)
    shards = unpack_shards(plan, payloads)
    dtype = next(iter(shards.values())).dtype
    return gather_shards(
        plan.shape, dtype, {d: (box_slices(box), shards[d]) for d, box in needs.items()}, TransportError
    )


class Mailbox:
    """Payloads delivered to a worker, by key, until its stream takes them (thread-safe)."""

    def __init__(self):
        self._items: dict = {}
        self._ready = threading.Condition()

    def put(self, key, value) -> None:
        with self._ready:
            self._items[key] = value
            self._ready.notify_all()

    def take(self, key, timeout: float, what: str = ""):
        """The payload under `key`, waiting for it up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while key not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{what or key}: nothing arrived in {timeout:g} s (is the sender alive?)")
                self._ready.wait(left)
            return self._items.pop(key)

    def drop_before(self, step: int) -> None:
        """Forgets payloads of steps before `step` (keys start with the step number)."""
        with self._ready:
            for key in [k for k in self._items if k[0] < step]:
                del self._items[key]


class ObjectStoreTransport:
    """The CPU transport (module docstring): payloads as arguments or results of actor
    method calls, carried by Ray's object store."""

    name = "ray-object-store"

    def send(self, peer, step: int, items: Mapping[tuple[str, int], Payload]):
        """Hands `items` ((transfer, microbatch) -> payload) to the peer worker's mailbox;
        returns at once (the call's reference, for whoever wants to wait on it)."""
        return peer.deliver.remote(step, dict(items))

    def pull(
        self, peer, step: int, transfer: str, microbatch: int, once: bool, timeout: float, to: str | None = None
    ) -> Payload:
        """Asks the peer worker for a transfer's payload (what it sends worker `to`) and waits
        for it."""
        import ray

        try:
            return ray.get(peer.fetch.remote(step, transfer, microbatch, once, to), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TransportError(
                f"{transfer} (microbatch {microbatch}): the sender did not answer in {timeout:g} s"
            ) from None


TRANSPORTS = ("auto", "object-store", "collective")


def transport_kind(device_kind: str, choice: str = "auto") -> str:
    """The transport the workers of a plan on `device_kind` devices use (module docstring):
    `choice`, or for "auto" the collective one on GPUs and the object store on CPUs."""
    if device_kind not in ("cpu", "gpu"):
        raise ValueError(f"unknown device kind {device_kind!r} (cpu or gpu)")
    if choice not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "collective" if device_kind == "gpu" else "object-store"
