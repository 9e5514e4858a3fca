"""One worker per (mesh, host): who owns which device, and a mesh as one multi-process jax.

A mesh inside one host is one worker (a Ray actor) owning all its devices. A mesh spanning
hosts is one worker per host it touches, each owning that host's devices of the mesh; the
workers of the mesh form one multi-controller jax runtime (`jax.distributed`, the mesh's
first worker the coordinator; gloo collectives between CPU processes, NCCL between GPUs).
Each of them compiles the same fragments for the global mesh and runs the same stream, so
XLA's collectives span the hosts, and each holds only its own devices' shards of a value.

Whatever leaves a worker (a transfer's unit ops, a result, a saved state) leaves from the
worker that owns the device holding it: `routes` says which worker sends which unit ops to
which, `Pieces` is a worker's part of a global value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hlopar.analysis.resharding.unit_tasks import box_of, box_slices
from hlopar.dialect.transfers import Box
from hlopar.runtime.local_transfer import gather_shards

__all__ = [
    "Pieces",
    "WorkerLayout",
    "WorkerSlot",
    "coordinator_address",
    "gather_pieces",
    "host_value",
    "join_runtime",
    "local_pieces",
    "mesh_devices",
    "routes",
    "runtime_process",
    "worker_layout",
]


@dataclass(frozen=True)
class WorkerSlot:
    """One worker: the devices of `mesh` on `host` (plan device ids, in the mesh's order), and
    its process number in the mesh's multi-process runtime."""

    name: str
    mesh: str
    host: int
    process: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class WorkerLayout:
    """Every worker of a program, by name (mesh order, then host order)."""

    slots: dict[str, WorkerSlot]

    def of_mesh(self, mesh: str) -> list[WorkerSlot]:
        return [s for s in self.slots.values() if s.mesh == mesh]

    def spans(self, mesh: str) -> bool:
        return len(self.of_mesh(mesh)) > 1

    def owner(self, mesh: str, device: int) -> str:
        for slot in self.of_mesh(mesh):
            if device in slot.devices:
                return slot.name
        raise KeyError(f"device {device} is not in mesh {mesh}")


def worker_layout(devices: Mapping[str, Sequence[int]], devices_per_host: int | None = None) -> WorkerLayout:
    """One worker per (mesh, host) of `devices` (mesh -> plan device ids; None: one host);
    a mesh inside one host keeps its name as the worker's, the workers of a spanning one are
    `mesh@host`."""
    slots = {}
    for mesh, ids in devices.items():
        host_of = {d: d // devices_per_host if devices_per_host else 0 for d in ids}
        hosts = sorted(set(host_of.values()))
        for process, host in enumerate(hosts):
            name = mesh if len(hosts) == 1 else f"{mesh}@{host}"
            owned = tuple(d for d in ids if host_of[d] == host)
            slots[name] = WorkerSlot(name, mesh, host, process, owned)
    return WorkerLayout(slots)


def routes(plan, layout: WorkerLayout, src_mesh: str, dst_mesh: str) -> dict[tuple[str, str], tuple[int, ...] | None]:
    """(sending worker, receiving worker) -> the unit ops of `plan` it carries, in plan
    order: each op from the owner of its sender to the owner of each receiver. None: all of
    them (or the whole array of an unplanned transfer), between two one-worker meshes."""
    if plan is None:
        if layout.spans(src_mesh) or layout.spans(dst_mesh):
            raise ValueError(
                f"an unplanned transfer {src_mesh} -> {dst_mesh} between meshes spanning hosts "
                "(hlopar-cross-mesh-resharding plans every inter-mesh transfer)"
            )
        return {(src_mesh, dst_mesh): None}
    out: dict[tuple[str, str], list[int]] = {}
    for k, op in enumerate(plan.ops):
        sender = layout.owner(src_mesh, op.sender)
        for receiver in dict.fromkeys(layout.owner(dst_mesh, r) for r in op.receivers):
            out.setdefault((sender, receiver), []).append(k)
    if len(out) == 1 and len(next(iter(out.values()))) == len(plan.ops):
        return {key: None for key in out}
    return {key: tuple(ops) for key, ops in out.items()}


# --------------------------------------------------------------------------- the multi-process runtime


def coordinator_address() -> str:
    """host:port for the coordinator of a mesh's jax runtime (this node, a free port)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def join_runtime(coordinator: str, process: int, processes: int, device_kind: str, timeout: float) -> None:
    """Makes this process `process` of `processes` of one jax runtime (a mesh's, or with the
    collective transport the plan's; before jax starts a backend). CPU collectives between
    processes need gloo (XLA's default has none)."""
    import jax

    if device_kind == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=processes, process_id=process, initialization_timeout=max(1, int(timeout))
    )


def runtime_process(layout: WorkerLayout, name: str, one_runtime: bool) -> int:
    """A worker's process number: in the plan's one runtime (the collective transport), its
    place among all workers; else in its mesh's (0 for a mesh inside one host)."""
    return list(layout.slots).index(name) if one_runtime else layout.slots[name].process


def mesh_devices(layout: WorkerLayout, mesh: str, one_runtime: bool = False) -> dict[int, object]:
    """Plan device id -> jax device, for every device of the mesh: a worker's devices are
    its process's local devices, matched to its plan ids in increasing order of both
    (`one_runtime`: the processes are the plan's, `runtime_process`)."""
    import jax

    by_process: dict[int, list] = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(device.process_index, []).append(device)
    out = {}
    for slot in layout.of_mesh(mesh):
        process = (
            runtime_process(layout, slot.name, one_runtime)
            if one_runtime or layout.spans(mesh)
            else jax.process_index()
        )
        local = by_process.get(process, [])
        if len(local) < len(slot.devices):
            raise RuntimeError(f"worker {slot.name} needs {len(slot.devices)} devices, its process has {len(local)}")
        for d, device in zip(sorted(slot.devices), local):
            out[d] = device
    return out


# --------------------------------------------------------------------------- parts of a global value


@dataclass(frozen=True)
class Pieces:
    """The boxes of a global value that one worker holds, with their data."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    arrays: tuple[np.ndarray, ...]

    @classmethod
    def whole(cls, array) -> Pieces:
        array = np.asarray(array)
        return cls(array.shape, (tuple((0, n) for n in array.shape),), (array,))


def local_pieces(value, replicas: bool = True) -> Pieces:
    """This process's shards of `value` (a host array: all of it); without `replicas`,
    only the first copy of each box (so the pieces of all processes tile the value once)."""
    if not hasattr(value, "addressable_shards"):
        return Pieces.whole(value)
    shape = tuple(value.shape)
    shards = [s for s in value.addressable_shards if replicas or s.replica_id == 0]
    return Pieces(
        shape,
        tuple(box_of([slice(*i.indices(n)[:2]) for i, n in zip(s.index, shape)]) for s in shards),
        tuple(np.asarray(s.data) for s in shards),
    )


def host_value(value):
    """What a worker returns of a value: all of it when its process holds all of it, else
    its `Pieces` (the driver puts the mesh's workers' pieces together, `gather_pieces`)."""
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    return local_pieces(value, replicas=False)


def gather_pieces(parts: Sequence[Pieces]) -> np.ndarray:
    """The global value from the pieces of every worker of its mesh (checked complete)."""
    dtype = next((a.dtype for p in parts for a in p.arrays), np.float32)
    boxes = [(box_slices(box), data) for part in parts for box, data in zip(part.boxes, part.arrays)]
    return gather_shards(parts[0].shape, dtype, dict(enumerate(boxes)), RuntimeError)
