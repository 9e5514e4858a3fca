"""`hlopar.parallelize`: run a JAX training step pipelined and sharded over a cluster.

    import hlopar
    step = hlopar.parallelize(train_step, cluster=hlopar.Cluster.local(num_hosts=2, devices_per_host=4),
                              num_microbatches=4, schedule="1f1b")
    params, opt_state, loss = step(params, opt_state, batch)   # as train_step(...) would return

The first call (per argument signature: pytree structure, shapes, dtypes):

1. lowers `fn` with jax (`jax.jit(fn, keep_unused=True, donate_argnums=...).lower(...)` on abstract
   arguments, with debug info: source lines and pytree paths name what messages speak of)
   to StableHLO text, one `@main` argument per pytree leaf;
2. plans it, as `hlopar-compile` does (`cli/compile.py`, docs/codegen.md): hlopar-import,
   hlopar-split-microbatches, then per `method`
   - `"auto"`: hlopar-cluster-operators, hlopar-stage-construction (stages, submeshes and
     an intra-op plan per stage, all chosen; one stage on every device is one of the
     choices), hlopar-cross-mesh-resharding;
   - `"pipeline"`: the same with `plan_shardings=false`: pure inter-operator parallelism,
     each stage replicated over its submesh (for comparison);
   - `"shard"`: pure intra-operator parallelism, one stage on one mesh of every device
     (num_hosts × devices_per_host), planned by hlopar-auto-sharding;
   then codegen (`codegen.pipeline_program`) and the bundle (`codegen.bundle.write_bundle`);
3. starts one Ray worker per (mesh, host) (`runtime.ray_runtime`), which compiles its
   fragments; or, where the plan is one mesh and one executable on this machine's one host
   and this process's jax sees its devices, compiles that executable here and runs it here,
   as `jax.jit` does (`runtime="auto"`, `runtime.in_process`: no worker, no Ray; results
   are `jax.Array`s on those devices). `runtime="ray"` always uses workers.

With `verbose`, these phases show on stderr (`progress.Progress`: one line redrawn in place
on a terminal, a line per phase otherwise); `verbose=False` prints nothing.

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

The bundle is cached on disk under `$HLOPAR_CACHE_DIR` (default
`~/.cache/hlopar`), in `plans/<key>/`, the key a hash of the program text, the cluster and the
options: a new process with the same step skips planning (codegen reads `program.mlir`
back).

Arguments and results. Results stay on the workers that computed them (in this process's
devices for a plan run here): a call returns `fn`'s
output pytree of `runtime.remote_array.RemoteArray`s (shape and dtype known; reading one,
`float(loss)`, `np.asarray`, `jax.device_get`, printing, a jax function, fetches that one
value, once; a scalar, such as the loss, came back with its step's reply). When the next
call passes a result back as an argument (new parameters,
optimizer state), the driver sends nothing for it. `batch_argnums`: the positional arguments holding the batch
(each leaf cut along dim 0 into microbatches); `...` lets the split pass find them (the
arguments that are not training state). `num_microbatches=None`: the largest divisor of the
batch size not above max(4, 2 × num_hosts) ("shard": 1), or 1, with an `HloparWarning` saying
why, where the split pass refuses that many (a number the user gives is refused instead), and
1 where the plan is one stage either way (microbatches would only add launches).
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

import hashlib
import inspect
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS
from hlopar.analysis.limits import check_cluster, check_cluster_dimension, check_count, check_seconds
from hlopar.analysis.training_roles import RolesError
from hlopar.ir.diagnostics import DiagnosticError
from hlopar.progress import Progress
from hlopar.runtime.protocol import Runtime
from hlopar.runtime.ray_runtime import WorkerError
from hlopar.runtime.remote_array import RemoteArray, is_key, read_all, with_step
from hlopar.runtime.step_arguments import wrap_keys

__all__ = [
    "Cluster",
    "HloparWarning",
    "ParallelizedFunction",
    "PlannedStep",
    "PlanningError",
    "parallelize",
    "plan_step",
]

METHODS = ("auto", "shard", "pipeline")
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "eager-1f1b-wd")
RNG_MODES = ("exact", "per-microbatch")
REMAT_MODES = ("auto", "always", "never", "layers")
RUNTIMES = ("auto", "ray", "process")
CACHE_VERSION = "hlopar-plan-v9"  # bumped when the planner's output changes


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class Cluster:
    """A cluster of `num_hosts` hosts with `devices_per_host` devices each.

    `Cluster.local(...)`: this machine, hosts simulated by separate worker processes (each
    worker its own CPU devices), Ray started here if it is not running. `Cluster(address=...)`:
    an existing Ray cluster (`ray.init(address=...)`); hosts and devices per host default to
    its alive nodes and the GPUs per node (CPU-only: the CPUs per node).
    """

    address: str | None = None
    num_hosts: int | None = None
    devices_per_host: int | None = None
    device_kind: Literal["cpu", "gpu"] | None = None
    preset: str | None = None  # the planner's cluster preset (default: "cpu" on CPUs, "v100-p3.16xlarge" on GPUs)

    def __post_init__(self) -> None:
        """Sizes the planner handles (`analysis.limits`: the limit and why), a known kind and preset."""
        for name in ("num_hosts", "devices_per_host"):
            if getattr(self, name) is not None:
                _check_argument(f"Cluster {name}", check_cluster_dimension, getattr(self, name))
        if self.num_hosts is not None and self.devices_per_host is not None:
            try:
                check_cluster(self.num_hosts, self.devices_per_host)
            except ValueError as error:
                raise ValueError(f"Cluster: {error}") from None
        if self.device_kind not in (None, "cpu", "gpu"):
            raise ValueError(f"Cluster device_kind must be 'cpu', 'gpu' or None, got {self.device_kind!r}")
        if self.preset is not None and self.preset not in CLUSTER_PRESETS:
            raise ValueError(
                f"Cluster preset: unknown preset {self.preset!r}; known presets: {', '.join(CLUSTER_PRESETS)}"
            )

    @classmethod
    def local(
        cls,
        num_hosts: int = 1,
        devices_per_host: int | None = None,
        device_kind: Literal["cpu", "gpu"] | None = None,
        preset: str | None = None,
    ) -> Cluster:
        """This machine: by default one host with all the local devices jax sees."""
        _check_argument("Cluster num_hosts", check_cluster_dimension, num_hosts)
        kind = device_kind or ("gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu")
        if devices_per_host is None:
            devices_per_host = max(1, len(jax.devices()) // num_hosts)
        return cls(None, num_hosts, devices_per_host, kind, preset)

    @property
    def is_local(self) -> bool:
        return self.address is None

    def resolved(self) -> Cluster:
        """Every field set (connects to Ray for a remote cluster's nodes)."""
        if self.is_local:
            local = Cluster.local(self.num_hosts or 1, self.devices_per_host, self.device_kind, self.preset)
            return Cluster(
                None,
                local.num_hosts,
                local.devices_per_host,
                local.device_kind,
                local.preset or ("cpu" if local.device_kind == "cpu" else "v100-p3.16xlarge"),
            )
        import ray

        _connect(self)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus = min((n["Resources"].get("GPU", 0) for n in nodes), default=0)
        kind = self.device_kind or ("gpu" if gpus else "cpu")
        per_host = self.devices_per_host or int(
            gpus if kind == "gpu" else min(n["Resources"].get("CPU", 1) for n in nodes)
        )
        return Cluster(
            self.address,
            self.num_hosts or len(nodes),
            per_host,
            kind,
            self.preset or ("cpu" if kind == "cpu" else "v100-p3.16xlarge"),
        )

    def key(self) -> dict:
        return {
            "hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "kind": self.device_kind,
            "preset": self.preset,
        }


def _check_argument(name: str, check: Callable[[Any], None], value: Any) -> None:
    """`check(value)` (`analysis.limits`), its `ValueError` naming the argument."""
    try:
        check(value)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


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


# --------------------------------------------------------------------------- planning


@dataclass
class PlannedStep:
    """A planned step: the codegen program and where its bundle is."""

    program: Any  # codegen.pipeline_program.PipelineProgram
    bundle: Path
    plan: dict
    cached: bool
    seconds: float


def _default_microbatches(module, batch_args: Sequence[int] | None, cluster: Cluster) -> int:
    from hlopar.analysis.training_roles import batch_arguments
    from hlopar.ir.graph import FuncGraph
    from hlopar.passes.auto_sharding import planned_functions

    graph = FuncGraph.from_func(planned_functions(module)[0])
    if batch_args is None:
        batch_args = batch_arguments(graph)
    shapes = [graph.values[graph.args[i]].shape for i in batch_args]
    sizes = [shape[0] for shape in shapes if shape]
    if not sizes:
        return 1
    size = math.gcd(*sizes)
    limit = max(4, 2 * (cluster.num_hosts or 1))
    return max(d for d in range(1, min(size, limit) + 1) if size % d == 0)


def _cache_root() -> Path:
    return Path(os.environ.get("HLOPAR_CACHE_DIR") or Path.home() / ".cache" / "hlopar")


def plan_step(
    text: str,
    cluster: Cluster,
    *,
    num_microbatches: int | None = None,
    schedule: str = "eager-1f1b",
    method: str = "auto",
    batch_args: Sequence[int] | None = None,
    rng: str = "exact",
    remat: str = "auto",
    stage_loops: bool = False,
    cache: bool = True,
    log: Callable[[str], None] = lambda message: None,
    host_callbacks: bool = False,
) -> PlannedStep:
    """Plans a training step's StableHLO text for a (resolved) cluster and writes its bundle,
    or reads the cached one. Module docstring. `host_callbacks`: the caller runs a plan of one
    mesh and one microbatch in this process, host callbacks included (`pipeline_program`)."""
    from hlopar.codegen.pipeline_program import ProgramError, pipeline_program
    from hlopar.ir.diagnostics import error_at
    from hlopar.ir.host_callbacks import host_callbacks as find_host_callbacks
    from hlopar.analysis.schedules import get_schedule
    from hlopar.ir.module import parse_module

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    clock = time.perf_counter()
    split = get_schedule(schedule).split_backward
    step_batch_args = batch_args
    module, context, pieces, batch_args = _imported(text, method, step_batch_args)
    chosen = num_microbatches is None  # hlopar's choice, not the user's: it may fall back to 1
    if chosen:
        num_microbatches = 1 if method == "shard" else _default_microbatches(module, batch_args, cluster)
    options = {
        "microbatches": num_microbatches,
        "chosen": chosen,
        "schedule": schedule,
        "method": method,
        "batch_args": list(step_batch_args) if step_batch_args is not None else None,
        "rng": rng,
        "remat": remat,
        "stage_loops": stage_loops,
    }
    if find_host_callbacks(module):  # a plan that may hold them, apart: a refusal is made afresh, at the user's line
        options["host_callbacks"] = host_callbacks
    key = hashlib.sha256(
        json.dumps(
            {
                "version": CACHE_VERSION,
                "jax": jax.__version__,
                "text": text,
                "cluster": cluster.key(),
                "options": options,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]
    bundle = _cache_root() / "plans" / key
    if cache and (bundle / "pipeline.json").is_file() and (bundle / "program.mlir").is_file():
        try:
            program = pipeline_program(
                parse_module((bundle / "program.mlir").read_text()), split_backward=split, host_callbacks=host_callbacks
            )
        except ProgramError as error:
            raise DiagnosticError([error_at(error.location, str(error))]) from None
        plan = json.loads((bundle / "plan.json").read_text())
        log(f"plan read from the cache ({bundle})")
        return PlannedStep(program, bundle, plan, True, time.perf_counter() - clock)

    try:
        plan = _plan_module(
            module, cluster, num_microbatches, schedule, method, batch_args, rng, remat, stage_loops, context
        )
    except DiagnosticError as error:
        refusal = next((d for d in error.diagnostics if d.message.startswith("hlopar-split-microbatches:")), None)
        if not chosen or num_microbatches == 1 or refusal is None:
            raise
        # The user asked for no number of microbatches: one, where nothing needs a split,
        # beats a refusal (said as a warning, with what the split would have needed).
        module, context, pieces, batch_args = _imported(text, method, step_batch_args)
        plan = _plan_module(module, cluster, 1, schedule, method, batch_args, rng, remat, stage_loops, context)
        plan["warnings"].insert(
            0,
            replace(
                refusal,
                severity="warning",
                message=(
                    f"{refusal.message}; so the step is not split into the {num_microbatches} microbatches hlopar would "
                    "have chosen: planned with one microbatch (num_microbatches=1)"
                ),
            ).format(),
        )
        num_microbatches = 1
    if chosen and num_microbatches > 1 and len((plan.get("stages") or {}).get("stages", ())) == 1:
        # One stage gains nothing from microbatches hlopar chose, only launches (each fragment
        # runs once per microbatch, and no one executable runs the step): planned again with
        # one, kept if it is still one stage (where the memory needs the microbatches, it is not).
        single = _imported(text, method, step_batch_args)
        try:
            single_plan = _plan_module(
                single[0], cluster, 1, schedule, method, single[3], rng, remat, stage_loops, single[1]
            )
        except DiagnosticError:
            single_plan = None
        if single_plan is not None and len(single_plan["stages"]["stages"]) == 1:
            log(f"one stage: planned with one microbatch, not the {num_microbatches} hlopar would have split into")
            module, context, pieces, batch_args = single
            plan, num_microbatches = single_plan, 1
    if pieces is not None:  # as planned: hlopar-reroll-stage-loops may have joined a stage's pieces into ranges
        from hlopar.passes.auto_sharding import planned_functions
        from hlopar.passes.unstack_layer_scans import LayerPieces

        pieces = LayerPieces.of(planned_functions(module)[0]) or pieces
    plan["layer_pieces"] = pieces.to_json() if pieces else None
    try:
        program = pipeline_program(module, split_backward=split, host_callbacks=host_callbacks)
    except ProgramError as error:
        raise DiagnosticError([error_at(error.location, str(error))]) from None
    if cache:
        _write_cached(bundle, program, module, plan, schedule, options, cluster)
    else:
        bundle = Path(tempfile.mkdtemp(prefix="hlopar-plan-"))
        _write_bundle(bundle, program, module, plan, schedule)
    seconds = time.perf_counter() - clock
    log(f"planned in {seconds:.1f} s ({bundle})")
    return PlannedStep(program, bundle, plan, False, seconds)


def _imported(text: str, method: str, batch_args: Sequence[int] | None):
    """The step's module imported, and for a pipelined method its scans over layers unrolled
    with their stacked values split per layer (`hlopar-unstack-layer-scans`): (module, pass
    context, `LayerPieces` or None, the batch arguments in the module's numbering)."""
    from hlopar.ir.module import parse_module
    from hlopar.passes.auto_sharding import planned_functions
    from hlopar.passes.base import PassContext
    from hlopar.passes.import_program import ImportPass
    from hlopar.passes.unstack_layer_scans import LayerPieces, UnstackLayerScansPass

    module = parse_module(text)
    context = PassContext()
    ImportPass().run(module, context)
    if method == "shard":  # one stage: the loops stay loops
        return module, context, None, batch_args
    UnstackLayerScansPass().run(module, context)
    pieces = LayerPieces.of(planned_functions(module)[0])
    if pieces is not None and batch_args is not None:
        batch_args = list(pieces.arguments_of(batch_args))
    return module, context, pieces, batch_args


def _plan_module(
    module,
    cluster: Cluster,
    microbatches: int,
    schedule: str,
    method: str,
    batch_args: Sequence[int] | None,
    rng: str,
    remat: str,
    stage_loops: bool,
    context,
) -> dict:
    """Runs the planning passes on an imported module; returns the plan report
    (`hlopar-auto-parallel`'s shape: split, clustering, stages, cross_mesh) with the passes'
    warnings (`warnings`: formatted diagnostics, also those of `context`'s earlier passes)."""
    from hlopar.passes.auto_parallel import stage_remat
    from hlopar.passes.base import PassContext
    from hlopar.passes.cluster_operators import ClusterOperatorsPass
    from hlopar.passes.cross_mesh_resharding import CrossMeshReshardingPass
    from hlopar.passes.rematerialize import RematerializePass
    from hlopar.passes.reroll_stage_loops import RerollStageLoopsPass
    from hlopar.passes.split_microbatches import SplitMicrobatchesPass
    from hlopar.passes.stage_construction import StageConstructionPass

    with tempfile.TemporaryDirectory(prefix="hlopar-plan-") as scratch:
        paths = {k: str(Path(scratch) / f"{k}.json") for k in ("split", "clustering", "stages", "reroll", "cross_mesh")}
        SplitMicrobatchesPass(
            microbatches=microbatches,
            batch_args=tuple(batch_args) if batch_args is not None else None,
            rng=rng,
            report=paths["split"],
        ).run(module, context)
        if method == "shard":
            stages = _one_mesh_program(module, cluster, microbatches)
        else:
            ClusterOperatorsPass(report=paths["clustering"]).run(module, context)
            StageConstructionPass(
                num_hosts=cluster.num_hosts,
                devices_per_host=cluster.devices_per_host,
                microbatches=microbatches,
                schedule=schedule,
                preset=cluster.preset,
                plan_shardings=method != "pipeline",
                report=paths["stages"],
                **stage_remat(remat),
            ).run(module, context)
            stages = None
        RematerializePass(all=remat == "always").run(module, context)
        if method != "shard" and stage_loops:
            RerollStageLoopsPass(report=paths["reroll"]).run(module, context)
        CrossMeshReshardingPass(
            cluster=cluster.preset, devices_per_host=cluster.devices_per_host, report=paths["cross_mesh"]
        ).run(module, context)
        plan = {"pass": "hlopar.parallelize", "method": method}
        for key, path in paths.items():
            plan[key] = json.loads(Path(path).read_text()) if Path(path).exists() else None
        if stages is not None:
            plan["stages"] = stages
    plan["warnings"] = list(dict.fromkeys(d.format() for d in context.diagnostics))
    return plan


def _one_mesh_program(module, cluster: Cluster, microbatches: int) -> dict:
    """`method="shard"`: the split step as an MPMD program of one stage on one mesh of every
    device (x = hosts, y = devices per host), its shardings planned by hlopar-auto-sharding."""
    from jaxlib.mlir import ir

    from hlopar.ir.graph import FuncGraph
    from hlopar.passes.auto_sharding import planned_functions
    from hlopar.passes.cluster_operators import ClusterOperatorsPass
    from hlopar.passes.mpmd_program import StageMesh, write_mpmd_program

    shape = (cluster.num_hosts, cluster.devices_per_host)
    devices = tuple(range(math.prod(shape)))
    with module.context, ir.Location.unknown():
        graph = FuncGraph.from_func(planned_functions(module)[0])
        layering, _ = ClusterOperatorsPass(layers=1).cluster(graph)
        write_mpmd_program(
            module,
            [0] * len(graph.ops),
            layering.roles,
            [StageMesh("m0", ("x", "y"), shape, devices)],
            preset=cluster.preset,
        )
    return {
        "microbatches": microbatches,
        "stages": [{"stage": 0, "logical_shape": list(shape), "devices": list(devices), "latency": 0.0}],
    }


def _write_bundle(directory: Path, program, module, plan: dict, schedule: str) -> None:
    from hlopar.codegen.bundle import write_bundle
    from hlopar.ir.module import print_module

    write_bundle(directory, program, print_module(module), plan, schedule)


def _write_cached(bundle: Path, program, module, plan: dict, schedule: str, options: dict, cluster: Cluster) -> None:
    """Writes the bundle beside its place and renames it there (readers never see half of one)."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hlopar-plan-", dir=bundle.parent))
    try:
        _write_bundle(staging, program, module, plan, schedule)
        (staging / "options.json").write_text(json.dumps({"options": options, "cluster": cluster.key()}, indent=1))
        try:
            os.rename(staging, bundle)
        except OSError:  # another process cached the same plan first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- the callable


@dataclass
class _Compiled:
    signature: tuple
    out_tree: Any
    planned: PlannedStep
    runtime: Runtime  # in_process.InProcessRuntime, or ray_runtime.RayRuntime
    cluster: Cluster
    outputs: list = field(default_factory=list)  # per result leaf: its shape and dtype, and its name
    pieces: Any = None  # passes.unstack_layer_scans.LayerPieces: stacked layers split per layer, or None
    # The RemoteArrays its calls returned that are still referenced (read before its workers
    # stop for another signature's, `ParallelizedFunction._stop`).
    issued: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)


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
    ):
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if rng not in RNG_MODES:
            raise ValueError(f"rng must be one of {', '.join(RNG_MODES)}, got {rng!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        remat = {True: "always", False: "never"}[remat] if isinstance(remat, bool) else remat
        if remat not in REMAT_MODES:
            raise ValueError(f"remat must be True, False or one of {', '.join(REMAT_MODES)}, got {remat!r}")
        if cluster is not None and not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a hlopar.Cluster or None, got {type(cluster).__name__}")
        if num_microbatches is not None:
            _check_argument("num_microbatches", lambda n: check_count(n, low=1), num_microbatches)
        _check_argument("timeout", check_seconds, timeout)
        for name, numbers in (
            ("batch_argnums", () if batch_argnums is ... else batch_argnums),
            ("donate_argnums", donate_argnums),
        ):
            for number in (numbers,) if isinstance(numbers, int) else numbers:
                _check_argument(name, lambda n: check_count(-n if isinstance(n, int) and n < 0 else n), number)
        self.fn = fn
        self.cluster = cluster
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.batch_argnums = (
            batch_argnums
            if batch_argnums is ...
            else tuple((batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums)
        )
        self.donate_argnums = tuple((donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums)
        self.method = method
        self.rng = rng
        self.remat = remat
        self.stage_loops = bool(stage_loops)
        self.runtime_kind = runtime
        self.timeout = timeout
        self.cache = cache
        self.verbose = verbose
        self._progress = Progress(verbose)
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
                Path(checkpoint_dir), checkpoint_every, warn=lambda message: warnings.warn(message, HloparWarning)
            )
        )
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "parallelized")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _log(self, message: str) -> None:
        self._progress.message(message)

    # -- building

    @staticmethod
    def _signature(args: tuple) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten(args)
        return (tree, tuple((np.shape(x), _dtype(x)) for x in leaves))

    def plan(self, *args) -> tuple[PlannedStep, Any]:
        """Lowers and plans the step for these arguments, starting nothing: the plan and
        JAX's lowering. Raises `PlanningError` in the user's terms; the passes' warnings are
        raised as `HloparWarning`s."""
        return self._plan((self.cluster or Cluster.local()).resolved(), args)

    def _plan(self, cluster: Cluster, args: tuple) -> tuple[PlannedStep, Any]:
        self._progress.phase("lowering")
        clock = time.perf_counter()
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), args)
        lowered = jax.jit(self.fn, keep_unused=True, donate_argnums=self.donate_argnums).lower(*abstract)
        # With debug info: each op's location is the user's source line, each argument
        # named by its pytree path, so that messages speak of their code.
        text = lowered.as_text(debug_info=True)
        self._log(
            f"lowered {self.__name__} in {time.perf_counter() - clock:.1f} s; planning for "
            f"{cluster.num_hosts} host(s) x {cluster.devices_per_host} {cluster.device_kind} device(s), "
            f"method {self.method}, schedule {self.schedule}"
        )
        self._progress.phase("planning")
        try:
            planned = plan_step(
                text,
                cluster,
                num_microbatches=self.num_microbatches,
                schedule=self.schedule,
                method=self.method,
                batch_args=self._batch_leaves(args),
                rng=self.rng,
                remat=self.remat,
                stage_loops=self.stage_loops,
                cache=self.cache,
                log=self._log,
                host_callbacks=self.runtime_kind != "ray" and cluster.is_local and cluster.num_hosts == 1,
            )
        except (DiagnosticError, RolesError) as error:
            raise PlanningError(
                f"hlopar cannot parallelize {self.__name__}{_defined_at(self.fn)}:\n{in_api_terms(str(error))}"
            ) from None
        for message in planned.plan.get("warnings", ()):
            warnings.warn(in_api_terms(message), HloparWarning, stacklevel=3)
        self._log(describe_plan(planned))
        return planned, lowered

    def compile(self, *args) -> _Compiled:
        """Lowers, plans and starts the workers for these arguments (what the first call
        does); returns the compiled state. A signature seen before is taken from the
        function's cache; a new one is planned while the current workers keep running (a
        refusal changes nothing), and they are stopped only as the bounds say (module
        docstring, "Signatures")."""
        with self._lock:
            signature = self._signature(args)
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
        from hlopar.passes.unstack_layer_scans import LayerPieces
        from hlopar.codegen.pipeline_program import host_callback_message
        from hlopar.ir.diagnostics import Diagnostic
        from hlopar.ir.host_callbacks import lowered_host_callbacks
        from hlopar.runtime.in_process import InProcessRuntime, in_process_devices
        from hlopar.runtime.ray_placement import placement_of
        from hlopar.runtime.ray_runtime import RayRuntime

        cluster = (self.cluster or Cluster.local()).resolved()
        self._progress = progress = Progress(self.verbose)
        try:
            planned, lowered = self._plan(cluster, args)
            outputs = _output_leaves(lowered, self.__name__)
            pieces = LayerPieces.from_json(planned.plan.get("layer_pieces"))
            devices, why_not = (
                (None, "runtime='ray'")
                if self.runtime_kind == "ray"
                else in_process_devices(
                    planned.program,
                    cluster.device_kind,
                    one_host=cluster.is_local and cluster.num_hosts == 1,
                    pieces=pieces is not None,
                )
            )
            if devices is None and self.runtime_kind == "process":
                raise ValueError(f"{self.__name__} cannot run in this process (runtime='process'): {why_not}")
            if devices is not None:
                runtime = InProcessRuntime(
                    planned.program,
                    devices,
                    log=progress.message,
                    phase=progress.phase,
                    host_callbacks=lowered_host_callbacks(lowered),
                )
                self._log(
                    f"running in this process on {len(devices)} {cluster.device_kind} device(s), as jax.jit "
                    "does (no Ray workers)"
                )
            elif planned.program.host_callbacks:  # a Ray worker would crash on it (codegen.pipeline_program)
                where = planned.program.host_callbacks[0]
                refusal = Diagnostic(
                    "error",
                    host_callback_message(where.target, f"the plan runs on Ray workers ({why_not})"),
                    where.location,
                )
                raise PlanningError(
                    f"hlopar cannot parallelize {self.__name__}{_defined_at(self.fn)}:\n"
                    f"{in_api_terms(refusal.format())}"
                )
            else:
                placement = placement_of(
                    planned.program, cluster.devices_per_host, local=cluster.is_local, device_kind=cluster.device_kind
                )
                _connect(cluster)
                parts = _result_parts(pieces, len(outputs))
                runtime = RayRuntime(
                    planned.program,
                    self.schedule,
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
                )
                self._log(f"starting {len(placement.workers.slots)} Ray worker(s) ({why_not})")
        except BaseException:
            progress.done()
            raise
        return _Compiled(signature, lowered.out_tree, planned, runtime, cluster, outputs, pieces=pieces)

    def _restart(self) -> None:
        """Starts the current signature's runtime (its workers, or its executable here),
        first stopping the other signatures' workers that must make room for it."""
        compiled = self._compiled
        compiled.runtime.connect()
        self._make_room(compiled)
        if compiled.runtime.step_id:
            self._log(compiled.runtime.restart_message)
        try:
            compiled.runtime.start()
        finally:
            self._progress.done()

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

    def _batch_leaves(self, args: tuple) -> list[int] | None:
        if self.batch_argnums is ...:
            return None
        leaves, offset = [], 0
        for position, arg in enumerate(args):
            count = len(jax.tree_util.tree_leaves(arg))
            if position in self.batch_argnums:
                leaves += range(offset, offset + count)
            offset += count
        return leaves

    # -- running

    def __call__(self, *args):
        with self._lock:
            out = self._call(args)
            self._last_run = self._compiled
            if self._saves is not None:
                self._save_every()
            return out

    def _call(self, args: tuple):
        compiled = self.compile(*args)
        for other in self._signatures.values():
            if other is not compiled and other.runtime.alive:
                try:
                    other.runtime.set_aside()  # what the caller dropped is not left on idle workers
                except WorkerError:  # its workers died: stopped, what they held says so when read
                    pass
        runtime = compiled.runtime
        arguments, resident = [], {}  # resident: leaf -> (step, result leaf) the runtime keeps
        for i, leaf in enumerate(jax.tree_util.tree_leaves(args)):
            if isinstance(leaf, RemoteArray):
                held = leaf.resident_in(runtime)
                if held is not None:
                    arguments.append(_HELD)
                    resident[i] = held
                    continue
                leaf = _read_argument(leaf, f"{self.__name__}'s argument {_leaf_path(args, i)}")
            arguments.append(leaf)  # typed keys go in as their key data (`step_arguments`)
        output = runtime.run(*_program_arguments(compiled, arguments, resident, args, self.__name__))
        self._donate(args)
        return self._outputs(compiled, output)

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
        return jax.tree_util.tree_unflatten(compiled.out_tree, leaves)

    def _donate(self, args: tuple) -> None:
        """As `jax.jit` donates: the donated arguments are deleted (a result kept on the
        workers is dropped there at the next step)."""
        for position in self.donate_argnums:
            for leaf in jax.tree_util.tree_leaves(args[position]):
                if isinstance(leaf, (jax.Array, RemoteArray)) and not leaf.is_deleted():
                    leaf.delete()

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
        return jax.tree_util.tree_unflatten(
            compiled.out_tree, wrap_keys([jax.device_put(x, device) for x in leaves], compiled.outputs)
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
    compiled: _Compiled, arguments: list, resident: dict, args: tuple, name: str
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
        leaves = jax.tree_util.tree_leaves(args)
        for i in stray:
            arguments[i] = _key_data(_read_argument(leaves[i], f"{name}'s argument {_leaf_path(args, i)}"))
            del resident[i]
        return _program_arguments(compiled, arguments, resident, args, name)
    return program, {k: (resident[pieces.arg_origin[k]][0], r) for k, r in found.items()}


def _leaf_path(args: tuple, i: int) -> str:
    """Leaf `i` of the step's arguments, named by its path (`[0]['w']`), for messages."""
    return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(args)[0][i][0])


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


class HloparWarning(UserWarning):
    """A planning pass's warning (what the plan computes differently, or could not plan)."""


class PlanningError(ValueError):
    """The step cannot be parallelized as written: the message says why, where in the
    user's code, and which argument of `parallelize` settles it."""


# Pass options the messages name -> the `parallelize` arguments that set them.
_API_OPTIONS = (
    (re.compile(r"\bbatch-args=\.\.\."), "batch_argnums=... (the positional arguments that hold the batch)"),
    (re.compile(r"\bbatch-args="), "batch_argnums="),
    (re.compile(r"(?<![\w-])microbatches="), "num_microbatches="),
    (re.compile(r"\brng=per-microbatch"), 'rng="per-microbatch"'),
)


def in_api_terms(message: str) -> str:
    """A pass's message as a `parallelize` user reads it: options named as its arguments,
    no placeholder file for what has no source line (an argument, the whole step)."""
    for pattern, replacement in _API_OPTIONS:
        message = pattern.sub(replacement, message)
    return re.sub(r"(?m)^-: ", "", message)


def _defined_at(fn: Callable) -> str:
    """` (file:line)` of a Python function's definition, or nothing."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def describe_plan(planned: PlannedStep) -> str:
    """The plan in a few lines: stages, meshes and devices, how many tensors are sharded."""
    program = planned.program
    lines = [
        f"plan: {len(program.meshes)} stage(s), {program.microbatches} microbatch(es)"
        f"{' (cached)' if planned.cached else ''}"
    ]
    stages = {s["stage"]: s for s in ((planned.plan.get("stages") or {}).get("stages") or [])}
    for mesh in program.meshes:
        stage = program.stage_of_mesh.get(mesh)
        info = stages.get(stage, {})
        fragments = [f for f in program.fragments if f.mesh == mesh]
        shardings = [dims for f in fragments for dims in _SHARDING.findall(f.text)]
        sharded = sum(1 for dims in shardings if '"' in dims)
        shape = "x".join(str(s) for s in info.get("logical_shape", ())) or "?"
        latency = f", predicted {info['latency'] * 1e3:.3g} ms/microbatch" if info.get("latency") else ""
        per = "layer" if info.get("remat_form") == "layers" else "stage"
        latency += f"; forward recomputed in the backward (remat, per {per})" if info.get("remat") else ""
        lines.append(
            f"  {mesh}: stage {stage}, mesh {shape} on devices {list(program.devices[mesh])}, "
            f"fragments {', '.join(f.name for f in fragments)}; {sharded} of {len(shardings)} "
            f"annotated tensors sharded{latency}"
        )
    from hlopar.codegen.one_program import fuses

    if fuses(program):
        lines.append(
            "  runs as one executable: its fragments fused into one program (one mesh, one microbatch), "
            "as jax.jit compiles the step"
        )
    pieces = planned.plan.get("layer_pieces")
    if pieces:
        from hlopar.passes.unstack_layer_scans import LayerPieces

        pieces = LayerPieces.from_json(pieces)
        stacks = len({o for o, p in zip(pieces.arg_origin, pieces.arg_piece) if p >= 0})
        layers = pieces.layers
        lines.append(
            f"  scanned layer stack unrolled: {stacks} stacked argument(s) split into {layers} per-layer "
            "pieces, each held by its stage"
        )
        reroll = planned.plan.get("reroll")
        if reroll is None:
            lines.append("  each stage runs its layers unrolled (parallelize(stage_loops=True) runs them as loops)")
        else:
            from hlopar.passes.reroll_stage_loops import stage_loop_lines

            lines += stage_loop_lines(reroll)
    lines += _memory_lines(planned.plan.get("memory"))
    return "\n".join(lines)


def _memory_lines(memory: dict | None) -> list[str]:
    """Per mesh, the most memory a fragment needs as compiled (with what stays resident), and
    the device's (docs/codegen.md, memory.json)."""
    if not memory:
        return []
    from hlopar.units import format_bytes

    device = memory.get("device_memory")
    of = f" of {format_bytes(device)} per device" if device else ""
    peaks = [
        f"{m['mesh']} {format_bytes(m['compiled_peak'])}"
        for m in memory.get("meshes", ())
        if m.get("compiled_peak") is not None
    ]
    return [f"  memory (compiled, peak fragment + resident){of}: {', '.join(peaks)}"] if peaks else []


_SHARDING = re.compile(r"#sdy\.sharding<@[\w.]+, \[(.*?)\]>")


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: Cluster | None = None,
    num_microbatches: int | None = None,
    schedule: str = "eager-1f1b",
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
):
    """`fn` (a pure JAX function, e.g. a training step) run over a cluster: a callable with
    `fn`'s signature and results. Usable as a decorator, with or without arguments.
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
    `runtime`: "process" runs the plan in this process, as `jax.jit` does (one host, one mesh,
    one executable, on devices this process's jax sees: `runtime.in_process`); "ray" on Ray
    workers; "auto" in this process where the plan allows it, else on Ray.
    `checkpoint_every=N, checkpoint_dir=DIR`: every N calls the state is saved to
    `DIR/<call>` in the background, the steps going on meanwhile (the last two kept), in
    Orbax's format or hlopar's (`checkpoint_format="npz"`; `ParallelizedFunction.save`,
    docs/runtime.md). Module docstring."""

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
        )

    return wrap if fn is None else wrap(fn)
