"""`hlopar.parallelize`: run a JAX training step pipelined and sharded over a cluster.

    import hlopar
    step = hlopar.parallelize(train_step, cluster=hlopar.Cluster.local(num_hosts=2, devices_per_host=4),
                              num_microbatches=4, schedule="1f1b")
    params, opt_state, loss = step(params, opt_state, batch)   # as train_step(...) would return

The first call (per argument signature: pytree structure, shapes, dtypes):

1. lowers `fn` with jax (`jax.jit(fn, keep_unused=True, donate_argnums=...).lower(...)` on abstract
   arguments, with debug info: source lines and pytree paths name what messages speak of)
   to StableHLO text, one `@main` argument per array leaf (the other leaves static, as
   `eqx.filter_jit` keeps them: `static_leaves`); a step that takes gradients of a loss it
   does not return is lowered returning it too (`step_loss`: found in jax's trace), which
   the call then drops;
2. plans it with the planning pipeline `hlopar-compile` runs too (`passes.planning`, from
   one `passes.plan_options.PlanOptions`; docs/codegen.md): hlopar-import,
   hlopar-split-microbatches, then per `method`
   - `"auto"`: hlopar-cluster-operators, hlopar-stage-construction (stages, submeshes and
     an intra-op plan per stage, all chosen; one stage on every device is one of the
     choices), hlopar-cross-mesh-resharding;
   - `"pipeline"`: the same with `plan_shardings=false`: pure inter-operator parallelism,
     each stage replicated over its submesh (for comparison);
   - `"shard"`: pure intra-operator parallelism, one stage on one mesh of every device
     (num_hosts × devices_per_host), planned by hlopar-auto-sharding;
   then codegen (`codegen.pipeline_program`) and the bundle (`codegen.bundle.write_bundle`,
   whose memory check compiles every executable of the plan, once: `codegen.executable_cache`);
3. starts one Ray worker per (mesh, host) (`runtime.ray_runtime`), which loads its
   fragments as the driver compiled them (shipped serialized; another host's worker, or
   one that cannot load them, compiles them; all compile with `HLOPAR_LOAD_EXECUTABLES=0`); or, where the cluster is this machine
   (`Cluster.local`), no layer stack is cut into pieces and this process's jax sees the
   plan's devices, runs the plan here, as `jax.jit` does (`runtime="auto"`,
   `runtime.in_process`: its one executable, or every mesh's instruction stream; no worker,
   no Ray; results are `jax.Array`s on those devices). `runtime="ray"` always uses workers.

With `verbose`, these phases show on stderr (`progress.Progress`: one line redrawn in place
on a terminal, a line per phase otherwise), and the first call ends with one line saying
where its seconds went (`progress.Breakdown`, also `first_call`); `verbose=False` prints
nothing. With `runtime="ray"`, a local cluster has its Ray head launched
as the first call starts (`local_ray.prestart`), so that it comes up during planning.

Later calls only run. Signatures: a call of another signature (a last partial batch, a batch
in bf16) is lowered and planned while the workers of the current one keep running with what
they hold, so a refusal (`PlanningError`, or jax's own error at lowering) changes nothing.
As `jax.jit` keeps an executable per signature, the function keeps each signature it
compiled (`MAX_SIGNATURES`, the least recently called dropped): one called again is neither
lowered nor planned again, and runs on its runtime as it is if that still runs. Ray workers
of other signatures keep running while they ask for no GPU (CPU devices are threads of the
host's cores, shared) and at most `MAX_WORKER_SETS` sets run in all, so a last partial batch
alternating with the full one every epoch restarts no worker; a start that needs GPUs, or
one past that bound, first stops the other signatures' workers (GPUs: all of them; else the
least recently called). Before workers stop for another signature, every result of theirs
the caller still references is read to the driver: it stays readable, and passed to the new
signature it is sent as a host array (the state moves through the driver, once per change of
signature). A signature set aside drops at each call what the caller no longer references
(on its workers at once, not at its next step; in this process the last results it kept for
`save`, which saves the last call's). Threads: one call at a time; calls (and `compile`,
`close`) from several threads are serialized by a lock, each getting its own results.

The bundle is cached on disk (`codegen.plan_cache`) under `$HLOPAR_CACHE_DIR` (default
`~/.cache/hlopar`), in `plans/<key>/`, the key a hash of the program text, the cluster and the
options: a new process with the same step skips planning (codegen reads `program.mlir`
back) and compilation (the executables are in `executables/`, `codegen.executable_cache`;
not with `HLOPAR_LOAD_EXECUTABLES=0`).

Arguments and results. Results stay on the workers that computed them (on this process's
devices for a plan run here: `jax.Array`s, a pipelined plan's on each mesh's own devices,
which one other jax computation does not take together: `jax.device_get` them first): on
Ray a call returns `fn`'s
output pytree of `runtime.remote_array.RemoteArray`s (shape and dtype known; reading one,
`float(loss)`, `np.asarray`, `jax.device_get`, printing, a jax function, fetches that one
value, once; a scalar, such as the loss, came back with its step's reply). When the next
call passes a result back as an argument (new parameters,
optimizer state), the driver sends nothing for it. `batch_argnums`: the positional arguments holding the batch
(each leaf cut along dim 0 into microbatches); `...` lets the split pass find them (the
arguments that are not training state). `num_microbatches=None`: the planning pipeline's microbatch
policy (`passes.planning`): the largest divisor of the batch size not above
max(4, 2 × num_hosts) ("shard": 1), or 1, with an `HloparWarning` saying why, where the
split pass refuses that many (a number the user gives is refused instead), and 1 where the
plan is one stage either way (microbatches would only add launches).
`donate_argnums`: as in `jax.jit`,
the donated arrays are deleted after the call (a donated result is dropped on the workers at
the next call; reading it raises).

Faults: a step whose worker dies, raises or stalls raises `WorkerError` within `timeout`
seconds (at once when Ray sees the worker die; within a second or two when the local cluster
hlopar started dies, its raylet or GCS: `local_ray` disconnects, and the next call starts a
new cluster); the next call starts fresh workers and sends
the arguments again (results the dead workers held are lost unless read before; `restore`
brings back a save). `save(dir)` / `restore(dir)`: each worker writes / reads back its shards
of the last step's results (the training state); a save is committed by a rename once every
part is written and checked, a restore checks the whole save first (`runtime.checkpoint`);
`save(dir, format="orbax")` writes Orbax items that plain Orbax reads (`runtime.orbax_format`),
and `parallelize(checkpoint_every=N, checkpoint_dir=...)` saves every N calls in the background.

Workers: each asks Ray for its GPUs and a hundredth of a core (`ray_placement.WORKER_CPUS`), so
several parallelized functions live in one process. `close()` (also `with parallelize(...) as
step:`, and garbage collection of the function) stops them and frees their placement group;
a later call starts them again. A cluster that can never hold the workers is refused at once.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hlopar.analysis.cluster import CALIBRATED_PRESET, Cluster
from hlopar.analysis.limits import check_argument, check_count, check_seconds
from hlopar.analysis.schedules import Schedule, get_schedule
from hlopar.analysis.step_io import RolesError
from hlopar.codegen.bundle import write_bundle
from hlopar.codegen.cache_size import touch
from hlopar.codegen.pipeline_program import ProgramError, pipeline_program
from hlopar.codegen.plan_cache import cached_bundle, is_cached, write_cached
from hlopar.ir.diagnostics import DiagnosticError, error_at
from hlopar.ir.host_callbacks import host_callbacks as find_host_callbacks
from hlopar.ir.module import parse_module, print_module
from hlopar.messages import HloparWarning, PlanningError, defined_at, describe_plan, in_api_terms
from hlopar.module_step import ModuleStep, as_step
from hlopar.passes.plan_options import (
    DEFAULT_PLAN_SCHEDULE,
    METHODS,
    RNG_MODES,
    PlanOptions,
    check_choice,
    remat_mode,
    schedule_named,
)
from hlopar.passes.planning import default_microbatches, import_step
from hlopar.passes.planning import plan as plan_module
from hlopar.progress import Breakdown, Progress
from hlopar.runtime.protocol import Runtime
from hlopar.runtime.ray_runtime import WorkerError
from hlopar.runtime.remote_array import RemoteArray, is_key, read_all, with_step
from hlopar.runtime.step_arguments import wrap_keys
from hlopar.runtime.transports import TRANSPORTS
from hlopar.static_leaves import StaticLeaves, StaticResults
from hlopar.step_loss import returning_loss, unreturned_loss
from hlopar.units import parse_bytes

__all__ = [
    "Cluster",
    "HloparWarning",
    "ParallelizedFunction",
    "PlannedStep",
    "PlanningError",
    "parallelize",
    "plan_step",
]

RUNTIMES = ("auto", "ray", "process")


def _connect(cluster: Cluster) -> None:
    """Ray up: the cluster's address, or a local Ray of hlopar's own started here with the
    machine's cores (`runtime.local_ray`: never another cluster on the machine, quiet; a
    worker asks for a hundredth of a core, `ray_runtime.WORKER_CPUS`; a new one where the
    last died under this process)."""
    import ray

    from hlopar.runtime.local_ray import connect, disconnected

    disconnected()  # from a local cluster that died under this process (a new one is started)
    if not ray.is_initialized():
        connect(cluster.address, os.cpu_count() or 1)


def _resolved(cluster: Cluster | None, runtime: str = "auto") -> Cluster:
    """The cluster to plan for, every field set (`Cluster.resolved`; this machine by
    default): a Ray cluster's sizes are read from its nodes, connected first. The preset
    "calibrated" becomes the file of this machine's calibration (made on first use, kept in
    the cache); on Ray workers a mesh spanning hosts crosses processes, so its links are
    timed across processes."""
    cluster = cluster or Cluster.local()
    if not cluster.is_local:
        _connect(cluster)
    cluster = cluster.resolved()
    if cluster.preset == CALIBRATED_PRESET:
        from hlopar.runtime.calibrate import calibrated_preset

        across = runtime == "ray" and cluster.num_hosts > 1
        cluster = replace(cluster, preset=str(calibrated_preset(cluster, across_processes=across)))
    return cluster


# --------------------------------------------------------------------------- planning


@dataclass
class PlannedStep:
    """A planned step: the codegen program and where its bundle is."""

    program: Any  # codegen.pipeline_program.PipelineProgram
    bundle: Path
    plan: dict
    cached: bool
    seconds: float
    schedule: Schedule  # the plan's: the option's, or the one chosen (schedule="auto")
    # The executables planning compiled (or the plan cache's, on disk), which the runtime runs
    # (`codegen.executable_cache.ExecutableCache`); where planning's seconds went (`phases`).
    executables: Any = None
    phases: dict[str, float] = field(default_factory=dict)


def _memory_bytes(value: float | str | None) -> float | None:
    """`memory_per_device`: bytes, or a size such as "80GiB"."""
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as error:
            raise ValueError(f"memory_per_device: invalid value {value!r}: {error}") from None
    return value


def plan_step(
    text: str,
    cluster: Cluster,
    *,
    num_microbatches: int | None = None,
    schedule: str = DEFAULT_PLAN_SCHEDULE,
    method: str = "auto",
    batch_args: Sequence[int] | None = None,
    rng: str = "exact",
    remat: str = "auto",
    stage_loops: bool = False,
    layers: int | None = None,
    memory_per_device: float | str | None = None,
    loss_result: int | None = None,
    cache: bool = True,
    log: Callable[[str], None] = lambda message: None,
    host_callbacks: bool = False,
    callbacks: Sequence = (),
) -> PlannedStep:
    """Plans a training step's StableHLO text for a (resolved) cluster and writes its bundle,
    or reads the cached one: `parallelize`'s planning, its arguments made `PlanOptions`
    (`batch_args` and `loss_result` number the step's leaves). Module docstring.
    `host_callbacks`: the caller runs a plan of one mesh and one microbatch in this process,
    host callbacks included (`pipeline_program`), `callbacks` the lowering's Python functions
    they call (compiled into the executables)."""
    check_choice("method", METHODS, method)
    options = PlanOptions(
        method=method,
        schedule=schedule_named(schedule),
        microbatches=num_microbatches,
        batch_args=tuple(batch_args) if batch_args is not None else None,
        loss_result=loss_result,
        rng=rng,
        remat=remat,
        stage_loops=stage_loops,
        layers=layers,
        memory_per_device=_memory_bytes(memory_per_device),
    )
    return _planned(text, cluster, options, cache=cache, log=log, host_callbacks=host_callbacks, callbacks=callbacks)


def _planned(
    text: str,
    cluster: Cluster,
    options: PlanOptions,
    *,
    cache: bool,
    log: Callable[[str], None],
    host_callbacks: bool,
    callbacks: Sequence = (),
) -> PlannedStep:
    """`plan_step` of options: the planning pipeline (`passes.planning`, with its microbatch
    policy), codegen, and the bundle in the plan cache (`codegen.plan_cache`); the
    executables compiled for the memory check kept for the runtime (`codegen.executable_cache`:
    on disk with the plan cache, so that a plan read from it compiles nothing either)."""
    from hlopar.codegen.executable_cache import ExecutableCache
    from hlopar.codegen.plan_cache import executables_dir

    clock = time.perf_counter()
    executables = ExecutableCache(executables_dir() if cache else None, host_callbacks=callbacks)
    step = import_step(parse_module(text), options)
    chosen = options.microbatches is None  # hlopar's choice, not the user's: it may fall back to 1
    count = default_microbatches(step, cluster) if chosen else options.microbatches
    key = {"microbatches": count, "chosen": chosen, **replace(options, microbatches=count).cache_key()}
    if find_host_callbacks(
        step.module
    ):  # a plan that may hold them, apart: a refusal is made afresh, at the user's line
        key["host_callbacks"] = host_callbacks
    bundle = cached_bundle(text, cluster.key(), key)
    if cache and is_cached(bundle):
        touch(bundle)  # used: the last to go when the cache is pruned
        plan = json.loads((bundle / "plan.json").read_text())
        schedule = get_schedule(plan["stages"].get("schedule") or options.schedule_name)  # chosen where auto
        try:
            program = pipeline_program(
                parse_module((bundle / "program.mlir").read_text()),
                split_backward=schedule.split_backward,
                host_callbacks=host_callbacks,
            )
        except ProgramError as error:
            raise DiagnosticError([error_at(error.location, str(error))]) from None
        log(f"plan read from the cache ({bundle})")
        seconds = time.perf_counter() - clock
        return PlannedStep(program, bundle, plan, True, seconds, schedule, executables, {"plan cache": seconds})

    step = replace(step, options=replace(step.options, microbatches=count))
    before = time.perf_counter() - clock - sum(step.context.seconds.values())  # parsing, the cache's key
    planned = plan_module(step, cluster, chosen=chosen, load=lambda: import_step(parse_module(text), options))
    phases = {"parse": before, **{name.removeprefix("hlopar-"): s for name, s in planned.seconds.items()}}
    codegen = time.perf_counter()
    for note in planned.notes:
        log(note)
    plan = {
        "pass": "hlopar.parallelize",
        "method": options.method,
        **{k: planned.reports[k] for k in ("split", "clustering", "stages", "reroll", "cross_mesh")},
    }
    if not options.stage_loops:  # hlopar-reroll-stage-loops only reported what could loop
        plan["reroll"] = None
    plan["warnings"] = planned.warnings
    plan["layer_pieces"] = planned.pieces.to_json() if planned.pieces else None
    schedule = planned.options.schedule  # the option's, or the one chosen (auto)
    try:
        program = pipeline_program(
            planned.module, split_backward=schedule.split_backward, host_callbacks=host_callbacks
        )
    except ProgramError as error:
        raise DiagnosticError([error_at(error.location, str(error))]) from None
    module_text = print_module(planned.module)
    writing = time.perf_counter()
    phases["codegen"] = writing - codegen
    if cache:
        write_cached(bundle, program, module_text, plan, schedule, key, cluster.key(), executables)
    else:
        bundle = Path(tempfile.mkdtemp(prefix="hlopar-plan-"))
        write_bundle(bundle, program, module_text, plan, schedule, executables=executables)
    compiling = executables.seconds  # wall time: the compilations overlap
    phases["compiling (memory check)"] = compiling
    phases["bundle"] = time.perf_counter() - writing - compiling
    seconds = time.perf_counter() - clock
    log(f"planned in {seconds:.1f} s ({bundle})")
    return PlannedStep(program, bundle, plan, False, seconds, schedule, executables, phases)


# --------------------------------------------------------------------------- the callable


@dataclass
class _Compiled:
    signature: tuple
    out_tree: Any
    planned: PlannedStep
    runtime: Runtime  # in_process.InProcessRuntime, or ray_runtime.RayRuntime
    cluster: Cluster
    outputs: list = field(default_factory=list)  # per result leaf: its shape and dtype, and its name
    pieces: Any = None  # dialect.layers.LayerPieces: stacked layers split per layer, or None
    static_results: StaticResults = field(default_factory=StaticResults)  # result leaves returned as they are
    # The RemoteArrays its calls returned that are still referenced (read before its workers
    # stop for another signature's, `ParallelizedFunction._stop`).
    issued: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    first_call: Breakdown | None = None  # where its first call's seconds went (`ParallelizedFunction.first_call`)
    first_call_done: bool = False


# Signatures a ParallelizedFunction keeps compiled (plans; in-process executables), and how
# many of them keep their Ray workers running at once (module docstring, "Signatures").
MAX_SIGNATURES = 8
MAX_WORKER_SETS = 2


def _close_all(signatures: OrderedDict) -> None:
    """Stops every signature's workers (`close`, and the function's finalizer: it holds
    nothing of the function)."""
    for compiled in list(signatures.values()):
        compiled.runtime.shutdown()


class ParallelizedFunction:
    """What `parallelize` returns: call it like `fn`. Module docstring.

    One call at a time: calls (and `compile`, `close`) from several threads are serialized
    by a lock, as one training loop's steps are ordered anyway."""

    def __init__(
        self,
        fn: Callable,
        *,
        cluster: Cluster | None,
        num_microbatches: int | None,
        schedule: str,
        batch_argnums,
        donate_argnums: Sequence[int],
        method: str,
        rng: str,
        timeout: float,
        cache: bool,
        verbose: bool,
        remat: str | bool = "auto",
        stage_loops: bool = False,
        runtime: str = "auto",
        checkpoint_every: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_format: str = "orbax",
        layers: int | None = None,
        memory_per_device: float | str | None = None,
        loss_result: int | None = None,
        loss: str | Callable | None = None,
        stages: int | None = None,
        idle_hosts: bool = False,
        transport: str = "auto",
    ):
        """Checks every argument where the user called `parallelize` (as `jax.jit` does), then
        keeps them as `PlanOptions`. Long because each argument has its own check and message;
        the checks and the modes' names are plan_options' and limits'."""
        fn = as_step(fn)
        if isinstance(fn, ModuleStep) and donate_argnums not in ((), None):
            raise ValueError(
                f"donate_argnums: {fn.__name__} is a module, whose donations are its own (jax.buffer_donor "
                "or tf.aliasing_output on @main's arguments, as jax.jit wrote them); pass none"
            )
        check_choice("method", METHODS, method)
        schedule = schedule_named(schedule)
        check_choice("rng", RNG_MODES, rng)
        check_choice("runtime", RUNTIMES, runtime)
        check_choice("transport", TRANSPORTS, transport)
        if transport == "collective" and runtime == "process":
            raise ValueError(
                "transport='collective' moves values between worker processes; runtime='process' has none "
                "(use runtime='ray' or 'auto')"
            )
        remat = remat_mode(remat)
        if cluster is not None and not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a hlopar.Cluster or None, got {type(cluster).__name__}")
        if cluster is not None:
            cluster.check_preset()
        if num_microbatches is not None:
            check_argument("num_microbatches", lambda n: check_count(n, low=1), num_microbatches)
        check_argument("timeout", check_seconds, timeout)
        if loss is not None and not (isinstance(loss, str) or callable(loss)):
            raise TypeError(
                f"loss must be a result's path (a str, such as \"[2]['loss']\") or a function of the results "
                f"(such as lambda out: out[2]['loss']), got {type(loss).__name__}"
            )
        if loss is not None and loss_result is not None:
            raise ValueError("loss and loss_result both name the loss: give one of them")
        self.loss = loss
        for name, numbers in (
            ("batch_argnums", () if batch_argnums is ... else batch_argnums),
            ("donate_argnums", donate_argnums),
        ):
            for number in (numbers,) if isinstance(numbers, int) else numbers:
                check_argument(name, lambda n: check_count(-n if isinstance(n, int) and n < 0 else n), number)
        # What to plan; the batch arguments are set per call (`_batch_leaves`: leaves, not positions).
        self.options = PlanOptions(
            method=method,
            schedule=schedule,
            microbatches=num_microbatches,
            loss_result=loss_result,
            rng=rng,
            remat=remat,
            stage_loops=bool(stage_loops),
            layers=layers,
            stages=stages,
            idle_hosts=bool(idle_hosts),
            memory_per_device=_memory_bytes(memory_per_device),
        )
        self.fn = fn
        self.cluster = cluster
        self.batch_argnums = (
            batch_argnums
            if batch_argnums is ...
            else tuple((batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums)
        )
        self.donate_argnums = tuple((donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums)
        # The collective transport is between Ray workers: "auto" then means them.
        self.runtime_kind = "ray" if transport == "collective" else runtime
        self.transport = transport
        self.timeout = timeout
        self.cache = cache
        self.verbose = verbose
        self._progress = Progress(verbose)
        self._breakdown: Breakdown | None = None  # the first call being timed (`_plan`, `_build`)
        self._lock = threading.RLock()  # one call at a time (class docstring)
        self._signatures: OrderedDict[tuple, _Compiled] = OrderedDict()  # least recently called first
        self._compiled: _Compiled | None = None  # the signature of the last call (or `compile`)
        self._last_run: _Compiled | None = None  # the signature whose results the last call (or restore) gave
        # Collecting this function stops its workers (at exit Ray's disconnection ends them anyway).
        self._release = weakref.finalize(self, _close_all, self._signatures)
        self._release.atexit = False
        if (checkpoint_every is None) != (checkpoint_dir is None):
            raise ValueError(
                "checkpoint_every and checkpoint_dir go together: a save every checkpoint_every calls "
                "into checkpoint_dir/<call>"
            )
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of calls, got {checkpoint_every!r}")
        if checkpoint_format not in ("orbax", "npz"):
            raise ValueError(f"checkpoint_format must be 'orbax' or 'npz', got {checkpoint_format!r}")
        self.checkpoint_format = checkpoint_format
        from hlopar.runtime.checkpoint import PeriodicSaves

        self._saves = (
            None
            if checkpoint_every is None
            else PeriodicSaves(
                Path(checkpoint_dir),
                checkpoint_every,
                warn=lambda message: warnings.warn(message, HloparWarning, stacklevel=2),
            )
        )
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "parallelized")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _log(self, message: str) -> None:
        self._progress.message(message)

    # The planning arguments, as `parallelize` took them (`remat` as its mode), from the options.
    num_microbatches = property(lambda self: self.options.microbatches)
    method = property(lambda self: self.options.method)
    rng = property(lambda self: self.options.rng)
    remat = property(lambda self: self.options.remat)
    stage_loops = property(lambda self: self.options.stage_loops)

    # -- building

    @staticmethod
    def _signature(split: StaticLeaves) -> tuple:
        """The pytree, the traced leaves' shapes and dtypes, the static leaves' values
        (`static_leaves`: as eqx.filter_jit keeps them)."""
        return (split.key, tuple((np.shape(x), _dtype(x)) for x in split.leaves()))

    def plan(self, *args) -> tuple[PlannedStep, Any]:
        """Lowers and plans the step for these arguments, starting nothing: the plan and
        JAX's lowering. Raises `PlanningError` in the user's terms; the passes' warnings are
        raised as `HloparWarning`s."""
        return self._plan(_resolved(self.cluster, self.runtime_kind), args)[:2]

    def _plan(self, cluster: Cluster, args: tuple) -> tuple[PlannedStep, Any, StaticResults]:
        from hlopar.ir.host_callbacks import lowered_host_callbacks

        self._progress.phase("lowering")
        self._breakdown = breakdown = Breakdown()
        clock = time.perf_counter()
        split = StaticLeaves.of(args, self.__name__)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), split.dynamic)
        if isinstance(self.fn, ModuleStep):  # already a program: its arguments checked against @main
            lowered, static_results = self.fn.lower(*abstract), StaticResults()
            loss = self._loss_leaf(lowered.out_info)
        else:
            lowered, static_results, loss = self._lowered(split, abstract)
        text = lowered.as_text(debug_info=True)
        breakdown.add("lowering", time.perf_counter() - clock)
        self._log(
            f"lowered {self.__name__} in {time.perf_counter() - clock:.1f} s; planning for "
            f"{cluster.num_hosts} host(s) x {cluster.devices_per_host} {cluster.device_kind} device(s), "
            f"method {self.options.method}, schedule {self.options.schedule_name}"
        )
        self._progress.phase("planning")
        here = self.runtime_kind != "ray" and cluster.is_local
        try:
            batch_args = self._batch_leaves(args)
            planned = _planned(
                text,
                cluster,
                replace(
                    self.options, batch_args=tuple(batch_args) if batch_args is not None else None, loss_result=loss
                ),
                cache=self.cache,
                log=self._log,
                host_callbacks=here,
                callbacks=lowered_host_callbacks(lowered) if here else (),
            )
        except (DiagnosticError, RolesError) as error:
            raise PlanningError(
                f"hlopar cannot parallelize {self.__name__}{defined_at(self.fn)}:\n"
                f"{in_api_terms(str(error), self.__name__)}"
            ) from None
        for message in planned.plan.get("warnings", ()):
            warnings.warn(in_api_terms(message), HloparWarning, stacklevel=3)
        phases = dict(planned.phases)
        compiling = phases.pop("compiling (memory check)", None)
        breakdown.add("planning", sum(phases.values()), phases)
        if compiling is not None:
            breakdown.add("compiling (memory check)", compiling)
        self._log(describe_plan(planned))
        return planned, lowered, static_results

    def _lowered(self, split: StaticLeaves, abstract) -> tuple[Any, StaticResults, int | None]:
        """`fn` lowered by jax for these arguments, its static results, and its loss leaf.
        With debug info (`as_text(debug_info=True)`): each op's location is the user's source
        line, each argument named by its pytree path, so that messages speak of their code."""
        traced, static_results = split.traced(self.fn)
        jitted = jax.jit(traced, keep_unused=True, donate_argnums=self.donate_argnums)
        # Lowered first: the locations then hold no frame of the caller (the plan cache's key).
        lowered = jitted.lower(*abstract)
        loss = self._loss_leaf(lowered.out_info)
        if loss is None:  # a step taking gradients of a loss it does not return? (`step_loss`)
            trace = jitted.trace(*abstract)  # jax's cached trace of the lowering
            dropped = unreturned_loss(trace.jaxpr)
            if dropped is not None:
                loss = len(jax.tree_util.tree_leaves(lowered.out_info))
                out_tree = jax.tree_util.tree_structure(lowered.out_info)
                with_loss = returning_loss(traced, trace.jaxpr, dropped, out_tree)
                lowered = jax.jit(with_loss, keep_unused=True, donate_argnums=self.donate_argnums).lower(*abstract)
                static_results = replace(static_results, loss_added=True)  # the traced fn's is shared
        return lowered, static_results, loss

    def compile(self, *args) -> _Compiled:
        """Lowers, plans and starts the workers for these arguments (what the first call
        does); returns the compiled state. A signature seen before is taken from the
        function's cache; a new one is planned while the current workers keep running (a
        refusal changes nothing), and they are stopped only as the bounds say (module
        docstring, "Signatures")."""
        return self._compile(args, StaticLeaves.of(args, self.__name__))

    def _compile(self, args: tuple, split: StaticLeaves) -> _Compiled:
        """`compile` of arguments already split into traced and static leaves (a call splits
        them once, for the signature and the runtime)."""
        with self._lock:
            signature = self._signature(split)
            compiled = self._signatures.get(signature)
            if compiled is None:
                compiled = self._build(signature, args)
                self._signatures[signature] = compiled
                while len(self._signatures) > MAX_SIGNATURES:
                    self._stop(self._signatures.popitem(last=False)[1])
            self._signatures.move_to_end(signature)
            self._compiled = compiled
            if not compiled.runtime.alive:
                self._restart()
            return compiled

    def _build(self, signature: tuple, args: tuple) -> _Compiled:
        """Lowers and plans the step for these arguments and makes its runtime, starting
        nothing and stopping nothing."""
        from hlopar.codegen.pipeline_program import host_callback_message
        from hlopar.dialect.layers import LayerPieces
        from hlopar.ir.diagnostics import Diagnostic
        from hlopar.runtime.in_process import InProcessRuntime, in_process_devices
        from hlopar.runtime.ray_placement import placement_of
        from hlopar.runtime.ray_runtime import RayRuntime

        cluster = _resolved(self.cluster, self.runtime_kind)
        self._progress = progress = Progress(self.verbose)
        if cluster.is_local and self.runtime_kind == "ray":
            # Workers for certain: the local Ray comes up while the step is lowered and planned.
            from hlopar.runtime.local_ray import prestart

            prestart(os.cpu_count() or 1)
        try:
            planned, lowered, static_results = self._plan(cluster, args)
            outputs = _output_leaves(lowered, self.__name__)
            pieces = LayerPieces.from_json(planned.plan.get("layer_pieces"))
            devices, why_not = (
                (None, "runtime='ray'")
                if self.runtime_kind == "ray"
                else in_process_devices(
                    planned.program,
                    cluster.device_kind,
                    local=cluster.is_local,
                    pieces=pieces is not None,
                )
            )
            if devices is None and self.runtime_kind == "process":
                raise ValueError(f"{self.__name__} cannot run in this process (runtime='process'): {why_not}")
            if devices is not None:
                runtime = InProcessRuntime(
                    planned.program,
                    devices,
                    planned.schedule.name,
                    devices_per_host=cluster.devices_per_host,
                    log=progress.message,
                    phase=progress.phase,
                    executables=planned.executables,
                )
                self._log(
                    f"running in this process on {len(devices)} {cluster.device_kind} device(s), as jax.jit "
                    "does (no Ray workers)"
                )
            elif planned.program.host_callbacks:  # a Ray worker would crash on it (codegen.pipeline_program)
                where = planned.program.host_callbacks[0]
                refusal = Diagnostic(
                    "error",
                    host_callback_message(
                        where.target, f"the plan runs on Ray workers ({why_not}): other processes, which do not hold it"
                    ),
                    where.location,
                )
                raise PlanningError(
                    f"hlopar cannot parallelize {self.__name__}{defined_at(self.fn)}:\n{in_api_terms(refusal.format())}"
                )
            else:
                placement = placement_of(
                    planned.program, cluster.devices_per_host, local=cluster.is_local, device_kind=cluster.device_kind
                )
                clock = time.perf_counter()
                _connect(cluster)
                self._breakdown.add("connecting to Ray", time.perf_counter() - clock)
                parts = _result_parts(pieces, len(outputs))
                runtime = RayRuntime(
                    planned.program,
                    planned.schedule.name,
                    placement,
                    timeout=self.timeout,
                    worker_timeout=self.timeout,
                    log=progress.message,
                    phase=progress.phase,
                    returned=[r for k, (out, _) in enumerate(outputs) if is_key(out.dtype) for r in parts[k]],
                    copied=[
                        r for k, (out, _) in enumerate(outputs) if with_step(out.shape, out.dtype) for r in parts[k]
                    ],
                    connect=lambda: _connect(cluster),  # again, if the cluster died under this process
                    executables=planned.executables,
                    transport=self.transport,
                )
                self._log(f"starting {len(placement.workers.slots)} Ray worker(s) ({why_not})")
        except BaseException:
            progress.done()
            raise
        return _Compiled(
            signature,
            lowered.out_tree,
            planned,
            runtime,
            cluster,
            outputs,
            pieces=pieces,
            first_call=self._breakdown,
            static_results=static_results,
        )

    def _restart(self) -> None:
        """Starts the current signature's runtime (its workers, or its executable here),
        first stopping the other signatures' workers that must make room for it."""
        compiled = self._compiled
        compiled.runtime.connect()
        self._make_room(compiled)
        if compiled.runtime.step_id:
            self._log(compiled.runtime.restart_message)
        clock = time.perf_counter()
        try:
            compiled.runtime.start()
        finally:
            self._progress.done()
        if compiled.first_call is not None and not compiled.first_call_done:
            compiled.first_call.add("starting the runtime", time.perf_counter() - clock, compiled.runtime.start_seconds)

    def _make_room(self, compiled: _Compiled) -> None:
        """Before `compiled`'s runtime starts: Ray workers of other signatures keep running
        only where they ask for no accelerator (CPU devices are threads of the host's cores,
        which workers share), and at most `MAX_WORKER_SETS` sets in all; GPUs a start needs
        are held by the workers of the others, which go first. What they hold that the caller
        still references is read first (module docstring, "Signatures")."""
        gpus = compiled.cluster.device_kind == "gpu"
        others = [
            c
            for c in reversed(self._signatures.values())  # most recently called first
            if c is not compiled and c.runtime.holds_workers and c.runtime.alive
        ]
        keep = 0 if gpus else MAX_WORKER_SETS - 1
        for old in others[keep:]:
            self._stop(old)

    def _stop(self, compiled: _Compiled) -> None:
        """Stops a signature's runtime, its results the caller still references read first
        (they stay readable, and move to another signature's workers as host arrays)."""
        runtime = compiled.runtime
        if runtime.alive and compiled.issued:
            try:
                read_all([a for a in list(compiled.issued.values()) if a.resident_in(runtime) is not None])
            except RuntimeError:  # a worker died meanwhile: what it held is lost, and says so when read
                pass
        runtime.shutdown()

    def _loss_leaf(self, out_info) -> int | None:
        """The result leaf `loss` (or `loss_result`) names, checked to be a floating scalar;
        None where it is to be found."""
        if self.loss is None:
            return self.options.loss_result
        flat = jax.tree_util.tree_flatten_with_path(out_info)[0]
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        if isinstance(self.loss, str):
            found = paths.index(self.loss) if self.loss in paths else None
            what = repr(self.loss)
        else:
            numbered = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_info), range(len(flat)))
            found = self.loss(numbered)
            what = getattr(self.loss, "__name__", "the function")
        if not isinstance(found, int) or isinstance(found, bool):
            raise PlanningError(
                f"hlopar cannot parallelize {self.__name__}{defined_at(self.fn)}:\nloss={what} names no result "
                f"leaf of {self.__name__}; its results are {', '.join(paths) or 'none'}"
            )
        info = flat[found][1]
        if info.shape != () or not jax.numpy.issubdtype(info.dtype, jax.numpy.floating):
            raise PlanningError(
                f"hlopar cannot parallelize {self.__name__}{defined_at(self.fn)}:\nloss={what} names "
                f"{self.__name__}'s result {paths[found]}, a {info.dtype}{list(info.shape)}: the loss is a "
                "floating-point scalar"
            )
        return found

    def _batch_leaves(self, args: tuple) -> list[int] | None:
        """The traced leaves (`@main`'s arguments) of the `batch_argnums` arguments."""
        if self.batch_argnums is ...:
            return None
        positions = StaticLeaves.of(args, self.__name__).positions()
        return [i for i, position in enumerate(positions) if position in self.batch_argnums]

    # -- running

    def __call__(self, *args):
        with self._lock:
            out = self._call(args)
            self._last_run = self._compiled
            if self._saves is not None:
                self._save_every()
            return out

    def _call(self, args: tuple):
        split = StaticLeaves.of(args, self.__name__)  # the static leaves are in the plan
        compiled = self._compile(args, split)
        for other in self._signatures.values():
            if other is not compiled and other.runtime.alive:
                try:
                    other.runtime.set_aside()  # what the caller dropped is not left on idle workers
                except WorkerError:  # its workers died: stopped, what they held says so when read
                    pass
        runtime = compiled.runtime
        arguments, resident = [], {}  # resident: leaf -> (step, result leaf) the runtime keeps
        for i, leaf in enumerate(split.leaves()):
            if isinstance(leaf, RemoteArray):
                held = leaf.resident_in(runtime)
                if held is not None:
                    arguments.append(_HELD)
                    resident[i] = held
                    continue
                leaf = _read_argument(leaf, f"{self.__name__}'s argument {split.paths()[i]}")
            arguments.append(leaf)  # typed keys go in as their key data (`step_arguments`)
        clock = time.perf_counter()
        output = runtime.run(*_program_arguments(compiled, arguments, resident, split, self.__name__))
        if compiled.first_call is not None and compiled.first_call_done is False:
            self._first_call_done(compiled, time.perf_counter() - clock)
        self._donate(args)
        return self._outputs(compiled, output)

    def _first_call_done(self, compiled: _Compiled, step_seconds: float) -> None:
        """The first call's last phase, its step; where each second went printed (`verbose`)."""
        breakdown = compiled.first_call
        breakdown.add("first step", step_seconds)
        counts = compiled.planned.executables.counts() if compiled.planned.executables is not None else {}
        for info in getattr(compiled.runtime, "setup_info", {}).values():
            for name, how, _ in info.get("compilations", ()):
                row = counts.setdefault(name, {"compiled": 0, "loaded": 0, "reused": 0})
                row[how] += 1
        breakdown.compilations = counts
        compiled.first_call_done = True
        self._log(breakdown.line())

    @staticmethod
    def _outputs(compiled: _Compiled, output) -> Any:
        """`fn`'s output pytree of a step's output (`Runtime.outputs`); the `RemoteArray`s
        among them noted as issued (`_stop`)."""
        leaves = compiled.runtime.outputs(
            output, compiled.outputs, _result_parts(compiled.pieces, len(compiled.outputs))
        )
        for leaf in leaves:
            if isinstance(leaf, RemoteArray):
                compiled.issued[id(leaf)] = leaf
        return compiled.static_results.rebuild(leaves, compiled.out_tree)

    def _donate(self, args: tuple) -> None:
        """As `jax.jit` donates: the donated arguments are deleted (a result kept on the
        workers is dropped there at the next step)."""
        for position in self.donate_argnums:
            for leaf in jax.tree_util.tree_leaves(args[position]):
                if isinstance(leaf, (jax.Array, RemoteArray)) and not leaf.is_deleted():
                    leaf.delete()

    @property
    def first_call(self) -> Breakdown | None:
        """Where the seconds of the first call of the last signature called went
        (`progress.Breakdown`: lowering, planning and its passes, compiling, starting the
        runtime, the first step; the XLA compilations of each executable), or None."""
        return self._compiled.first_call if self._compiled else None

    @property
    def last_stats(self):
        """The last step's timing (`step_stats.StepStats`), or None."""
        return self._compiled.runtime.last_stats if self._compiled else None

    @property
    def planned(self) -> PlannedStep | None:
        return self._compiled.planned if self._compiled else None

    @property
    def runtime(self):
        return self._compiled.runtime if self._compiled else None

    def close(self) -> None:
        """Stops the workers (every signature's) and frees what they held in Ray (their
        placement groups); the next call starts them again (the plans stay). Also at the end
        of a `with` block and when the function is garbage-collected. A `checkpoint_every`
        save being written is waited for first."""
        with self._lock:
            if self._saves is not None:
                self._saves.wait()
            _close_all(self._signatures)

    shutdown = close  # the earlier name

    def __enter__(self) -> ParallelizedFunction:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- saving the training state

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False, format: str = "npz") -> Path:
        """Each worker writes its shards of the last call's results (the training state) to
        `directory` (`runtime.checkpoint`): `format="npz"`, hlopar's `<worker>.npz`;
        `"orbax"`, an Orbax item per worker, `<worker>/`, which plain Orbax reads
        (`runtime.orbax_format`); with a `manifest.json`. Written beside `directory` and
        renamed there once every part is written and checked. A failure raises
        `CheckpointError` naming the path and the cause, and leaves `directory` and the
        workers' state as they were. A `directory` holding anything but an earlier save of
        this plan is refused unless `overwrite=True`."""
        from hlopar.runtime import checkpoint

        compiled = self._require_run()
        return checkpoint.save(
            directory,
            plan=compiled.planned.bundle.name,
            shapes=_saved_shapes(compiled),
            step=compiled.runtime.step_id,
            write=compiled.runtime.save,
            overwrite=overwrite,
            format=format,
            keys=_result_keys(compiled),
        )

    def restore(self, directory: str | os.PathLike):
        """The results `save` wrote, as `fn`'s output pytree: each worker reads its own shards
        back and keeps them (so passing them to the next call sends nothing). Needs the
        workers of the same plan (a call or `compile(...)` first). The save is checked first
        (`checkpoint.read_manifest`: manifest, plan, every part's checksum, shapes and
        dtypes): a bad one raises `CheckpointError` naming the file and what is wrong, the
        live state as it was. An Orbax save of another plan, or a checkpoint plain Orbax
        wrote of `fn`'s output pytree, is read here instead (`orbax_format.restore_tree`)
        and returned as single-device arrays, which the next call sends."""
        from hlopar.runtime import checkpoint
        from hlopar.runtime.orbax_format import is_orbax_checkpoint

        compiled = self._compiled
        if compiled is None:
            raise RuntimeError("restore needs the compiled step: call it, or compile(*example_args), first")
        directory = Path(directory)
        plan = compiled.planned.bundle.name
        found = checkpoint.peek(directory)
        if (found is None and is_orbax_checkpoint(directory)) or (
            found is not None and found.get("parts_format") == "orbax" and found.get("plan") != plan
        ):
            return self._restore_here(compiled, directory, items=sorted(found["parts"]) if found else ())
        manifest = checkpoint.read_manifest(
            directory, plan=plan, shapes=_saved_shapes(compiled), workers=compiled.runtime.worker_meshes()
        )
        if not compiled.runtime.alive:
            self._restart()
        restored = self._outputs(compiled, compiled.runtime.load(directory, manifest.get("keys", ())))
        self._last_run = compiled
        return restored

    def _restore_here(self, compiled: _Compiled, directory: Path, items: Sequence[str]):
        """An Orbax checkpoint read in this process (`restore`): fn's output pytree of
        single-device arrays."""
        from hlopar.runtime.checkpoint import CheckpointError
        from hlopar.runtime.orbax_format import restore_tree

        shapes = _leaf_shapes(compiled)
        device = jax.local_devices()[0]
        target = jax.tree_util.tree_unflatten(
            compiled.out_tree,
            [
                jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
                for shape, dtype in shapes
            ],
        )
        try:
            leaves = restore_tree(directory, _leaf_keys(compiled), shapes, target=target, items=items)
        except Exception as error:  # noqa: BLE001 - Orbax's own errors, named with the path
            raise CheckpointError(
                f"cannot restore from {directory}: {type(error).__name__}: {error}; nothing was "
                "restored (the live state is as it was)"
            ) from error
        return compiled.static_results.rebuild(
            wrap_keys([jax.device_put(x, device) for x in leaves], compiled.outputs), compiled.out_tree
        )

    def _save_every(self) -> None:
        """`checkpoint_every`: after a call, a save of its results begun in the background
        (`checkpoint.PeriodicSaves`), unless the one before is still being written."""
        from hlopar.runtime import checkpoint

        compiled, saves = self._last_run, self._saves
        due = saves.due()
        if due is None:
            return
        try:
            pending = checkpoint.PendingSave.begin(
                due,
                plan=compiled.planned.bundle.name,
                step=compiled.runtime.step_id,
                format=self.checkpoint_format,
                keys=_result_keys(compiled),
            )
            with pending.failing():
                finish = compiled.runtime.save_start(pending.staging, pending.record)
        except checkpoint.CheckpointError as error:
            saves.failed(error)
            return
        shapes = _saved_shapes(compiled)
        runtime = compiled.runtime

        def hint(path: Path) -> None:
            runtime.resume_hint = (
                f"the last checkpoint is {path} (saved after call {path.name}): restore('{path}') resumes there"
            )

        def job() -> Path:
            with pending.failing():
                written = finish()
            return pending.commit(written, shapes, recheck=False)  # the CPU it takes is the steps'; sizes checked

        saves.run(job, on_commit=hint)

    def wait_for_checkpoint(self, timeout: float | None = None) -> Path | None:
        """`checkpoint_every`: waits for the save being written (if any); returns the last
        one committed (None: none yet, or no `checkpoint_every`)."""
        return self._saves.wait(timeout) if self._saves is not None else None

    def _require_run(self) -> _Compiled:
        """The signature whose results the last call (or `restore`) gave: what `save` saves,
        whatever signature `compile` was called for since."""
        compiled = self._last_run
        if compiled is not None and not compiled.runtime.alive and compiled.runtime.step_id:
            raise RuntimeError(
                "nothing to save: the workers were stopped (after a failure, or closed), and the "
                "state they held with them"
            )
        if compiled is None or not compiled.runtime.alive or compiled.runtime.step_id == 0:
            raise RuntimeError("nothing to save: the workers have not run a step")
        return compiled


