"""`schedule="auto"` end to end: the planning pipeline (`plan_step`, `parallelize`'s planning)
chooses the schedule and the number of microbatches with the stages, codegen builds the
program for the schedule chosen (its backwards split into B and W where it splits them), and
one step under the chosen schedule's streams equals the step on one device.

On 2 hosts x 4 CPU devices: the tiny MLP at 4 microbatches (two stages, a schedule that splits
backwards: eager-1f1b-wd, tied with zb-h2, where the transfers dominate), and the tiny GPT
with the count left to the planner (`heavy`, ~40 s on 2 cores: zb-h2, 4 microbatches); the plan
says what it chose (`plan.json`'s stages.schedule_choice, the plan summary) and the runner-up
with its simulated step time. Left the count, the tiny MLP is planned again at one microbatch
on one stage: the pipeline's own prediction (one step of the whole batch on 8 devices beats
two stages' transfers).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from numerics import assert_step_close

from hlopar.analysis.schedules import SCHEDULES
from hlopar.api import Cluster, describe_plan, plan_step
from hlopar.ir.diagnostics import Diagnostic, DiagnosticError
from hlopar.models import get_train_step
from hlopar.runtime.local_executor import PipelinedStep

CLUSTER = Cluster.local(num_hosts=2, devices_per_host=4, device_kind="cpu").resolved()


def lowered(model: str):
    step = get_train_step(model, "tiny")
    return step, jax.jit(step.step, keep_unused=True).lower(*step.abstract_args()).as_text()


@pytest.mark.parametrize(
    "model, microbatches", [("mlp", 4), pytest.param("gpt", None, marks=pytest.mark.heavy)], ids=["mlp-B4", "gpt"]
)
def test_auto_schedule_plans_and_runs_equal_to_one_device(tmp_path, monkeypatch, model, microbatches):
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    step, text = lowered(model)
    planned = plan_step(text, CLUSTER, schedule="auto", num_microbatches=microbatches)

    report = planned.plan["stages"]
    choice = report["schedule_choice"]
    assert planned.schedule.name == report["schedule"] == choice["chosen"]["schedule"] in SCHEDULES
    assert planned.program.microbatches == report["microbatches"] == choice["chosen"]["microbatches"]
    assert planned.program.split_backward == planned.schedule.split_backward
    if microbatches is not None:
        assert planned.program.microbatches == microbatches
    assert len(planned.program.meshes) >= 2, "the plan does not pipeline: the test would prove less"
    runner_up = choice["runner_up"]
    assert runner_up["schedule"] != choice["chosen"]["schedule"]
    assert runner_up["simulated_step_seconds"] >= choice["chosen"]["simulated_step_seconds"]
    summary = describe_plan(planned)
    assert f"schedule {planned.schedule.name}" in summary and f"runner-up {runner_up['schedule']}" in summary

    params = step.init(jax.random.PRNGKey(0))
    state, batch = step.init_opt_state(params), step.make_batch(jax.random.PRNGKey(1))
    outputs = PipelinedStep(planned.program, planned.schedule.name)(jax.tree_util.tree_leaves((params, state, batch)))
    # Sums over microbatches in another order than one device's: rounding, no more.
    assert_step_close([np.asarray(o) for o in outputs], step.jitted_step(params, state, batch), params, rtol=1e-5)


def test_auto_plans_the_whole_batch_first_and_keeps_it_where_no_count_is_faster(tmp_path, monkeypatch):
    """Left the count, schedule=auto plans the batch whole first, prices 2, 4 and 8 beside it
    scaled down from it, and keeps it where none is predicted 5% faster: the tiny MLP on one
    stage, as `jax.jit` would run it, planned once (no second split, no second stage
    construction)."""
    from hlopar.passes import planning

    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    _, text = lowered("mlp")
    tries = []
    run_passes = planning.run_passes

    def counted(step, cluster, **options):
        tries.append(step.options.microbatches)
        return run_passes(step, cluster, **options)

    monkeypatch.setattr(planning, "run_passes", counted)
    notes = []
    planned = plan_step(text, CLUSTER, schedule="auto", log=notes.append, cache=False)
    assert tries == [1]
    assert planned.program.microbatches == 1 and len(planned.program.meshes) == 1
    choice = planned.plan["stages"]["schedule_choice"]
    assert "better_microbatches" not in choice
    assert sorted({c["microbatches"] for c in choice["candidates"]}) == [1, 2, 4, 8]
    assert planned.plan["stages"]["schedule"] == planned.schedule.name == "eager-1f1b"  # ties: the default


def _priced_faster_at(count: int, monkeypatch, *, then_seconds: float) -> list[int]:
    """Makes the first plan (the whole batch, other counts priced) report `count` predicted
    twice as fast, and the plan at that count predict `then_seconds`; the counts each try
    planned, in order."""
    from hlopar.passes import planning

    run_passes = planning.run_passes
    tries = []

    def priced(step, cluster, **options):
        tries.append(step.options.microbatches)
        planned = run_passes(step, cluster, **options)
        choice = planned.reports["stages"]["schedule_choice"]
        if options.get("other_microbatches"):
            chosen = choice["chosen"]
            choice["better_microbatches"] = {
                **chosen,
                "microbatches": count,
                "simulated_step_seconds": chosen["simulated_step_seconds"] / 2,
            }
        else:
            choice["chosen"]["simulated_step_seconds"] = then_seconds
        return planned

    monkeypatch.setattr(planning, "run_passes", priced)
    return tries


def test_auto_splits_at_the_count_it_predicts_faster_and_keeps_it_where_its_plan_is(tmp_path, monkeypatch):
    """Where a count is priced 5% faster than the whole batch, the step is split at it and
    planned again, and that plan kept where its own simulated step is faster, saying so."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    _, text = lowered("mlp")
    tries = _priced_faster_at(4, monkeypatch, then_seconds=1e-9)
    notes = []
    planned = plan_step(text, CLUSTER, schedule="auto", log=notes.append, cache=False)
    assert tries == [1, 4]
    assert planned.program.microbatches == planned.plan["stages"]["microbatches"] == 4
    assert any(
        note.startswith("4 microbatch(es), not the 1 of the first split (schedule=auto): predicted") for note in notes
    ), notes


