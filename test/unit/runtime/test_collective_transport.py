"""The collective transport's order and bytes (`runtime.collective_transport`), without Ray.

Its order is checked by running the streams with collectives that block (a collective
runs only when its sender's stream has posted its boxes and every process of it has done
all its earlier collectives, each process taking its own in the order given): every
schedule's streams finish under `collective_order`, and the checker itself is shown to
catch an order that deadlocks. Values moved once are ordered as the updates read them
(not a hand-over inside a mesh, nor an argument's copy). The bytes a collective carries come back bit for bit in
every element type. `tools/bench_cross_mesh.py --measure` carries a paper case out between
worker processes with every plan and transport (its receivers check their shards). The
transport on Ray workers: test_ray_runtime.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tools_module import load_tool

from hlopar.analysis.schedules import ONE_STAGE_SCHEDULES, PipelineTopology, build_streams
from hlopar.analysis.schedules.instructions import RECV, SEND, MeshStream
from hlopar.codegen.pipeline_program import UPDATE, ProgramTransfer, ProgramValue
from hlopar.runtime.collective_transport import as_bytes, collective_order, from_bytes, moved_once, moved_once_order


def named_streams(topology: PipelineTopology, schedule: str, microbatches: int) -> list[MeshStream]:
    """`build_streams`' streams with each SEND carrying one transfer named after it (a
    program binds the real ones), its RECV naming the same."""
    streams = build_streams(topology, schedule, microbatches).streams
    sends = {i.id for s in streams for i in s.instructions if i.op == SEND}
    out = []
    for stream in streams:
        instructions = []
        for inst in stream.instructions:
            if inst.op == SEND:
                inst = replace(inst, transfers=(inst.id,))
            elif inst.op == RECV:
                inst = replace(inst, transfers=tuple(d for d in inst.deps if d in sends))
            instructions.append(inst)
        out.append(replace(stream, instructions=tuple(instructions)))
    return out


def finishes_with_blocking_collectives(streams: list[MeshStream], order: list[tuple[str, int | None]]) -> bool:
    """Whether the streams finish when each transfer is a collective of its two meshes that
    each mesh's collective thread runs in `order` (module docstring), a SEND only posting and
    a RECV waiting for its collective."""
    sender = {name: s.mesh for s in streams for i in s.instructions if i.op == SEND for name in i.transfers}
    receiver = {name: s.mesh for s in streams for i in s.instructions if i.op == RECV for name in i.transfers}
    queue = {s.mesh: [key for key in order if s.mesh in (sender[key[0]], receiver[key[0]])] for s in streams}
    posted, collected = set(), set()
    cursors = {s.mesh: 0 for s in streams}
    done: set[str] = set()
    while True:
        progressed = False
        for s in streams:
            while cursors[s.mesh] < len(s.instructions):
                inst = s.instructions[cursors[s.mesh]]
                if inst.op == RECV and not all((t, inst.microbatch) in collected for t in inst.transfers):
                    break
                if not all(d in done or d.rpartition(":")[0] != s.mesh for d in inst.deps):
                    break
                if inst.op == SEND:
                    posted.update((t, inst.microbatch) for t in inst.transfers)
                done.add(inst.id)
                cursors[s.mesh] += 1
                progressed = True
        for key in order:  # a collective runs when it heads both its meshes' queues and is posted
            if key in collected:
                continue
            meshes = (sender[key[0]], receiver[key[0]])
            if key in posted and all(queue[m] and queue[m][0] == key for m in meshes):
                for m in meshes:
                    queue[m].pop(0)
                collected.add(key)
                progressed = True
        if all(cursors[s.mesh] == len(s.instructions) for s in streams):
            return True
        if not progressed:
            return False


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(1, 8), st.sampled_from(ONE_STAGE_SCHEDULES))
def test_every_schedule_finishes_with_blocking_collectives(stages, microbatches, schedule):
    streams = named_streams(PipelineTopology.chain(stages, 10**6, 10**6), schedule, microbatches)
    order = collective_order(streams)
    sends = [(t, i.microbatch) for s in streams for i in s.instructions if i.op == SEND for t in i.transfers]
    assert sorted(order, key=str) == sorted(sends, key=str)  # each SEND's transfers, once
    for stream in streams:  # each stream's SENDs in its own order
        mine = [(t, i.microbatch) for i in stream.instructions if i.op == SEND for t in i.transfers]
        assert [key for key in order if key in set(mine)] == mine
    assert finishes_with_blocking_collectives(streams, order)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_chunked_schedules_finish_with_blocking_collectives(schedule):
    """Two meshes holding two stages each (the transfers between a mesh's own stages are no
    SENDs)."""
    topology = PipelineTopology.chain(4, 10**6, 10**6)
    placed = ["m1", "m2", "m1", "m2"] if schedule == "interleaved-1f1b" else ["m1", "m2", "m2", "m1"]
    topology = replace(topology, meshes=tuple(placed))
    streams = named_streams(topology, schedule, 4)
    assert finishes_with_blocking_collectives(streams, collective_order(streams))


def test_the_checker_catches_an_order_that_deadlocks():
    """All gradients first: the last stage's thread waits to send gradient 0 while its
    stream waits for activation 0, which comes later in that order."""
    streams = named_streams(PipelineTopology.chain(2, 10**6, 10**6), "1f1b", 4)
    order = collective_order(streams)
    backwards = sorted(order, key=lambda key: not key[0].startswith("m2:"))
    assert backwards != order and not finishes_with_blocking_collectives(streams, backwards)


@pytest.mark.parametrize(
    "element, dtype",
    [
        ("f32", np.float32),
        ("bf16", ml_dtypes.bfloat16),
        ("f16", np.float16),
        ("f64", np.float64),
        ("i1", np.bool_),
        ("i32", np.int32),
        ("ui8", np.uint8),
        ("i64", np.int64),
    ],
)
def test_a_box_travels_as_its_bytes_bit_for_bit(element, dtype):
    rng = np.random.default_rng(0)
    box = rng.standard_normal((3, 5)) * 100
    box = (box > 0) if dtype is np.bool_ else box.astype(dtype)
    if np.issubdtype(np.dtype(dtype), np.floating) and np.dtype(dtype).itemsize >= 4:
        box[0, :3] = [-0.0, np.nan, np.inf]
    data = as_bytes(box[:, 1:4])  # a strided view: its elements, not its buffer
    assert data.dtype == np.uint8 and data.nbytes == 9 * np.dtype(dtype).itemsize
    back = from_bytes(data, element, (3, 3))
    assert back.dtype == np.dtype(dtype) and back.shape == (3, 3)
    assert back.tobytes() == np.ascontiguousarray(box[:, 1:4]).tobytes()


def test_bench_measures_a_paper_case_between_workers(ray_cluster):
    """Case 5 (S1RR -> S0RR between two 2x4 meshes: 4 workers, ops from both hosts of the
    source to both of the destination), tensor / 64: every plan over both transports,
    arrived whole (`measure` raises where a receiver's shards differ from the source)."""
    bench = load_tool("bench_cross_mesh")
    rows = bench.measure(["case5"], scale=64, repeat=1, preset="cpu")
    assert [(r["method"], r["transport"]) for r in rows] == [
        (m, t) for m in bench.MEASURED_METHODS for t in bench.TRANSPORT_NAMES
    ]
    assert all(r["workers"] == 4 and r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    # every destination device receives its half of the tensor: 8 x 1/2 x 16x16x512 fp16
    assert {r["bytes_moved"] for r in rows} == {8 * 16 * 16 * 512 * 2 // 2}
    assert "| case5 |" in bench.measured_table(rows)


def _program(updates_read: dict[str, tuple[int, ...]]):
    """Two meshes. Values: 0 an argument on m0; 1 a gradient summed over microbatches on m1
    (a backward's); 2 its move to m0 (t0); 3 m0's update result; 4 its move to m1 (t1);
    5 m1's update result; 6 the argument's copy on m1 (t2); 7 a hand-over of 3 between two
    stages of m0 (t3); 8 m1's update result moved to m0 (t4). `updates_read`: what each
    mesh's update reads."""
    values = [
        ProgramValue("m0", False, 4, argument=0),
        ProgramValue("m1", True, 4, accumulated=True, producer=0),
        ProgramValue("m0", True, 4, transfer=0),
        ProgramValue("m0", False, 4, producer=1),
        ProgramValue("m1", False, 4, transfer=1),
        ProgramValue("m1", False, 4, producer=2),
        ProgramValue("m1", False, 4, transfer=2),
        ProgramValue("m0", False, 4, transfer=3),
        ProgramValue("m0", False, 4, transfer=4),
    ]
    transfers = [
        ProgramTransfer(0, "t0", 1, 2, "m1", "m0", 4),
        ProgramTransfer(1, "t1", 3, 4, "m0", "m1", 4),
        ProgramTransfer(2, "t2", 0, 6, "m0", "m1", 4),
        ProgramTransfer(3, "t3", 3, 7, "m0", "m0", 4),
        ProgramTransfer(4, "t4", 5, 8, "m1", "m0", 4),
    ]
    fragments = [
        SimpleNamespace(role="backward", mesh="m1", operands=()),
        SimpleNamespace(role=UPDATE, mesh="m0", operands=updates_read["m0"]),
        SimpleNamespace(role=UPDATE, mesh="m1", operands=updates_read["m1"]),
    ]
    return SimpleNamespace(
        values=values, transfers=transfers, fragments=fragments, meshes=("m0", "m1"), results=(3, 5, 7)
    )


def test_values_moved_once_are_ordered_as_the_updates_read_them():
    """m0's update reads the moved sum (t0), m1's reads m0's update result (t1) and the
    argument's copy (t2, the driver's): t0 then t1; the hand-over t3 (a result of m0) and
    the copy are no collectives."""
    program = _program({"m0": (0, 2), "m1": (4, 6)})
    assert moved_once_order(program) == [("t0", None), ("t1", None)]
    assert [moved_once(program, t) for t in program.transfers] == [True, True, False, False, True]


def test_updates_that_wait_for_each_other_have_no_order():
    """m0's update reads m1's update result (t4), m1's reads m0's (t1)."""
    with pytest.raises(RuntimeError, match="wait for each other"):
        moved_once_order(_program({"m0": (8,), "m1": (4,)}))