def _leaf_shapes(compiled: _Compiled) -> list[tuple[tuple[int, ...], str]]:
    """Per output leaf of `fn`, its shape and dtype as saved (a typed key's key data)."""
    leaves = []
    for out, _ in compiled.outputs:
        if is_key(out.dtype):
            out = jax.eval_shape(jax.random.key_data, out)
        leaves.append((tuple(out.shape), str(np.dtype(out.dtype))))
    return leaves


def _leaf_keys(compiled: _Compiled) -> list[str]:
    """Per output leaf of `fn`, its path in the output pytree (`jax.tree_util.keystr`)."""
    numbered = jax.tree_util.tree_unflatten(compiled.out_tree, range(len(compiled.outputs)))
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(numbered)[0]]


def _result_keys(compiled: _Compiled) -> list[str]:
    """Per result of the plan's program, its key in an Orbax save: its output leaf's path, a
    stacked leaf's piece with its rows (`[0]['layers']['w'][2:4]`)."""
    keys = _leaf_keys(compiled)
    pieces = compiled.pieces
    if pieces is None:
        return keys
    return [
        keys[o] if p < 0 else f"{keys[o]}[{p}:{p + r}]"
        for o, p, r in zip(pieces.result_origin, pieces.result_piece, pieces.result_rows)
    ]


