"""`ir.output.write_output`: a regular file is replaced whole by a rename, a device or a pipe
is written into and stays what it was (issue 25: `-o /dev/null` as root replaced /dev/null)."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from hlopar.ir.output import output_problem, write_output


def test_regular_file_is_replaced_whole_keeping_its_mode(tmp_path):
    path = tmp_path / "out.mlir"
    path.write_text("previous")
    path.chmod(0o640)
    write_output(path, "new")
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["out.mlir"]  # no staging file left


def test_new_file_gets_the_umask_mode(tmp_path):
    umask = os.umask(0o027)
    try:
        write_output(tmp_path / "new.json", b"{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


def test_symlink_is_followed_and_stays(tmp_path):
    (tmp_path / "target").write_text("old")
    (tmp_path / "link").symlink_to("target")
    write_output(tmp_path / "link", "new")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target").read_text() == "new"


def test_fifo_is_written_into(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, b"module {}\n")
    reader.join(timeout=10)
    assert received == [b"module {}\n"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_pipe_through_proc_fd_is_written_into():
    # /dev/stdout is a link to /proc/self/fd/1, whose own link names no real path ("pipe:[...]").
    read_end, write_end = os.pipe()
    try:
        write_output(f"/proc/self/fd/{write_end}", b"report\n")
        os.close(write_end)
        assert os.read(read_end, 100) == b"report\n"
    finally:
        os.close(read_end)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a character device (a copy of /dev/null) needs root"
)
def test_character_device_is_written_into(tmp_path):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_output(node, "module {}\n")
    assert stat.S_ISCHR(node.lstat().st_mode) and node.lstat().st_rdev == os.makedev(1, 3)
    assert os.listdir(tmp_path) == ["null"]


def test_output_problems(tmp_path):
    assert output_problem("-") is None
    assert output_problem(tmp_path / "new.mlir") is None
    assert output_problem(tmp_path) == "cannot write output: is a directory"
    assert "does not exist" in output_problem(tmp_path / "missing" / "out.mlir")