def test_a_count_priced_faster_but_planned_slower_is_not_taken(tmp_path, monkeypatch):
    """The price of another count comes from the first plan's (the whole batch's) layers,
    scaled: an estimate. Planned at that count, the step is kept only where its own
    simulated step is faster than the first plan's; here the second plan is made to predict
    slower, and the whole batch stays, saying why."""
    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    _, text = lowered("mlp")
    tries = _priced_faster_at(4, monkeypatch, then_seconds=1e9)
    notes = []
    planned = plan_step(text, CLUSTER, schedule="auto", log=notes.append, cache=False)
    assert tries == [1, 4]
    assert planned.program.microbatches == 1, notes
    assert any("planned at 1e+12 ms, not under the 1 microbatches'" in note and "kept 1" in note for note in notes), (
        notes
    )


def test_where_the_whole_batch_fits_no_plan_the_policys_count_is_planned(tmp_path, monkeypatch):
    """Where no plan of the whole batch fits the memory, schedule=auto plans the policy's
    count (4 here) instead, its other counts priced from its microbatch."""
    from hlopar.passes import planning

    monkeypatch.setenv("HLOPAR_CACHE_DIR", str(tmp_path))
    _, text = lowered("mlp")
    run_passes = planning.run_passes
    tries = []

    def whole_batch_does_not_fit(step, cluster, **options):
        tries.append((step.options.microbatches, options.get("other_microbatches", False)))
        if step.options.microbatches == 1:
            raise DiagnosticError([Diagnostic("error", f"{planning._NO_FIT} the cluster: B=1: out of memory", None)])
        return run_passes(step, cluster, **options)

    monkeypatch.setattr(planning, "run_passes", whole_batch_does_not_fit)
    planned = plan_step(text, CLUSTER, schedule="auto", cache=False)
    assert tries[:2] == [(1, True), (4, True)] and all(count != 1 for count, _ in tries[1:]), tries
    assert planned.program.microbatches > 1
