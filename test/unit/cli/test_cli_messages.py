"""What the command lines say: "did you mean" for misspelled passes and options, and
hlopar-compile's summary on success (with the options its error messages name)."""

from __future__ import annotations

import functools
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hlopar.cli import compile as compile_cli
from hlopar.cli import opt as opt_cli
from hlopar.ir.context import make_context
from hlopar.ir.suggestions import did_you_mean
from hlopar.passes.pipeline import Pipeline, PipelineError

ROOT = Path(__file__).resolve().parents[3]
MLP = ROOT / "examples" / "mlp_train_step.mlir"


def test_did_you_mean():
    assert did_you_mean("mesh-shap", ["mesh-shape", "preset", "report"]) == "; did you mean 'mesh-shape'?"
    assert did_you_mean("xyz", ["mesh-shape", "preset"]) == ""
    assert (
        did_you_mean("hlopar-auto-sharing", ["hlopar-auto-sharding", "hlopar-auto-parallel", "hlopar-import"])
        == "; did you mean 'hlopar-auto-sharding' or 'hlopar-auto-parallel'?"
    )
    # compared without the prefix every name has, shown with it
    assert (
        did_you_mean("--loss-reslt", ["--loss-result", "--preset", "-o"], prefix="--")
        == "; did you mean '--loss-result'?"
    )


@pytest.mark.parametrize(
    "pipeline, message",
    [
        (
            "builtin.module(hlopar-auto-sharing)",
            "unknown pass or pipeline 'hlopar-auto-sharing'; did you mean "
            "'hlopar-auto-sharding' or 'hlopar-auto-parallel'? (hlopar passes: ",
        ),
        (
            "builtin.module(hlopar-auto-sharding{mesh-shap=2x4})",
            "pass 'hlopar-auto-sharding' has no option 'mesh-shap'; did you mean 'mesh-shape'? (options: ",
        ),
        (
            "builtin.module(hlopar-auto-parallel{split=true batch-arg=1})",
            "has no option 'batch-arg'; did you mean 'batch-args'?",
        ),
    ],
)
def test_pipeline_suggests_names(pipeline, message):
    with pytest.raises(PipelineError) as error:
        Pipeline.parse(pipeline, make_context())
    assert message in str(error.value)


@pytest.mark.parametrize(
    "cli, argv, line",
    [
        (
            compile_cli,
            [
                str(MLP),
                "-o",
                "x",
                "--num-hosts",
                "2",
                "--devices-per-host",
                "4",
                "--microbatches",
                "4",
                "--schedule",
                "1f1b",
                "--micro-batches",
                "4",
                "--loss-reslt=1",
                "--zzz",
            ],
            "  '--micro-batches'; did you mean '--microbatches'?\n  '--loss-reslt'; did you mean '--loss-result'?\n",
        ),
        (
            opt_cli,
            [str(MLP), "--pass-pipline=builtin.module()"],
            "  '--pass-pipline'; did you mean '--pass-pipeline'?\n",
        ),
    ],
)
def test_command_lines_suggest_options(cli, argv, line, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err.endswith(line)


def test_compile_prints_summary_and_takes_batch_args_and_loss_result(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HLOPAR_NO_FORK", "1")  # capsys sees this process only
    out = tmp_path / "bundle"
    status = compile_cli.main(
        [
            str(MLP),
            "-o",
            str(out),
            "--num-hosts",
            "2",
            "--devices-per-host",
            "4",
            "--microbatches",
            "4",
            "--schedule",
            "eager-1f1b",
            "--batch-args",
            "19,20",
            "--loss-result",
            "19",
            "--timeline-png",
        ]
    )
    assert status == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["split"]["batch_args"] == [19, 20] and plan["split"]["loss_result"] == 19
    assert "batch-args=19x20" in plan["options"] and "loss-result=19" in plan["options"]
    simulation = json.loads((out / "simulation.json").read_text())
    stages = plan["stages"]["stages"]
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0] == f"hlopar-compile: {len(stages)} stages on {len(stages)} meshes, 4 microbatches, schedule eager-1f1b"
    )
    assert [line.split(",")[0] for line in lines[1:-3]] == [f"  stage {k}: mesh m{k}" for k in range(len(stages))]
    assert lines[-3] == (
        f"  step {compile_cli._seconds(simulation['iteration_time_s'])} (simulated), "
        f"bubble {100 * simulation['bubble_fraction']:.1f}%"
    )
    assert lines[-2].startswith("  memory: at most ") and lines[-2].endswith("; every fragment in memory.json")
    assert lines[-1] == f"  bundle: {out} (timeline.png, timeline.json for Perfetto)"
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn: --timeline-png asked
    # The options reach hlopar-split-microbatches: a result that does not exist is refused there.
    assert (
        compile_cli.main(
            [
                str(MLP),
                "-o",
                str(out),
                "--num-hosts",
                "2",
                "--devices-per-host",
                "4",
                "--microbatches",
                "4",
                "--schedule",
                "1f1b",
                "--loss-result",
                "20",
            ]
        )
        == 1
    )
    assert "hlopar-split-microbatches: loss result 20 out of range: @main has 20 results" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, text", [(2.0, "2 s"), (0.00147, "1.47 ms"), (6.04e-5, "60.4 us"), (3e-9, "3 ns")])
