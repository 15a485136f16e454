"""`brigade summary` says how many replies looked like a tool call but gave none (the worker's tool_call_unparsed
events, rollout_worker/environments/groups.py), with the first reason: a model that writes its calls in another
format than the one the run chose shows up in the summary instead of as episodes that end after one reply."""

from __future__ import annotations

from bucket import events
from bucket.store import Store
from infra.summary import episode_lines, summarize
from tests.infra.episode_run import environment_run


def test_unparsed_tool_calls_are_counted_and_named_in_the_summary(tmp_path):
    store = environment_run(Store(str(tmp_path / "bucket")))
    ev = events.EventLog(store, "rollout_worker", "rollout-0-events")
    reasons = ["a <tool_call> block that is not JSON (Expecting value at character 0)", "no closing </tool_call>"]
    for i, reason in enumerate(reasons):
        ev.emit(events.TOOL_CALL_UNPARSED, episode=f"p1-x-{i}", prompt_id="p1", format="hermes", reason=reason)
    summary = summarize(store)
    assert summary["tool_calls_unparsed"] == 2
    assert summary["tool_call_unparsed_example"] == f"hermes: {reasons[0]}"
    lines = episode_lines(summary)
    assert len(lines) == 2 and "2 replies looked like a tool call" in lines[1] and reasons[0] in lines[1]
    assert "--rollout.tool-call-format" in lines[1]


def test_a_run_whose_calls_all_parsed_has_no_unparsed_line(tmp_path):
    summary = summarize(environment_run(Store(str(tmp_path / "bucket"))))
    assert summary["tool_calls_unparsed"] == 0 and summary["tool_call_unparsed_example"] == ""
    assert len(episode_lines(summary)) == 1
