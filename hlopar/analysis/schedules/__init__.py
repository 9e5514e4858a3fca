"""Pipeline schedules, per-mesh instruction streams and their discrete-event simulator.

Pure functions over plain data (no MLIR): a `PipelineTopology` (stages, the bytes each sends
to which, stash sizes) and a schedule from `SCHEDULES` give `build_streams`' per-mesh
instruction streams; `simulate` runs them against stage costs and a communication model, and
`Timeline.of` takes the result's timeline, which `draw_timeline` draws and `chrome_trace` writes
for Perfetto.
"""

from hlopar.analysis.schedules.costs import ZERO_COST, AlphaBeta, HostComm, HostThread, StageCost, signal
from hlopar.analysis.schedules.instructions import (
    ACCUMULATE,
    FREE,
    RECV,
    RUN,
    SEND,
    UPDATE,
    Instruction,
    MeshStream,
    PipelineStreams,
    build_streams,
)
from hlopar.analysis.schedules.registry import (
    AUTO_SCHEDULE,
    DEFAULT_SCHEDULE,
    ONE_STAGE_SCHEDULES,
    PLANNED_SCHEDULES,
    SCHEDULES,
    ScheduleName,
    ScheduleOption,
    UnknownScheduleError,
    get_schedule,
)
from hlopar.analysis.schedules.simulator import DeadlockError, Event, SimResult, iteration_lower_bound, simulate
from hlopar.analysis.schedules.tasks import LOOP, V_SHAPE, Schedule, Task, max_in_flight, max_stashes, stage_placement
from hlopar.analysis.schedules.timeline import Timeline, chrome_trace, draw_timeline, write_chrome_trace
from hlopar.analysis.schedules.topology import Edge, PipelineTopology

__all__ = [
    "ACCUMULATE",
    "FREE",
    "RECV",
    "RUN",
    "SEND",
    "UPDATE",
    "ZERO_COST",
    "AUTO_SCHEDULE",
    "AlphaBeta",
    "DEFAULT_SCHEDULE",
    "DeadlockError",
    "ONE_STAGE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "Edge",
    "Event",
    "HostComm",
    "HostThread",
    "LOOP",
    "Instruction",
    "MeshStream",
    "PipelineStreams",
    "PipelineTopology",
    "SCHEDULES",
    "Schedule",
    "ScheduleName",
    "ScheduleOption",
    "SimResult",
    "StageCost",
    "Task",
    "Timeline",
    "UnknownScheduleError",
    "V_SHAPE",
    "build_streams",
    "chrome_trace",
    "draw_timeline",
    "get_schedule",
    "iteration_lower_bound",
    "max_in_flight",
    "max_stashes",
    "signal",
    "simulate",
    "stage_placement",
    "write_chrome_trace",
]