def test_seconds_in_round_units(seconds, text):
    assert compile_cli._seconds(seconds) == text


def test_device_ranges():
    assert compile_cli._ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--num-hosts", "1000000", "--devices-per-host", "8"],
            "argument --num-hosts: 1000000 is more than 1,024, the most hlopar takes for a cluster's hosts",
        ),
        (
            ["--num-hosts", "2", "--devices-per-host", str(10**20)],
            "argument --devices-per-host: 100000000000000000000 is more",
        ),
        (
            ["--num-hosts", "64", "--devices-per-host", "8"],
            "--num-hosts 64 --devices-per-host 8: a cluster of 64 x 8 devices has 769 logical meshes",
        ),
        (["--num-hosts", "0", "--devices-per-host", "8"], "argument --num-hosts: expected a positive integer, got 0"),
        (
            ["--num-hosts", "2", "--devices-per-host", "4", "--layers", str(2**31)],
            "argument --layers: 2147483648 is more",
        ),
        (["--num-hosts", "2", "--devices-per-host", "4", "--batch-args", "1,99999999999"], "argument --batch-args: "),
    ],
)
def test_compile_refuses_out_of_bounds_flags_at_once(flags, message, capsys, tmp_path):
    """Before any work (no jaxlib, no fork): the limit and why, exit status 2 (a bad command line)."""
    clock = time.perf_counter()
    with pytest.raises(SystemExit) as exit:
        compile_cli.main([str(MLP), "-o", str(tmp_path / "b"), "--microbatches", "2", "--schedule", "1f1b", *flags])
    assert exit.value.code == 2 and time.perf_counter() - clock < 5
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _opt_into(target: Path, monkeypatch) -> int:
    monkeypatch.setenv("HLOPAR_NO_FORK", "1")
    return opt_cli.main([str(MLP), "--pass-pipeline=builtin.module(canonicalize)", "-o", str(target)])


def test_opt_writes_into_a_fifo_and_leaves_it_a_fifo(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    assert _opt_into(fifo, monkeypatch) == 0
    reader.join(timeout=30)
    assert received and received[0].startswith(b"module @jit_step")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and os.listdir(tmp_path) == ["pipe"]


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a character device (a copy of /dev/null) needs root"
)
def test_opt_writes_into_a_character_device_and_leaves_it_one(tmp_path, monkeypatch):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    assert _opt_into(node, monkeypatch) == 0
    assert stat.S_ISCHR(node.lstat().st_mode) and os.listdir(tmp_path) == ["null"]


@functools.cache
def _tiny_gpt_step() -> str:
    from hlopar.models import get_train_step

    return get_train_step("gpt", "tiny").lower()


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat_line[stat_line.rindex(")") + 2 :].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="looks for the processes in /proc (Linux)")
@pytest.mark.parametrize("signal_number, status", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_killed_hlopar_opt_leaves_no_process(signal_number, status, tmp_path):
    """SIGTERM or SIGKILL to hlopar-opt alone (not its process group, as `kill PID` does) while
    stage construction solves layer ILPs in forked workers (the zoo's tiny GPT on 8 x 8: minutes
    of planning): the isolated child and its workers die with it, at once. SIGTERM: hlopar-opt
    ends its child and exits 143; SIGKILL: the kernel ends them (`processes.die_with_parent`)."""
    step = tmp_path / "gpt.mlir"
    step.write_text(_tiny_gpt_step())
    command = [
        sys.executable,
        "-m",
        "hlopar.cli.opt",
        str(step),
        "-o",
        str(tmp_path / "out.mlir"),
        "-p",
        "builtin.module(hlopar-import,hlopar-stage-construction{schedule=1f1b num-hosts=8 devices-per-host=8 workers=2})",
    ]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while process.poll() is None and time.monotonic() < deadline and not workers:
            children = _children(process.pid)
            workers = {w for c in children for w in _children(c)}
            seen |= children | workers
            time.sleep(0.02)
        assert process.poll() is None, "hlopar-opt ended before its layer-ILP workers could be seen"
        assert seen and workers
        process.send_signal(signal_number)
        assert process.wait(timeout=10) == status
        gone_by = time.monotonic() + 3
        while any(_alive(pid) for pid in seen) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not [pid for pid in seen if _alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
        for pid in seen:  # only if the test failed: the processes it started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