def _saved_shapes(compiled: _Compiled) -> list[tuple[tuple[int, ...], str]]:
    """Per result of the plan's program (`@main`'s: a stacked leaf's pieces, a typed key's
    key data), its shape and dtype: what a save of it holds."""
    leaves = _leaf_shapes(compiled)
    pieces = compiled.pieces
    if pieces is None:
        return leaves
    return [
        leaves[o] if p < 0 else ((r, *leaves[o][0][1:]), leaves[o][1])
        for o, p, r in zip(pieces.result_origin, pieces.result_piece, pieces.result_rows)
    ]


class _Held:
    """The place of an argument the workers keep (never read; pieces of it are itself)."""

    def __getitem__(self, index) -> _Held:
        return self


_HELD = _Held()


def _read_argument(leaf: RemoteArray, what: str):
    """A result not kept by this function's workers, read to be sent (its key data for a key)."""
    try:
        return leaf.__jax_array__()
    except RuntimeError as error:
        raise RuntimeError(f"{what}: {error}") from None


def _program_arguments(
    compiled: _Compiled, arguments: list, resident: dict, args: StaticLeaves, name: str
) -> tuple[list, dict]:
    """@main's arguments and resident ones ({argument: (step, result position)}) from the
    step's leaves: stacked layers cut into their pieces, each piece resident where the
    result kept is cut alike (else the leaf is read and sent)."""
    pieces = compiled.pieces
    if pieces is None:  # a result leaf is @main's result of its number
        return arguments, resident
    program = pieces.split(arguments)
    found = pieces.resident({i: o for i, (s, o) in resident.items()})
    stray = {pieces.arg_origin[k] for k, a in enumerate(program) if a is _HELD and k not in found}
    if stray:  # kept, but cut otherwise than this argument: read it
        leaves, paths = args.leaves(), args.paths()
        for i in stray:
            arguments[i] = _key_data(_read_argument(leaves[i], f"{name}'s argument {paths[i]}"))
            del resident[i]
        return _program_arguments(compiled, arguments, resident, args, name)
    return program, {k: (resident[pieces.arg_origin[k]][0], r) for k, r in found.items()}


