"""Where the Ray runtime's workers go: one placement-group bundle per host of the cluster,
holding that host's workers (one per (mesh, host of its devices), `mesh_processes.worker_layout`).

STRICT_SPREAD over the nodes of a real cluster, PACK on the local machine, where hosts are
simulated by separate processes exactly as on a real cluster. A worker asks Ray for what it
holds: its GPUs, and a hundredth of a core (`WORKER_CPUS`): CPU devices are threads on the
host's cores, which every worker shares, so several parallelized functions fit on one
machine. A request no node set of the cluster could ever hold (`unplaceable`: too many GPUs,
fewer nodes than hosts) fails at once, naming what was asked and what exists; only what
could still become free (held by other workers) is waited for (`ray_runtime.RayRuntime`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hlopar.codegen.pipeline_program import PipelineProgram
from hlopar.runtime.mesh_processes import WorkerLayout, worker_layout

__all__ = ["WORKER_CPUS", "Placement", "placement_of", "resources", "unplaceable"]


WORKER_CPUS = 0.01  # what a worker asks of a host's cores (module docstring)


@dataclass(frozen=True)
class Placement:
    """Where workers go: one per (mesh, host), and whether hosts are simulated on this machine."""

    workers: WorkerLayout
    local: bool
    device_kind: str  # cpu or gpu

    @property
    def strategy(self) -> str:
        return "PACK" if self.local else "STRICT_SPREAD"

    @property
    def hosts(self) -> list[int]:
        return sorted({s.host for s in self.workers.slots.values()})

    def worker_resources(self, name: str) -> dict[str, float]:
        """What worker `name` asks Ray for: its GPUs, and `WORKER_CPUS` of a core."""
        need = {"CPU": WORKER_CPUS}
        if self.device_kind == "gpu":
            need["GPU"] = float(len(self.workers.slots[name].devices))
        return need

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per host (`hosts` order): its workers' resources."""
        out = []
        for host in self.hosts:
            bundle: dict[str, float] = {}
            for name, slot in self.workers.slots.items():
                if slot.host == host:
                    for resource, amount in self.worker_resources(name).items():
                        bundle[resource] = round(bundle.get(resource, 0.0) + amount, 4)
            out.append(bundle)
        return out

    def describe(self) -> str:
        """The request in the user's terms: per host, its bundle and workers."""
        rows = []
        for host, bundle in zip(self.hosts, self.bundles()):
            names = [
                f"{n} ({len(s.devices)} {self.device_kind} devices)"
                for n, s in self.workers.slots.items()
                if s.host == host
            ]
            rows.append(f"host {host}: {resources(bundle)} for {', '.join(names)}")
        return "; ".join(rows) + (
            " (PACK: on any nodes)" if self.local else f" (STRICT_SPREAD: {len(rows)} distinct nodes, one per host)"
        )


def placement_of(program: PipelineProgram, devices_per_host: int, *, local: bool, device_kind: str) -> Placement:
    """One worker per (mesh, host of its devices) (module docstring)."""
    return Placement(worker_layout(program.devices, devices_per_host), local, device_kind)


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(amount <= node.get(resource, 0.0) + 1e-9 for resource, amount in bundle.items())


def unplaceable(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why no placement of `bundles` on `nodes` (each node's total resources) can ever exist,
    whatever else runs there, or None. PACK: the totals fit and each bundle fits some node
    (necessary, enough for one bundle per host); STRICT_SPREAD: each bundle on its own
    node (a matching of bundles to nodes, by augmenting paths)."""
    if not nodes:
        return "the Ray cluster has no alive node"
    for resource in sorted({r for b in bundles for r in b}):
        need = sum(b.get(resource, 0.0) for b in bundles)
        have = sum(n.get(resource, 0.0) for n in nodes)
        if need > have + 1e-9:
            return f"they need {need:g} {resource} in all, the Ray cluster has {have:g}"
    for k, bundle in enumerate(bundles):
        if not any(_fits(bundle, node) for node in nodes):
            return f"no node can hold host {k}'s workers ({resources(bundle)})"
    if strategy != "STRICT_SPREAD":
        return None
    if len(bundles) > len(nodes):
        return f"{len(bundles)} hosts need {len(bundles)} distinct nodes, the Ray cluster has {len(nodes)}"
    holder: dict[int, int] = {}  # node -> bundle

    def assign(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n not in seen and _fits(bundles[b], node):
                seen.add(n)
                if n not in holder or assign(holder[n], seen):
                    holder[n] = b
                    return True
        return False

    for b in range(len(bundles)):
        if not assign(b, set()):
            return f"no {len(bundles)} distinct nodes can hold one host's workers each"
    return None


def resources(amounts: Mapping[str, float], only: Sequence[str] | None = None) -> str:
    """`{CPU: 2, GPU: 0}`: the amounts of `only` (default: each resource of `amounts`)."""
    keys = sorted(amounts) if only is None else only
    return "{" + ", ".join(f"{k}: {amounts.get(k, 0.0):g}" for k in keys) + "}"
