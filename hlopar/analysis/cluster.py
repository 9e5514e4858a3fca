"""`Cluster`: the cluster a step is planned for and run on, a value the planner takes.

Hosts × devices per host, the device kind, and the planner's cost preset
(`analysis.auto_sharding.cluster.cluster_preset`: a built-in one or a preset file, such as
`hlopar-calibrate` writes); sizes checked against what the planner handles
(`analysis.limits`). A Ray cluster's sizes are read from its nodes once connected
(`hlopar.api` connects, then resolves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, cluster_preset, is_preset_file, preset_fingerprint
from hlopar.analysis.limits import check_argument, check_cluster, check_cluster_dimension

__all__ = ["CALIBRATED_PRESET", "Cluster"]

# Not a preset: `parallelize` calibrates this machine as the cluster uses it, once, and plans
# with the preset file it keeps (`runtime.calibrate.calibrated_preset`).
CALIBRATED_PRESET = "calibrated"


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
    # The planner's cluster preset: a built-in one (default: "cpu" on CPUs, "v100-p3.16xlarge"
    # on GPUs), a preset file (`hlopar-calibrate`'s), or "calibrated" (measured once, kept).
    preset: str | None = None

    def __post_init__(self) -> None:
        """Sizes the planner handles (`analysis.limits`: the limit and why), a known kind. The
        preset is checked where a cluster is made for this machine or resolved (`check_preset`):
        a cluster a pass describes (`hlopar-auto-parallel`'s `preset`) reaches the pass that
        reads its preset, which refuses an unknown one in its own terms."""
        for name in ("num_hosts", "devices_per_host"):
            if getattr(self, name) is not None:
                check_argument(f"Cluster {name}", check_cluster_dimension, getattr(self, name))
        if self.num_hosts is not None and self.devices_per_host is not None:
            try:
                check_cluster(self.num_hosts, self.devices_per_host)
            except ValueError as error:
                raise ValueError(f"Cluster: {error}") from None
        if self.device_kind not in (None, "cpu", "gpu"):
            raise ValueError(f"Cluster device_kind must be 'cpu', 'gpu' or None, got {self.device_kind!r}")

    def check_preset(self) -> Cluster:
        """This cluster, its preset known (or None: the default for its kind)."""
        if self.preset is None or self.preset == CALIBRATED_PRESET:
            return self
        if self.preset not in CLUSTER_PRESETS and not is_preset_file(self.preset):
            raise ValueError(
                f"Cluster preset: unknown preset {self.preset!r}; known presets: {', '.join(CLUSTER_PRESETS)}, "
                "or a preset file (.json)"
            )
        try:
            cluster_preset(self.preset)
        except ValueError as error:
            raise ValueError(f"Cluster preset: {error}") from None
        return self

    @classmethod
    def local(
        cls,
        num_hosts: int = 1,
        devices_per_host: int | None = None,
        device_kind: Literal["cpu", "gpu"] | None = None,
        preset: str | None = None,
    ) -> Cluster:
        """This machine: by default one host with all the local devices jax sees."""
        import jax  # here, not at the top: hlopar-opt reads .mlir files and needs no jax (1 s to import)

        check_argument("Cluster num_hosts", check_cluster_dimension, num_hosts)
        kind = device_kind or ("gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu")
        if devices_per_host is None:
            devices_per_host = max(1, len(jax.devices()) // num_hosts)
        return cls(None, num_hosts, devices_per_host, kind, preset).check_preset()

    @property
    def is_local(self) -> bool:
        return self.address is None

    def resolved(self) -> Cluster:
        """Every field set. A Ray cluster's are read from its alive nodes: this process must
        be connected to it (`hlopar.api` connects first)."""
        self.check_preset()
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
        key = {
            "hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "kind": self.device_kind,
            "preset": self.preset,
        }
        if self.preset is not None and is_preset_file(self.preset):
            key["preset_content"] = preset_fingerprint(self.preset)  # a recalibrated file plans anew
        return key