def _result_parts(pieces, count: int) -> list[tuple[int, ...]]:
    """Per result leaf of the step (`count` of them), the positions of @main's results it is
    made of (the pieces of a stacked one, in order, `LayerPieces`; else itself)."""
    if pieces is None:
        return [(k,) for k in range(count)]
    parts: dict[int, list[int]] = {}
    for k, origin in enumerate(pieces.result_origin):
        parts.setdefault(origin, []).append(k)
    return [tuple(parts[o]) for o in sorted(parts)]


def _output_leaves(lowered, name: str) -> list[tuple[jax.ShapeDtypeStruct, str]]:
    """Per result leaf of `fn`: its shape and dtype, and its name (`train_step's result [1]['w']`)."""
    flat = jax.tree_util.tree_flatten_with_path(lowered.out_info)[0]
    return [
        (jax.ShapeDtypeStruct(info.shape, info.dtype), f"{name}'s result {jax.tree_util.keystr(path)}".rstrip())
        for path, info in flat
    ]


def _dtype(x) -> np.dtype:
    """As `jax.jit` sees it: a Python scalar is of JAX's default type (int32, float32 without
    x64), so `TrainState.create`'s `step=0` and the int32 the step returns are one signature."""
    return x.dtype if hasattr(x, "dtype") else jax.dtypes.canonicalize_dtype(np.result_type(x))


