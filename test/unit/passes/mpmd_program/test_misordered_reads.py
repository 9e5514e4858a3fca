"""`mpmd_program.misordered_reads`: the reads no pipeline schedule can run (forward stages in
order, then backward stages in reverse, then the updates), on small op lists."""

from __future__ import annotations

from hlopar.passes.mpmd_program import misordered_reads

F, B, U = "forward", "backward", "update"


def test_reads_along_the_pipeline_are_accepted():
    # forward 0 -> forward 1 -> backward 1 -> backward 0 (which reads forward 1 too) -> update 1.
    reads = [set(), {0}, {1}, {2, 1, 0}, {3, 2}]
    assert misordered_reads(reads, [0, 1, 1, 0, 1], [F, F, B, B, U], [False] * 5) == []


def test_reads_against_the_pipeline_are_found():
    ops = [
        (1, F, set()),
        (0, F, {0}),  # forward 0 reads forward 1
        (0, B, {1}),
        (1, B, {2}),  # backward 1 reads backward 0
        (0, F, {2}),  # a forward reads a backward value
        (0, U, {3}),
        (0, B, {5}),  # a backward reads an update
        (0, B, set()),  # a constant, copied where read: never late
        (1, B, {7}),
    ]
    stages, roles, reads = zip(*ops)
    floating = [i == 7 for i in range(len(ops))]
    assert misordered_reads(reads, stages, roles, floating) == [(1, 0), (3, 2), (4, 2), (6, 5)]
