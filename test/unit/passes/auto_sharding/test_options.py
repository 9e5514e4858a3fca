"""`hlopar-auto-sharding`'s options are the planner's (`annotate.IntraOpOptions`): the pass
hands each over under its name, so both must list the same fields with the same defaults."""

from __future__ import annotations

import dataclasses

from hlopar.passes.auto_sharding import AutoShardingPass
from hlopar.passes.intra_op_plan import IntraOpOptions


def test_pass_options_are_the_planners():
    planner = {f.name: f.default for f in dataclasses.fields(IntraOpOptions)}
    pass_options = {f.name: f.default for f in AutoShardingPass.option_fields()}
    assert set(pass_options) - set(planner) == {"report"}
    assert {name: pass_options[name] for name in planner} == planner