def _key_data(leaf):
    """A typed key (`jax.random.key`) as the words the lowered program takes for it."""
    return jax.random.key_data(leaf) if is_key(_dtype(leaf)) else leaf


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: Cluster | None = None,
    num_microbatches: int | None = None,
    schedule: str = DEFAULT_PLAN_SCHEDULE,
    batch_argnums=...,
    donate_argnums: Sequence[int] | int = (),
    method: str = "auto",
    rng: str = "exact",
    timeout: float = 300.0,
    cache: bool = True,
    verbose: bool = True,
    remat: str | bool = "auto",
    stage_loops: bool = False,
    runtime: str = "auto",
    checkpoint_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_format: str = "orbax",
    layers: int | None = None,
    memory_per_device: float | str | None = None,
    loss_result: int | None = None,
    loss: str | Callable | None = None,
    stages: int | None = None,
    idle_hosts: bool = False,
    transport: str = "auto",
):
    """`fn` (a pure JAX function, e.g. a training step, or an exported module: a `.mlir` /
    `.mlirbc` path, `hlopar.ModuleStep`) run over a cluster: a callable with `fn`'s signature
    and results. Usable as a decorator, with or without arguments.
    `verbose=False` silences the first call's progress display and messages. `rng`:
    "exact" (random draws equal the full batch's; whole-shape generators are refused under
    several microbatches) or "per-microbatch" (they draw per microbatch, with a warning;
    docs/training_step.md). `remat`: which pipeline stages recompute their forward in the
    backward instead of keeping its activations ("auto": where stage construction finds it
    pays, per stage or per layer; True or "always": every stage, per stage; "layers": every
    stage, per layer; False or "never"; docs/codegen.md, "Rematerialization").
    `stage_loops=True`: each pipeline stage runs the iterations it holds of a scanned layer
    stack as one loop (`hlopar-reroll-stage-loops`), holding those layers' slices of the
    stacked parameters and state as one range; off by default, as on XLA:CPU the rolled
    stage still compiles slower than the unrolled one (docs/stage_construction.md, measured).
    `runtime`: "process" runs the plan in this process, as `jax.jit` does (a local cluster,
    on devices this process's jax sees, no layer stack cut into pieces: `runtime.in_process`); "ray" on Ray
    workers; "auto" in this process where the plan allows it, else on Ray.
    `checkpoint_every=N, checkpoint_dir=DIR`: every N calls the state is saved to
    `DIR/<call>` in the background, the steps going on meanwhile (the last two kept), in
    Orbax's format or hlopar's (`checkpoint_format="npz"`; `ParallelizedFunction.save`,
    docs/runtime.md). `layers`: operator clustering's number of layers (default: chosen);
    `stages`: exactly this many pipeline stages (default: chosen with the submeshes);
    `idle_hosts=True`: the stages may leave whole hosts idle where the pipeline is predicted
    faster on fewer of them (a small model on slow links between hosts; default: every device);
    `transport`: how Ray workers move values between meshes: "object-store" (Ray's),
    "collective" (collectives of one jax runtime of all workers: NCCL on GPUs, gloo on CPUs;
    runs on Ray workers), "auto" (collective on GPUs, object store on CPUs; docs/runtime.md);
    `memory_per_device`: the device memory stages are planned within, bytes or a size such
    as "80GiB" (default: the cluster preset's); `loss`: the result that is the loss, by its
    path (`"[2]['loss']"`) or as a function of the results (`lambda out: out[2]['loss']`);
    `loss_result`: the same as a leaf number of `fn`'s flattened results (default: found,
    also where `fn` drops it, module docstring). The options are the planning
    pipeline's (`passes.plan_options.PlanOptions`), as `hlopar-compile`'s flags. Module
    docstring."""

    def wrap(function: Callable) -> ParallelizedFunction:
        return ParallelizedFunction(
            function,
            cluster=cluster,
            num_microbatches=num_microbatches,
            schedule=schedule,
            batch_argnums=batch_argnums,
            donate_argnums=donate_argnums,
            method=method,
            rng=rng,
            timeout=timeout,
            cache=cache,
            verbose=verbose,
            remat=remat,
            stage_loops=stage_loops,
            runtime=runtime,
            checkpoint_every=checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            checkpoint_format=checkpoint_format,
            layers=layers,
            memory_per_device=memory_per_device,
            loss_result=loss_result,
            loss=loss,
            stages=stages,
            idle_hosts=idle_hosts,
            transport=transport,
        )

    return wrap if fn is None else wrap(fn)
