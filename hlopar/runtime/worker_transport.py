"""The executor core's transport on a Ray worker (`interpreter.Transport`), for one step.

A fragment runs on the worker's devices and is waited for, to time it (`timing`). A SEND
packs the unit ops of the transfers it names and hands them to the peer workers at once
(`transports.ObjectStoreTransport`), or to the worker's collective channel, which runs them
as collectives in the plan's order (`collective_transport`); a RECV waits for them in the
worker's mailbox and places them as the reading fragment lays them out. A value moved once
is pulled by its reader from the workers of its maker (`MeshWorker.fetch`), or with the
collective channel waited for in the mailbox, except a copy of an argument, which the driver
sent here too. A value read before it is made is waited for only by a peer's pull (`fetch`
runs in another thread of the worker, while the stream runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hlopar.analysis.schedules.instructions import Instruction
from hlopar.codegen.executables import DeviceExecutable
from hlopar.codegen.pipeline_program import ProgramFragment, ProgramTransfer
from hlopar.runtime.collective_transport import moved_once
from hlopar.runtime.interpreter import StepInterpreter, argument_origin
from hlopar.runtime.transports import TransportError, pack, unpack, unpack_shards

__all__ = ["WorkerTransport"]


class WorkerTransport:
    """One step of `worker` (a `ray_worker.MeshWorker`): how it runs fragments and moves
    values, and what it measured (`timing`, returned with the step)."""

    def __init__(self, worker, step: int):
        self.w = worker
        self.step = step
        self.timing = {
            "run_s": 0.0,
            "send_s": 0.0,
            "recv_wait_s": 0.0,
            "pull_s": 0.0,
            "sent_bytes": 0,
            "runs": 0,
            "placed": 0,
        }  # placed: inputs copied from the host or moved to another layout

    def executable(self, fragment: ProgramFragment) -> DeviceExecutable:
        return self.w.executables[fragment.name]

    def launch(self, step: StepInterpreter, call: Callable[[], list]) -> list:
        import jax

        clock = time.perf_counter()
        outputs = jax.block_until_ready(call())
        self.timing["run_s"] += time.perf_counter() - clock
        self.timing["runs"] += 1
        return outputs

    def moves_once(self, transfer: ProgramTransfer, summed: bool) -> bool:
        return argument_origin(self.w.program, transfer.source) is not None or summed or not transfer.streamed

    def move(self, step: StepInterpreter, transfer: ProgramTransfer, m: int, once: bool):
        if argument_origin(step.program, transfer.source) is not None:
            # A copy of an argument: the driver sent the argument here too.
            return self.place(transfer.result, step.read(transfer.source, m, once))
        w = self.w
        if transfer.src_mesh == transfer.dst_mesh and not w.spans:
            # A hand-over between two stages this worker runs (its maker ran before, in this
            # stream): the value is here, laid out as its reader reads it.
            return self.place(transfer.result, step.read(transfer.source, m, once))
        clock = time.perf_counter()
        if w.channel is not None and moved_once(step.program, transfer):  # the channel receives it
            payloads = [
                w.mailbox.take((self.step, transfer.name, None, src), w.timeout, f"{transfer.name} (once) <- {src}")
                for src in w.senders(transfer.name)
            ]
            waited = "recv_wait_s"
        else:
            payloads = [
                w.transport.pull(w.peers[src], self.step, transfer.name, m, once, w.timeout, w.name)
                for src in w.senders(transfer.name)
            ]
            waited = "pull_s"  # through the object store
        array = self.received(transfer, payloads)
        self.timing[waited] += time.perf_counter() - clock
        return array

    def send(self, step: StepInterpreter, inst: Instruction) -> None:
        w = self.w
        clock = time.perf_counter()
        items: dict[str, dict] = {}  # receiving worker -> its payloads
        for name in inst.transfers:
            t = step.index.transfers[name]
            source = w.source(step.read(t.source, inst.microbatch))
            if w.channel is not None:  # the collective transport: its thread sends them
                self.timing["sent_bytes"] += self._post(t, inst.microbatch, source)
                continue
            for (src, dst), ops in w.routes[name].items():
                if src == w.name:
                    payload = pack(t.plan, source, ops)
                    items.setdefault(dst, {})[(name, inst.microbatch, src)] = payload
                    self.timing["sent_bytes"] += payload.nbytes
        for dst, payloads in items.items():
            w.transport.send(w.peers[dst], self.step, payloads)
        self.timing["send_s"] += time.perf_counter() - clock

    def _post(self, t: ProgramTransfer, m: int | None, source) -> int:
        """Hands the boxes of `t`'s unit ops this worker sends to its collective channel;
        their bytes."""
        boxes = self.w.own_boxes(t, source)
        self.w.channel.post(self.step, t.name, m, boxes)
        return sum(int(b.nbytes) for b in boxes.values())

    def receive(self, step: StepInterpreter, inst: Instruction) -> None:
        w = self.w
        clock = time.perf_counter()
        for name in inst.transfers:
            t = step.index.transfers[name]
            payloads = [
                w.mailbox.take(
                    (self.step, name, inst.microbatch, src),
                    w.timeout,
                    f"{inst.id} RECV {name} mb={inst.microbatch} <- {src}",
                )
                for src in w.senders(name)
            ]
            step.store[(t.result, inst.microbatch)] = self.received(t, payloads)
        self.timing["recv_wait_s"] += time.perf_counter() - clock
        self.made(step)

    def unmade(self, step: StepInterpreter, v: int, m: int | None, ready: Callable[[], bool], wait: bool) -> None:
        what = f"the sum %{v}" if m is None else f"microbatch {m}'s value %{v}"
        if ready():
            return
        w = self.w
        if not wait:
            raise RuntimeError(f"{w.name}: {what} is read before it is made")
        deadline = time.monotonic() + w.timeout
        with w.changed:
            while not ready():
                if time.monotonic() > deadline:
                    raise TransportError(f"{w.name}: {what} was not made in {w.timeout:g} s")
                w.changed.wait(min(1.0, deadline - time.monotonic()))

    def made(self, step: StepInterpreter) -> None:
        with self.w.changed:
            self.w.changed.notify_all()

    # -- moved values

    def place(self, v: int, array):
        """A moved value, laid out as its first reader on this mesh reads it."""
        import jax

        landing = self.w.landing.get(v)
        return array if landing is None else jax.device_put(array, landing)

    def received(self, t: ProgramTransfer, payloads):
        """A transfer's value from the payloads of its senders to this worker: the whole
        value, or on a spanning mesh this worker's shards of the global one."""
        w = self.w
        if not w.spans:
            return self.place(t.result, unpack(t.plan, payloads))
        import jax

        from hlopar.runtime.local_transfer import assemble

        shards = unpack_shards(t.plan, payloads, w.slot.devices)
        placed = {d: jax.device_put(shard, w.devices[d]) for d, shard in shards.items()}
        return self.place(t.result, assemble(placed, t.plan.shape, t.plan.dst, w.devices))
