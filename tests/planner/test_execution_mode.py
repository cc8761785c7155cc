"""The one execution-mode value: its rules, its place in a plan's JSON, and the names its errors give."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridflow.planner import ExecutionMode, Plan, colocated_plan
from hybridflow.planner.execution import PIPELINES


def test_the_staleness_bound_is_resolved_once_on_construction() -> None:
    assert [ExecutionMode(pipeline=p).k for p in PIPELINES] == [0, 1, 1]
    assert ExecutionMode(pipeline="async", max_staleness=0).k == 0
    assert ExecutionMode(pipeline="one_step_off", max_staleness=1) == ExecutionMode(pipeline="one_step_off")


@pytest.mark.parametrize(("values", "message"), [
    ({"pipeline": "fully_async"}, r"ExecutionMode.pipeline='fully_async' must be one of \['sync', 'one_step_off'"),
    ({"pipeline": "async", "max_staleness": -1}, r"ExecutionMode.max_staleness=-1 must be an integer >= 0"),
    ({"pipeline": "sync", "max_staleness": 2}, r"ExecutionMode.max_staleness=2 with pipeline='sync'.* is 0"),
    ({"pipeline": "one_step_off", "segment_tokens": 4}, r"ExecutionMode.segment_tokens=4 with pipeline='one_step_off'"),
    ({"pipeline": "async", "segment_tokens": -1}, r"ExecutionMode.segment_tokens=-1 must be >= 0"),
    ({"stream_chunks": 0}, r"ExecutionMode.stream_chunks=0 must be >= 1"),
    ({"pipeline": "async", "stream_chunks": 2}, r"ExecutionMode.stream_chunks=2 streams within a sync step"),
])
def test_bad_values_name_the_field_and_the_fix(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionMode(**values)  # type: ignore[arg-type]


def test_checked_names_fields_as_the_caller_does() -> None:
    with pytest.raises(ValueError, match=r"^config key 'max_staleness'=-3 must be an integer >= 0"):
        ExecutionMode.checked(key=lambda name: f"config key {name!r}", pipeline="async", max_staleness=-3)


def test_segment_budget_is_the_one_default_rule() -> None:
    assert ExecutionMode(pipeline="async", segment_tokens=0).segment_budget(32) == 8  # a quarter of the budget
    assert ExecutionMode(pipeline="async", segment_tokens=0).segment_budget(3) == 1
    assert ExecutionMode(pipeline="async", segment_tokens=5).segment_budget(32) == 5
    assert ExecutionMode(pipeline="async").segment_budget(32) is None  # whole responses
    # k = 0: no update can land while a batch generates, so it generates whole, as sync does.
    assert ExecutionMode(pipeline="async", max_staleness=0, segment_tokens=2).segment_budget(32) is None


def test_a_plan_stores_the_mode_and_old_plans_still_load() -> None:
    mode = ExecutionMode(pipeline="async", max_staleness=2, segment_tokens=3)
    plan = replace(colocated_plan("grpo", ["actor"]), mode=mode)
    data = json.loads(plan.to_json())
    assert (data["pipeline"], data["max_staleness"], data["segment_tokens"]) == ("async", 2, 3)
    assert "mode" not in data and Plan.from_json(plan.to_json()) == plan
    assert (plan.pipeline, plan.max_staleness) == ("async", 2)
    # Written before the mode held the chunks: they sat in ``extra``; one_step_off recorded 0 then.
    old = {**data, "pipeline": "sync", "max_staleness": 0, "extra": {"stream_chunks": 4, "idle_fraction": 0.5}}
    del old["segment_tokens"], old["stream_chunks"]
    loaded = Plan.from_dict(old)
    assert loaded.mode == ExecutionMode(stream_chunks=4) and dict(loaded.extra) == {"idle_fraction": 0.5}
    assert Plan.from_dict({**old, "pipeline": "one_step_off", "extra": {}}).max_staleness == 1
    with pytest.raises(TypeError, match=r"Plan\.mode must be an ExecutionMode"):
        Plan(algorithm="grpo", groups=(), mode="sync")  # type: ignore[arg-type]
