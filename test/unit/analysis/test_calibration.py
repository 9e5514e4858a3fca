"""The calibration's fit (timings -> preset) and preset files: pure, no devices."""

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest

from hlopar.analysis.auto_sharding.cluster import (
    CLUSTER_PRESETS,
    cluster_preset,
    logical_mesh,
    preset_fingerprint,
    write_preset,
)
from hlopar.analysis.auto_sharding.collectives import bytes_sent, collective_cost
from hlopar.analysis.calibration import CollectiveTiming, Measurements, fit_links, preset_from_measurements
from hlopar.analysis.cluster import Cluster

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def exact_timings(alpha, beta, across=False, groups=(2, 8)):
    return [
        CollectiveTiming(kind, group, nbytes, alpha + bytes_sent(kind, group, nbytes) / beta, across)
        for kind in KINDS
        for group in groups
        for nbytes in (1024, 1 << 20)
    ]


def test_fit_recovers_the_model_it_prices_with():
    fit = fit_links(exact_timings(40e-6, 3e9))
    assert fit.latency_s == pytest.approx(40e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(3e9, rel=1e-9)
    assert fit.samples == 20 and fit.error == pytest.approx(0.0, abs=1e-9)


def test_fit_is_not_moved_by_a_few_outliers():
    timings = exact_timings(40e-6, 3e9)
    timings[0] = dataclasses.replace(timings[0], seconds=timings[0].seconds * 20)  # a load spike
    timings[7] = dataclasses.replace(timings[7], seconds=timings[7].seconds * 10)
    fit = fit_links(timings)
    assert fit.latency_s == pytest.approx(40e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(3e9, rel=1e-9)


def test_fit_without_a_resolved_bandwidth_and_bad_timings():
    one_size = [CollectiveTiming("all-reduce", 2, 1024, 1e-4), CollectiveTiming("all-gather", 2, 1024, 2e-4)]
    fit = fit_links(one_size)
    assert fit.latency_s == pytest.approx(1.5e-4)
    assert fit.bandwidth > 0
    with pytest.raises(ValueError, match="no collective timings"):
        fit_links([])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_links([CollectiveTiming("all-reduce", 2, 1024, 0.0)])


def measurements(collectives, **extra):
    return Measurements(
        device_kind="cpu",
        num_hosts=2,
        devices_per_host=4,
        device_memory_bytes=2.0**30,
        large_matmul_flops=2e9,
        large_matmul_s=0.1,  # 20 GFLOP/s
        small_matmul_flops=5e5,
        small_matmul_s=4e-5,  # (5e5 + n_half) / 2e10 -> n_half = 3e5
        kernel_s=3e-6,
        launch_s=2e-4,
        collectives=tuple(collectives),
        **extra,
    )


def test_preset_from_measurements():
    inside, across = exact_timings(40e-6, 3e9), exact_timings(400e-6, 1e8, across=True, groups=(2,))
    preset, fits = preset_from_measurements(measurements(inside + across), "here", "this machine")
    assert preset.device_flops == pytest.approx(2e10)
    assert preset.matmul_half_flops == pytest.approx(3e5)
    assert preset.kernel_launch_s == 3e-6
    assert preset.executable_launch_s == 2e-4
    assert (preset.devices_per_host, preset.device_memory_bytes) == (4, 2.0**30)
    assert preset.intra_host_latency_s == pytest.approx(40e-6) and preset.intra_host_bandwidth == pytest.approx(3e9)
    assert preset.inter_host_latency_s == pytest.approx(400e-6) and preset.inter_host_bandwidth == pytest.approx(1e8)
    assert fits["inter_host"]["samples"] == 10
    # No timing across processes: the inter-host links are the in-process ones.
    preset, fits = preset_from_measurements(measurements(inside), "here")
    assert fits["inter_host"] is None
    assert (preset.inter_host_latency_s, preset.inter_host_bandwidth) == (
        preset.intra_host_latency_s,
        preset.intra_host_bandwidth,
    )


def test_memory_bandwidth_from_two_elementwise_kernels():
    """The difference between a large and a small kernel's time: its launch cancels out."""
    launch, rate = 3e-5, 1.5e9
    timed = measurements(
        exact_timings(40e-6, 3e9),
        elementwise_bytes=(2.0**18, 2.0**22),
        elementwise_s=(launch + 2.0**18 / rate, launch + 2.0**22 / rate),
    )
    preset, fits = preset_from_measurements(timed, "here")
    assert preset.device_memory_bandwidth == pytest.approx(rate, rel=1e-9)
    assert fits["device_memory_bandwidth"] == preset.device_memory_bandwidth
    mesh = logical_mesh((2, 4), preset=str(write_preset(preset, Path(tempfile.mkdtemp()) / "p.json")))
    assert mesh.device_memory_bandwidth == preset.device_memory_bandwidth
    # Not timed, or the larger kernel no slower (lost in the noise): not priced.
    assert preset_from_measurements(measurements(exact_timings(40e-6, 3e9)), "here")[0].device_memory_bandwidth == 0
    noisy = dataclasses.replace(timed, elementwise_s=(2e-3, 1e-3))
    assert preset_from_measurements(noisy, "here")[0].device_memory_bandwidth == 0
    assert CLUSTER_PRESETS["cpu"].device_memory_bandwidth == 0.0
    assert logical_mesh((2, 4)).device_memory_bandwidth == 0.0


def test_launch_per_value_from_an_executable_of_many_values():
    launch, per_value = 2e-4, 8e-6  # `measurements`' launch; 33 arguments and 33 results
    timed = measurements(exact_timings(40e-6, 3e9), many_values=33, many_values_launch_s=launch + 64 * per_value)
    assert preset_from_measurements(timed, "here")[0].value_launch_s == pytest.approx(per_value, rel=1e-9)
    # Not timed, or no slower than one value (noise): not priced.
    assert preset_from_measurements(measurements(exact_timings(40e-6, 3e9)), "here")[0].value_launch_s == 0
    noisy = measurements(exact_timings(40e-6, 3e9), many_values=33, many_values_launch_s=launch / 2)
    assert preset_from_measurements(noisy, "here")[0].value_launch_s == 0


def test_the_host_threads_launch_from_launches_on_half_and_all_of_the_devices():
    """The line through the pace of back-to-back runs on 4 and on 8 devices: 60 us and 20 us
    a device; 33 values (arguments and results) on 8: 10 us a value more. In one process,
    on CPU devices: their cores are the host thread's."""
    fixed, per_device, per_value = 60e-6, 20e-6, 10e-6
    paces = (fixed + 4 * per_device, fixed + 8 * per_device)
    timed = measurements(
        exact_timings(40e-6, 3e9),
        dispatch_devices=(4, 8),
        dispatch_s=paces,
        many_values=33,
        many_values_dispatch_s=paces[1] + 64 * per_value,
    )
    preset = preset_from_measurements(timed, "here")[0]
    assert preset.dispatch_s == pytest.approx(fixed, rel=1e-9)
    assert preset.device_dispatch_s == pytest.approx(per_device, rel=1e-9)
    assert preset.value_dispatch_s == pytest.approx(per_value, rel=1e-9)
    assert preset.devices_share_host_cores is True
    gpus = preset_from_measurements(dataclasses.replace(timed, device_kind="gpu"), "here")[0]
    assert (gpus.dispatch_s, gpus.devices_share_host_cores) == (preset.dispatch_s, False)
    # One device: no line, its pace is the fixed part. Noise (fewer devices slower): no
    # per-device part. Not timed, or timed across processes (Ray workers launch their own):
    # not priced.
    alone = preset_from_measurements(dataclasses.replace(timed, dispatch_devices=(1, 1)), "here")[0]
    assert (alone.dispatch_s, alone.device_dispatch_s) == (paces[1], 0.0)
    noisy = preset_from_measurements(dataclasses.replace(timed, dispatch_s=paces[::-1]), "here")[0]
    assert (noisy.dispatch_s, noisy.device_dispatch_s) == (paces[0], 0.0)
    across = exact_timings(40e-6, 3e9) + exact_timings(400e-6, 1e8, across=True, groups=(2,))
    for untimed in (measurements(exact_timings(40e-6, 3e9)), dataclasses.replace(timed, collectives=tuple(across))):
        preset = preset_from_measurements(untimed, "here")[0]
        priced = (preset.dispatch_s, preset.device_dispatch_s, preset.value_dispatch_s, preset.devices_share_host_cores)
        assert priced == (0.0, 0.0, 0.0, False)


def test_the_cross_mesh_transport_from_a_small_and_a_large_value():
    latency, rate = 3e-4, 8e9
    sizes = (16384.0, 4194304.0)
    timed = measurements(
        exact_timings(40e-6, 3e9), transfer_bytes=sizes, transfer_s=tuple(latency + b / rate for b in sizes)
    )
    preset, _ = preset_from_measurements(timed, "here")
    assert preset.transfer_latency_s == pytest.approx(latency, rel=1e-9)
    assert preset.transfer_bandwidth == pytest.approx(rate, rel=1e-9)
    # Not timed (one device), or the large value no slower: the links price transfers.
    untimed = preset_from_measurements(measurements(exact_timings(40e-6, 3e9)), "here")[0]
    assert (untimed.transfer_latency_s, untimed.transfer_bandwidth) == (0.0, 0.0)
    noisy = measurements(exact_timings(40e-6, 3e9), transfer_bytes=sizes, transfer_s=(2e-3, 1e-3))
    assert preset_from_measurements(noisy, "here")[0].transfer_bandwidth == 0.0


def test_a_preset_file_from_before_the_memory_bandwidth_still_reads(tmp_path):
    path = write_preset(dataclasses.replace(CLUSTER_PRESETS["cpu"], name="old"), tmp_path / "old.json")
    data = json.loads(path.read_text())
    for name in (
        "device_memory_bandwidth",
        "value_launch_s",
        "transfer_latency_s",
        "transfer_bandwidth",
        "dispatch_s",
        "device_dispatch_s",
        "value_dispatch_s",
        "devices_share_host_cores",
    ):
        del data["preset"][name]
    path.write_text(json.dumps(data))
    assert cluster_preset(str(path)) == dataclasses.replace(CLUSTER_PRESETS["cpu"], name="old")


def test_preset_file_round_trips_and_plans(tmp_path):
    preset = dataclasses.replace(
        CLUSTER_PRESETS["cpu"],
        name="mine",
        inter_host_bandwidth=1e6,
        kernel_launch_s=2e-6,
        dispatch_s=7e-5,
        device_dispatch_s=1e-5,
        value_dispatch_s=8e-6,
        devices_share_host_cores=True,
    )
    path = write_preset(preset, tmp_path / "mine.json", measured={"note": "synthetic"})
    assert cluster_preset(str(path)) == preset
    assert json.loads(path.read_text())["measured"] == {"note": "synthetic"}
    # The cost model reads the file where it reads a built-in preset.
    mesh = logical_mesh((2, 4), preset=str(path), devices_per_host=4)
    assert (
        mesh.axes[0].bandwidth_bytes_per_s == 1e6 and mesh.axes[1].bandwidth_bytes_per_s == preset.intra_host_bandwidth
    )
    crossing = preset.inter_host_latency_s + bytes_sent("all-reduce", 2, 1 << 20) / 1e6
    assert collective_cost("all-reduce", mesh, ("x",), 1 << 20) == pytest.approx(crossing, rel=1e-12)
    # A rewritten file is read again (keyed by its mtime and size), and plans anew.
    before = preset_fingerprint(str(path))
    key = Cluster.local(2, 4, preset=str(path)).key()
    faster = dataclasses.replace(preset, inter_host_bandwidth=2e9)
    write_preset(faster, path)
    os.utime(path, ns=(1, 10**18))
    assert cluster_preset(str(path)) == faster
    assert preset_fingerprint(str(path)) != before
    assert key["preset_content"] == before and Cluster.local(2, 4, preset=str(path)).key()["preset_content"] != before
    assert preset_fingerprint("cpu") == "cpu" and "preset_content" not in Cluster.local(2, 4).key()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a readable JSON file"),
        ('{"preset": {}}', 'expected a JSON object with "format"'),
        ('{"format": "hlopar-cluster-preset/1"}', 'no "preset" object'),
        ('{"format": "hlopar-cluster-preset/1", "preset": {"name": "x", "flops": 1}}', r"unknown fields \['flops'\]"),
    ],
)
def test_bad_preset_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"cluster preset file .*bad.json: .*{message}"):
        cluster_preset(str(path))
    with pytest.raises(ValueError, match="Cluster preset: cluster preset file"):
        Cluster.local(2, 4, preset=str(path))


def test_bad_preset_values_and_missing_files(tmp_path):
    data = {"format": "hlopar-cluster-preset/1", "preset": dataclasses.asdict(CLUSTER_PRESETS["cpu"])}
    data["preset"]["inter_host_bandwidth"] = -1.0
    (tmp_path / "neg.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="inter_host_bandwidth must be a finite number >= 0, got -1.0"):
        cluster_preset(str(tmp_path / "neg.json"))
    data["preset"]["inter_host_bandwidth"] = 1.0
    data["preset"]["devices_share_host_cores"] = 1
    (tmp_path / "flag.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="devices_share_host_cores must be true or false, got 1"):
        cluster_preset(str(tmp_path / "flag.json"))
    with pytest.raises(ValueError, match="cluster preset file .*missing.json: No such file"):
        cluster_preset(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown cluster preset 'tpu'; known presets: cpu, .*or a preset file"):
        cluster_preset("tpu")


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = write_preset(CLUSTER_PRESETS["cpu"], tmp_path / "p.json")
    before = path.read_text()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hlopar.analysis.auto_sharding.cluster.os.replace", broken)
    with pytest.raises(OSError):
        write_preset(dataclasses.replace(CLUSTER_PRESETS["cpu"], device_flops=1.0), path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]
