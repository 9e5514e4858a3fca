"""The MPMD runtime on Ray: the driver (`RayRuntime`), which starts one mesh worker (a Ray
actor, `ray_worker.MeshWorker`) per (mesh, host) where `ray_placement` places them, and
feeds them steps; each worker runs a whole training step of its mesh without round trips to
the driver. The results stay on the workers, read one at a time when the caller reads them
(`remote_array.RemoteArray`).

Faults. Every wait is bounded: the driver waits for a step with `ray.wait` and a deadline
and notices a dead worker (`RayActorError`) as soon as Ray does, a worker waits for a
delivery or a pull at most `timeout` seconds. On any failure the driver kills every worker
and raises `WorkerError`; `start` again builds fresh workers (the caller's next call does).
The driver's waits look every second at whether the local cluster died under the process
(`local_ray.lost`: its raylet or GCS), and then raise `WorkerError` saying so.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.runtime.collective_transport import collective_order, moved_once_order
from hlopar.runtime.host_devices import host_device_environment
from hlopar.runtime.mesh_processes import Pieces, gather_pieces
from hlopar.runtime.ray_placement import Placement, resources, unplaceable
from hlopar.runtime.ray_worker import MeshWorker, worker_programs
from hlopar.runtime.remote_array import RemoteArray, is_key, jax_value
from hlopar.runtime.step_arguments import check_batch, step_arguments
from hlopar.runtime.step_stats import StepStats
from hlopar.runtime.transports import transport_kind

if TYPE_CHECKING:
    from hlopar.codegen.executable_cache import ExecutableCache

__all__ = ["RayRuntime", "WorkerError"]


class WorkerError(RuntimeError):
    """A step that failed on a worker (it died, raised, or took too long); the workers are
    stopped and the next `start` makes new ones."""


class RayRuntime:
    """The driver: starts one `MeshWorker` per (mesh, host), feeds steps; the results stay
    on the workers, read one at a time (`fetch_start`, `fetch_finish`) and dropped there once
    released (`release`, sent with the next step). A `protocol.Runtime`; `connect`: reaches
    the Ray cluster (before a start)."""

    holds_workers = True
    restart_message = "restarting the workers"

    def __init__(
        self,
        program: PipelineProgram,
        schedule: str,
        placement: Placement,
        *,
        timeout: float = 300.0,
        worker_timeout: float = 120.0,
        log=None,
        phase=None,
        returned: Collection[int] = (),
        copied: Collection[int] = (),
        connect: Callable[[], None] | None = None,
        executables: ExecutableCache | None = None,
        transport: str = "auto",
    ):
        self.program = program
        # "object-store" or "collective" (`transports.transport_kind`: by device kind for "auto")
        self.transport = transport_kind(placement.device_kind, transport)
        self.executables = executables  # what planning compiled (`executable_cache`): shipped to the workers
        self._connect = connect or (lambda: None)
        self.returned = tuple(returned)  # results that come back with each step (typed keys)
        self.copied = tuple(copied)  # results kept on the workers whose copy comes back too (scalars)
        self.schedule = schedule
        self.placement = placement
        self.layout = placement.workers
        self.timeout = timeout
        self.worker_timeout = worker_timeout
        self.streams = program.streams(schedule)
        self.programs = worker_programs(program, self.streams, self.layout)
        if self.transport == "collective":
            order = tuple(collective_order(self.streams.streams) + moved_once_order(program))
            self.programs = {m: replace(wp, collectives=order) for m, wp in self.programs.items()}
        self.actors: dict = {}
        self.group = None
        self.connection = 0  # `local_ray.connection()` when the workers started
        self.step_id = 0
        self.generation = 0  # increases with each start: results kept by older workers are gone
        self.log = log or (lambda message: None)
        self.phase = phase or (lambda name: None)  # "starting workers", "compiling" (a progress display)
        self.setup_info: dict[str, dict] = {}
        self.start_seconds: dict[str, float] = {}  # the last start's parts (`ParallelizedFunction.first_call`)
        self.last_stats: StepStats | None = None
        self.released: deque[tuple[int, int, int]] = deque()  # (generation, step, result): to drop
        self.fetched_bytes = 0  # result bytes that reached the driver (read, or returned with a step), in all

    @property
    def alive(self) -> bool:
        """Workers started, not stopped, and their cluster still the one this process is
        connected to (`local_ray`: a local cluster that died is replaced at the next call)."""
        from hlopar.runtime import local_ray

        return bool(self.actors) and self.connection == local_ray.connection() and local_ray.lost() is None

    def connect(self) -> None:
        self._connect()

    def result_mesh(self, r: int) -> str:
        return self.program.values[self.program.results[r]].mesh

    def _who(self, name: str) -> str:
        slot = self.layout.slots[name]
        return f"mesh {slot.mesh}" + (f" (host {slot.host})" if self.layout.spans(slot.mesh) else "")

    # -- life cycle

    def start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hlopar.runtime import local_ray

        self.shutdown()
        self.generation += 1
        self.connection = local_ray.connection()
        self.phase("starting workers")
        kind = self.placement.device_kind
        slots = self.layout.slots
        self._place()
        bundle_of_host = {h: k for k, h in enumerate(self.placement.hosts)}
        clock = time.perf_counter()
        # A lone worker serves no peer during a step: a plain actor runs its calls one at a
        # time on the process's main thread, where the step runs as fast as in a driver (the
        # GPT of tools/bench_runtime.py, its one executable, 5 x 6 interleaved steps each at
        # load 8-16: main thread 0.99-1.01x the driver, an actor's pool thread 1.07-1.20x;
        # docs/runtime.md). Several workers stay threaded to serve `deliver` and `fetch`.
        threaded = len(slots) > 1
        for name, slot in slots.items():
            need = self.placement.worker_resources(name)
            options = {
                "num_cpus": need["CPU"],
                "max_concurrency": 16 if threaded else 1,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=bundle_of_host[slot.host]
                ),
            }
            # CPU devices' buffers are the host's malloc: in a threaded actor's thread (not the
            # main thread, as in a driver or a lone worker) glibc gives the step a per-thread arena, whose large
            # blocks are mapped afresh each step (the GPT of tools/bench_runtime.py, one
            # executable of 8 CPU devices: 45 k minor page faults a step against 21 k in the
            # driver, 0.457 s against 0.347); one arena: 10.6 k, 0.386 s (load 12-14).
            # Ray sets OMP_NUM_THREADS to a worker's whole CPUs (1 for a fraction), and XLA:CPU's
            # matrix products then run on one thread (GPT h256 L4, "shard" on 1x8, 2 cores:
            # 0.42 s/step in a worker, 0.27 s in the driver): the host's cores, unless set.
            threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)}
            if kind == "gpu":
                options["num_gpus"] = need["GPU"]
                options["runtime_env"] = {"env_vars": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **threads}}
            else:
                arena = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX") or "1"} if threaded else {}
                options["runtime_env"] = {
                    "env_vars": {
                        **host_device_environment(len(slot.devices), environ={}),
                        "JAX_PLATFORMS": "cpu",
                        **threads,
                        **arena,
                    }
                }
            self.actors[name] = (
                ray.remote(MeshWorker).options(**options).remote(slot.mesh, kind, self.worker_timeout, name)
            )
        self._gather({n: a.set_peers.remote(self.actors) for n, a in self.actors.items()}, "start")
        if self.transport == "collective":  # one jax runtime for the plan, its first worker the coordinator
            first = next(iter(slots))
            address = self._gather({first: self.actors[first].coordinator.remote()}, "start")[first]
            coordinators = dict.fromkeys(self.program.meshes, address)
        else:  # one per mesh spanning hosts
            firsts = {self.layout.of_mesh(m)[0].name: m for m in self.program.meshes if self.layout.spans(m)}
            coordinators = {
                firsts[n]: address
                for n, address in self._gather(
                    {n: self.actors[n].coordinator.remote() for n in firsts}, "start"
                ).items()
            }
        self.phase("compiling")
        started = time.perf_counter()
        programs = self._shipped()
        self.setup_info = self._gather(
            {
                n: a.setup.remote(programs[slots[n].mesh], coordinators.get(slots[n].mesh))
                for n, a in self.actors.items()
            },
            "compile",
        )
        done = time.perf_counter()
        self.start_seconds = {"worker processes": started - clock, "workers' executables": done - started}
        self.log(
            f"started {len(self.actors)} workers in {done - clock:.1f} s: "
            + ", ".join(
                f"{n} ({len(slots[n].devices)} {kind} devices, {i['executables']} executables, "
                f"{_how(i['compilations'])} in {i['compile_s']:.1f} s)"
                for n, i in self.setup_info.items()
            )
        )
        for n, i in self.setup_info.items():
            for name, why in i.get("refused", {}).items():
                self.log(f"{n} could not load {name} and compiled it: {why}")

    def _shipped(self) -> dict:
        """Per mesh, its `WorkerProgram` with the executables planning compiled for it, as
        bytes its workers load (`executable_cache`): for this process's devices of the
        workers' kind, where it has the mesh's (a worker of another host compiles anyway)."""
        if self.executables is None:
            return self.programs
        import jax

        try:
            local = jax.devices(self.placement.device_kind)
        except RuntimeError:
            return self.programs
        out = {}
        for mesh, wp in self.programs.items():
            ids = self.program.devices[mesh]
            if max(ids) >= len(local):
                out[mesh] = wp
                continue
            texts = [wp.whole] if wp.whole else list(wp.texts.values())
            out[mesh] = replace(wp, executables=self.executables.shipment(texts, [local[d] for d in ids]))
        return out

    def _place(self) -> None:
        """The workers' placement group, ready: refused at once if the cluster's nodes could
        never hold it, else waited for up to `timeout` (other workers may free resources)."""
        import ray
        from ray.util.placement_group import placement_group

        bundles, strategy = self.placement.bundles(), self.placement.strategy
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        why = unplaceable(bundles, strategy, nodes)
        asked = sorted({r for b in bundles for r in b})
        if why is not None:
            raise WorkerError(
                f"Ray can never place the workers: {why}. Asked: {self.placement.describe()}; the "
                f"cluster has {len(nodes)} node(s): " + ", ".join(resources(n, asked) for n in nodes)
            )
        self.group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise WorkerError(
                f"Ray could not place the workers in {self.timeout:g} s: asked {self.placement.describe()}; the "
                f"cluster has {resources(ray.cluster_resources(), asked)}, of which "
                f"{resources(ray.available_resources(), asked)} is free (other workers hold the rest: close() the "
                "parallelized functions no longer needed)"
            ) from None

    def shutdown(self) -> None:
        """Kills the workers (if any) and frees their placement group."""
        import ray

        if not ray.is_initialized():  # disconnected: the workers went with the connection
            self.actors, self.group = {}, None
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = {}
        if self.group is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
            except Exception:
                pass
            self.group = None

    def worker_pids(self) -> dict[str, int]:
        return {n: i["pid"] for n, i in self.setup_info.items()}

    # -- running

    def run(
        self, arguments: Sequence, resident: Mapping[int, tuple[int, int]] | None = None
    ) -> tuple[int, dict[int, np.ndarray]]:
        """One step on the whole batch; returns its number, by which its results are read
        (the workers keep them), and the values of the `returned` and `copied` ones. `arguments`: @main's
        arguments (host arrays; anything for a resident one); `resident`: argument number ->
        (step, result position) of a result the workers still keep (not sent: its mesh's
        workers use their copy, the workers of another mesh that read it ask them for it)."""
        import ray

        if not self.alive:
            raise WorkerError("the workers are not running (start them first)")
        program = self.program
        resident = dict(resident or {})
        arguments = step_arguments(
            [None if i in resident else a for i, a in enumerate(arguments)],
            len(program.argument_shapes),
            program.index_arg,
            program.microbatches,
        )
        check_batch(program, arguments, skip=resident)
        self.step_id += 1
        step = self.step_id
        slots = self.layout.slots
        readers: dict[int, int] = {}
        for slot in slots.values():
            for i in self.programs[slot.mesh].arguments:
                readers[i] = readers.get(i, 0) + 1
        release = self._released()
        shared: dict[int, object] = {}
        calls, sent_by_worker, kept_by_worker, pulled_by_worker = {}, {}, {}, {}
        clock, started = time.perf_counter(), time.time()
        for name, slot in slots.items():
            sent, kept, pulled = {}, {}, {}
            for i in self.programs[slot.mesh].arguments:
                if i in resident:
                    s, r = resident[i]
                    mesh = self.result_mesh(r)
                    if mesh == slot.mesh:
                        kept[i] = (s, r)
                    else:
                        pulled[i] = (s, r, tuple(w.name for w in self.layout.of_mesh(mesh)))
                elif readers[i] > 1:
                    if i not in shared:
                        shared[i] = ray.put(np.asarray(arguments[i]))
                    sent[i] = shared[i]
                else:
                    sent[i] = np.asarray(arguments[i])
            calls[name] = self.actors[name].run_step.remote(
                step, sent, kept, pulled, release.get(slot.mesh, ()), self.returned, self.copied
            )
            sent_by_worker[name], kept_by_worker[name], pulled_by_worker[name] = tuple(sent), tuple(kept), tuple(pulled)
        outputs = self._gather(calls, f"step {step}")
        self.last_stats = StepStats(
            time.perf_counter() - clock,
            {n: o["timing"] for n, o in outputs.items()},
            sent_by_worker,
            kept_by_worker,
            {n: s.mesh for n, s in slots.items()},
            {n: o["spans"] for n, o in outputs.items()},
            started,
            pulled=pulled_by_worker,
        )
        return step, self._assembled(outputs)

    def outputs(self, output: tuple[int, dict[int, np.ndarray]], leaves: Sequence, parts: Sequence[tuple[int, ...]]):
        """`fn`'s result leaves of a step (`run`'s or `load`'s output): kept on the workers
        (`RemoteArray`s); typed keys, which came back with the step, as jax's own key arrays
        (the only keys `jax.random` takes); scalars, which came back too, hold their value."""
        step, returned = output
        out: list = []
        for k, (leaf, name) in enumerate(leaves):
            if is_key(leaf.dtype):
                words = [returned[r] for r in parts[k]]
                out.append(jax_value(words[0] if len(words) == 1 else np.concatenate(words), leaf.dtype))
            else:
                host = returned[parts[k][0]] if len(parts[k]) == 1 and parts[k][0] in returned else None
                out.append(
                    RemoteArray(
                        self,
                        self.generation,
                        step,
                        k,
                        parts[k],
                        leaf.shape,
                        leaf.dtype,
                        f"{name} (call {step})",
                        host=host,
                    )
                )
        return out

    # -- the results, kept on the workers

    def holds(self, generation: int) -> bool:
        """Whether the workers that kept results of `generation` still run."""
        return self.alive and generation == self.generation

    def release(self, generation: int, step: int, r: int) -> None:
        """Result `r` of `step` is no longer referenced (or donated): its workers drop it at
        the start of the next step. Called from finalizers, in any thread."""
        if generation == self.generation:
            self.released.append((generation, step, r))

    def set_aside(self) -> None:
        """Another signature's runtime runs the calls for now: the results the caller no
        longer references are dropped on the workers at once, not at this runtime's next step
        (which may never come)."""
        released = self._released()
        if released and self.alive:
            self._gather(
                {
                    w.name: self.actors[w.name].drop.remote(keys)
                    for mesh, keys in released.items()
                    for w in self.layout.of_mesh(mesh)
                },
                "dropping released results",
            )

    def _released(self) -> dict[str, list[tuple[int, int]]]:
        """Per mesh, the kept results to drop (taken from `released`)."""
        out: dict[str, list[tuple[int, int]]] = {}
        while self.released:
            generation, step, r = self.released.popleft()
            if generation == self.generation:
                out.setdefault(self.result_mesh(r), []).append((step, r))
        return out

    def fetch_start(self, generation: int, step: int, results: Sequence[int]) -> tuple:
        """Asks the workers that keep them for results of `step` (not waited for)."""
        if not self.holds(generation):
            hint = getattr(self, "resume_hint", None)
            raise RuntimeError(
                "its workers were stopped (after a failure, or closed), and what they held with "
                "them; a value read before is kept, the state can be restored from a save"
                + (f" ({hint})" if hint else "")
            )
        return tuple(
            {w.name: self.actors[w.name].result.remote(step, r) for w in self.layout.of_mesh(self.result_mesh(r))}
            for r in results
        )

    def fetch_finish(self, pending: tuple, what: str) -> list[np.ndarray]:
        """The results `fetch_start` asked for, as host arrays."""
        out = []
        for calls in pending:
            parts = list(self._gather(calls, f"reading {what}").values())
            if any(p is None for p in parts):
                raise RuntimeError(f"{what} is no longer kept by the workers")
            out.append(_whole(parts))
            self.fetched_bytes += out[-1].nbytes
        return out

    def _assembled(self, outputs: Mapping[str, Mapping]) -> dict[int, np.ndarray]:
        """The `returned` and `copied` results from what each worker returned (counted in
        `fetched_bytes`)."""
        parts: dict[int, list] = {}
        for output in outputs.values():
            for r, value in output["results"].items():
                parts.setdefault(r, []).append(value)
        whole = {r: _whole(values) for r, values in parts.items()}
        self.fetched_bytes += sum(np.asarray(value).nbytes for value in whole.values())
        return whole

    def _gather(self, calls: Mapping[str, object], what: str) -> dict[str, object]:
        """Waits for one call per worker, up to `timeout`; on a dead worker, an error or the
        deadline, stops every worker and raises `WorkerError`."""
        import ray

        deadline = time.monotonic() + self.timeout
        name_of = {ref: name for name, ref in calls.items()}
        pending = list(calls.values())
        done = {}
        while pending:
            try:  # a second at a time: a local cluster that died is noticed within it (`local_ray.lost`)
                ready, pending = ray.wait(
                    pending, num_returns=1, timeout=min(1.0, max(0.0, deadline - time.monotonic()))
                )
            except Exception:
                self._cluster_lost(what)
                raise
            if not ready:
                self._cluster_lost(what)
                if time.monotonic() < deadline:
                    continue
                late = sorted(self._who(name_of[r]) for r in pending)
                self.shutdown()
                raise WorkerError(
                    f"{what}: the workers of {', '.join(late)} did not answer within "
                    f"{self.timeout:g} s; the workers were stopped (the next call restarts them)"
                )
            for ref in ready:
                name = name_of[ref]
                try:
                    done[name] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    self._cluster_lost(what)
                    self.shutdown()
                    raise WorkerError(
                        f"{what}: the worker of {self._who(name)} died "
                        f"({type(error).__name__}); the workers were stopped, the next call "
                        "restarts them"
                    ) from error
                except ray.exceptions.RayTaskError as error:
                    self.shutdown()
                    cause = error.cause if getattr(error, "cause", None) is not None else error
                    raise WorkerError(
                        f"{what}: the worker of {self._who(name)} failed: {type(cause).__name__}: "
                        f"{cause}; the workers were stopped, the next call restarts them"
                    ) from error
        return done

    def _cluster_lost(self, what: str) -> None:
        """Raises `WorkerError` if the local cluster died under this process (`local_ray.lost`)."""
        from hlopar.runtime import local_ray

        why = local_ray.lost()
        if why is not None:
            self.actors, self.group = {}, None
            raise WorkerError(
                f"{what}: {why}; the workers and what they held are lost, the next call starts a "
                "new cluster and new workers"
            )

    # -- saving

    def save(self, directory: str | Path, record: Mapping) -> dict:
        """Each worker writes its part into `directory` (a save's staging directory,
        `checkpoint.save`); returns what the manifest says of them. A worker that could not
        write its part raises `CheckpointError`, the workers still running."""
        answers = self._gather({n: a.save.remote(str(directory), dict(record)) for n, a in self.actors.items()}, "save")
        return self._saved(answers)

    def save_start(self, directory: str | Path, record: Mapping):
        """`save` in the background (`parallelize(checkpoint_every=...)`): each worker starts
        writing the last step's results in a thread of its own and the call returns; the
        function returned waits for them (polling, so that a lone worker, whose calls run one
        at a time, is never held up) and returns what `save` returns."""
        import ray

        generation = self.generation
        self._gather({n: a.save_start.remote(str(directory), dict(record)) for n, a in self.actors.items()}, "save")
        actors = dict(self.actors)

        def finish(poll_s: float = 0.25) -> dict:
            from hlopar.runtime.checkpoint import CheckpointError

            answers: dict[str, dict] = {}
            deadline = time.monotonic() + self.timeout
            while len(answers) < len(actors):
                if self.generation != generation or not self.alive:
                    raise CheckpointError("the workers stopped before their parts were written", workers_lost=True)
                if time.monotonic() > deadline:
                    raise CheckpointError(f"the workers did not write their parts within {self.timeout:g} s")
                for n, a in actors.items():
                    if n not in answers:
                        try:
                            answer = ray.get(a.save_poll.remote(record["save"]), timeout=self.timeout)
                        except ray.exceptions.RayError as error:
                            raise CheckpointError(
                                f"the worker of {self._who(n)} did not answer ({type(error).__name__})",
                                workers_lost=True,
                            ) from None
                        if answer is not None:
                            answers[n] = answer
                if len(answers) < len(actors):
                    time.sleep(poll_s)
            return self._saved(answers)

        return finish

    def _saved(self, answers: Mapping[str, dict]) -> dict:
        from hlopar.runtime.checkpoint import CheckpointError

        failed = [
            f"the worker of {self._who(n)} could not write its part: {a['error']}"
            for n, a in answers.items()
            if "error" in a
        ]
        if failed:
            raise CheckpointError("; ".join(failed))
        return {
            "results": {r: self.result_mesh(r) for r in range(len(self.program.results))},
            "workers": self.worker_meshes(),
            "parts": {n: a["part"] for n, a in answers.items()},
        }

    def worker_meshes(self) -> dict[str, str]:
        """Each worker's mesh, by worker name (the parts of a save)."""
        return {n: s.mesh for n, s in self.layout.slots.items()}

    def load(self, directory: str | Path, keys: Sequence[str] = ()) -> tuple[int, dict[int, np.ndarray]]:
        """Each worker reads back its part (checked by the caller, `checkpoint.read_manifest`)
        as the results of a new step; returns as `run`. If a worker cannot, the others undo
        theirs and `CheckpointError` says why: the state is as it was."""
        from hlopar.runtime.checkpoint import CheckpointError

        step = self.step_id + 1
        loaded = self._gather(
            {
                n: a.load.remote(str(directory), step, self.returned, self.copied, tuple(keys))
                for n, a in self.actors.items()
            },
            "restore",
        )
        failed = [
            f"the worker of {self._who(n)} could not read its part: {a['error']}"
            for n, a in loaded.items()
            if "error" in a
        ]
        if failed:
            self._gather(
                {n: self.actors[n].unload.remote(step) for n, a in loaded.items() if "error" not in a}, "restore"
            )
            raise CheckpointError(
                f"cannot restore from {directory}: "
                + "; ".join(failed)
                + "; nothing was restored (the live state is as it was)"
            )
        self.step_id = step
        return step, self._assembled({n: {"results": a["results"]} for n, a in loaded.items()})


def _how(compilations: Sequence) -> str:
    """A worker's executables: how many it loaded (shipped) and compiled."""
    hows = [how for _, how, _ in compilations]
    return ", ".join(f"{hows.count(h)} {h}" for h in ("loaded", "compiled") if h in hows) or "none"


def _whole(parts: Sequence) -> np.ndarray:
    """A result from its workers' answers: the whole value, or a spanning mesh's pieces put
    together."""
    return gather_pieces(parts) if isinstance(parts[0], Pieces) else parts[0]
