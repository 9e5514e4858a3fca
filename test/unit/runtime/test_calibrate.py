"""Calibration of this machine (`runtime/calibrate.py`, `hlopar-calibrate`, issue 31 item 1):
what it times, the preset file it writes, and the plan that changes with it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

import hlopar
from hlopar.analysis.auto_sharding.cluster import CLUSTER_PRESETS, cluster_preset, preset_from_dict, write_preset
from hlopar.analysis.cluster import CALIBRATED_PRESET
from hlopar.models import get_train_step
from hlopar.runtime import calibrate as calibrate_module

KINDS = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


@pytest.mark.heavy  # the default suite times the same through hlopar-calibrate, below
def test_calibrate_times_what_the_cost_model_prices(tmp_path):
    result = hlopar.calibrate(hlopar.Cluster.local(2, 4), output=tmp_path / "here.json", repeats=1)
    m = result.measurements
    # Every collective over groups of 2 devices, a host's (4) and all (8), both buffer sizes.
    seen = sorted((t.kind, t.group, t.nbytes) for t in m.collectives)
    assert seen == sorted((k, g, n) for k in KINDS for g in (2, 4, 8) for n in (1024, 1 << 20))
    assert all(t.seconds > 0 and not t.across_processes for t in m.collectives)
    assert m.large_matmul_flops == 2 * 1024**3 and m.large_matmul_s > 0
    preset = result.preset
    assert (preset.devices_per_host, preset.name) == (4, "calibrated")
    assert preset.device_flops == pytest.approx(m.large_matmul_flops / m.large_matmul_s)
    # No timing across processes: hosts share this process in the in-process runtime.
    assert result.fits["inter_host"] is None
    assert (preset.inter_host_latency_s, preset.inter_host_bandwidth) == (
        preset.intra_host_latency_s,
        preset.intra_host_bandwidth,
    )
    assert cluster_preset(str(result.path)) == preset
    written = json.loads(result.path.read_text())["measured"]
    assert len(written["measurements"]["collectives"]) == 30
    assert "links in one process" in result.report() and str(result.path) in result.report()


def test_calibrate_refuses_a_cluster_it_cannot_time():
    with pytest.raises(ValueError, match="the cluster has 16 devices, jax sees 8"):
        hlopar.calibrate(hlopar.Cluster.local(2, 8), repeats=1)
    with pytest.raises(ValueError, match="calibrate measures this machine"):
        hlopar.calibrate(hlopar.Cluster(address="ray://elsewhere:10001", num_hosts=2, devices_per_host=4))


def test_a_busy_machine_is_warned_about_and_its_load_recorded(tmp_path, monkeypatch):
    """Other work skews every timing: the load average before and after is written to the
    file, and a machine above half a load per core is warned about (the timings kept)."""
    compute = {"large_matmul_flops": 2e9, "large_matmul_s": 0.1, "small_matmul_flops": 5e5}
    compute |= {"small_matmul_s": 4e-5, "kernel_s": 3e-6, "launch_s": 2e-4}
    monkeypatch.setattr(calibrate_module, "_compute_timings", lambda devices, timer: compute)
    timings = [
        calibrate_module.CollectiveTiming(k, g, n, 1e-4 + n / 1e9) for k in KINDS for g in (2,) for n in (1024, 1 << 20)
    ]
    monkeypatch.setattr(calibrate_module, "_collective_timings", lambda devices, group, timer, across: timings)
    cores = os.cpu_count()
    loads = iter([0.1 * cores, 0.2 * cores, 3.0 * cores, 2.0 * cores])
    monkeypatch.setattr(calibrate_module, "_load", lambda: next(loads))
    quiet = hlopar.calibrate(hlopar.Cluster.local(1, 2), output=tmp_path / "quiet.json", repeats=1)
    assert not quiet.busy and quiet.load == pytest.approx((0.1 * cores, 0.2 * cores))
    assert json.loads(quiet.path.read_text())["measured"]["load_average"] == pytest.approx([0.1 * cores, 0.2 * cores])
    with pytest.warns(
        calibrate_module.BusyMachineWarning,
        match=rf"the machine was busy \(load average {3.0 * cores:.1f} on {cores} cores\)",
    ):
        busy = hlopar.calibrate(hlopar.Cluster.local(1, 2), output=tmp_path / "busy.json", repeats=1)
    assert busy.busy and "BUSY: the timings are skewed" in busy.report()
    assert cluster_preset(str(busy.path)) == busy.preset  # kept: the caller decides


def run_cli(*args):
    env = {**os.environ, "HLOPAR_NO_FORK": "1"}
    env.pop("XLA_FLAGS", None)  # the command forces its own host devices
    return subprocess.run(
        [sys.executable, "-m", "hlopar.cli.calibrate", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_hlopar_calibrate_writes_the_file_to_stdout():
    done = run_cli("--repeats", "1", "--hosts", "2", "--devices-per-host", "4")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    preset = preset_from_dict(data)
    measured = data["measured"]["measurements"]
    seen = sorted((t["kind"], t["group"], t["nbytes"]) for t in measured["collectives"])
    assert seen == sorted((k, g, n) for k in KINDS for g in (2, 4, 8) for n in (1024, 1 << 20))
    assert preset.devices_per_host == 4
    assert preset.device_flops == pytest.approx(measured["large_matmul_flops"] / measured["large_matmul_s"])
    assert data["measured"]["fits"]["intra_host"]["samples"] == 30 and data["measured"]["fits"]["inter_host"] is None
    # The host thread's pace, on half and all of the devices, in one process on CPU devices.
    assert measured["dispatch_devices"] == [4, 8] and min(measured["dispatch_s"]) > 0
    assert measured["many_values_dispatch_s"] > 0
    assert preset.dispatch_s + preset.device_dispatch_s > 0 and preset.devices_share_host_cores is True
    assert "host thread per launch" in done.stderr
    assert "calibrated 2 host(s) x 4 cpu device(s)" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--hosts", "0"), "--hosts must be >= 1, got 0"),
        (("-o", "/no/such/folder/p.json"), "no such directory /no/such/folder"),
    ],
)
def test_hlopar_calibrate_bad_arguments(args, message):
    done = run_cli(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.heavy  # two processes start jax and gloo: ~15 s on 2 cores
def test_calibrate_across_processes(tmp_path):
    result = hlopar.calibrate(hlopar.Cluster.local(2, 4), across_processes=True, repeats=2)
    across = [t for t in result.measurements.collectives if t.across_processes]
    assert sorted((t.kind, t.group) for t in across) == sorted((k, g) for k in KINDS for g in (2, 8) for _ in range(2))
    assert result.fits["inter_host"]["samples"] == 20
    assert result.preset.inter_host_bandwidth == pytest.approx(result.fits["inter_host"]["bandwidth"])


# ---------------------------------------------------------------------------- planning with it


@pytest.fixture(scope="module")
def mlp():
    step = get_train_step("mlp", "tiny")
    params = step.init(jax.random.PRNGKey(0))
    return step, (params, step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1)))


def planned_devices(mlp, preset):
    step, args = mlp
    fn = hlopar.parallelize(step.step, cluster=hlopar.Cluster.local(2, 4, preset=preset), batch_argnums=(2,))
    return dict(fn.plan(*args)[0].program.devices)


def test_the_plan_follows_the_calibration_of_cross_host_links(tmp_path, mlp):
    """Links across hosts as fast as those inside: one mesh over both hosts; 250x slower
    (what a calibration across processes reports where they are slow): no mesh spans hosts,
    the hosts pipeline instead. The same preset file otherwise."""
    cpu = CLUSTER_PRESETS["cpu"]
    fast = write_preset(
        dataclasses.replace(cpu, inter_host_latency_s=cpu.intra_host_latency_s, inter_host_bandwidth=5e9),
        tmp_path / "fast.json",
    )
    slow = write_preset(
        dataclasses.replace(cpu, inter_host_latency_s=5e-3, inter_host_bandwidth=2e7), tmp_path / "slow.json"
    )
    assert planned_devices(mlp, str(fast)) == {"m0": tuple(range(8))}
    assert planned_devices(mlp, str(slow)) == {"m0": (0, 1, 2, 3), "m1": (4, 5, 6, 7)}


def test_calibrated_preset_is_measured_once_and_kept(tmp_path, monkeypatch, mlp):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    calls = []

    def measured(cluster, *, output, across_processes, **kwargs):
        calls.append((cluster.num_hosts, cluster.devices_per_host, across_processes))
        write_preset(dataclasses.replace(CLUSTER_PRESETS["cpu"], name="calibrated"), output)

    monkeypatch.setattr(calibrate_module, "calibrate", measured)
    step, args = mlp
    for _ in range(2):
        fn = hlopar.parallelize(step.step, cluster=hlopar.Cluster.local(2, 4, preset=CALIBRATED_PRESET))
        fn.plan(*args)
    assert calls == [(2, 4, False)]
    (kept,) = (tmp_path / "calibration").iterdir()
    assert cluster_preset(str(kept)).name == "calibrated"
