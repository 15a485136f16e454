"""The dashboard's Episodes section (issue 30, item 8) on a bucket written through the real writers
(tests/infra/episode_run.py: episode shards and env_failed events): the figures agree with `brigade summary`,
`/api/episodes` holds the turns distribution and the last errors, refreshes count each record once, and a
single-turn run shows none of it. The page is checked as the server renders it (its data-metric figures);
the headless-Chromium tests of test_dashboard.py need a real run, which an environment run's minute of vLLM
would add to CI for no page code the parse here misses."""

from __future__ import annotations

import json
from html.parser import HTMLParser

from rich.console import Console

from bucket import events
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import Sample, ShardWriter, Turn
from bucket.store import Store
from infra import audit
from infra.dashboard import page, terminal
from infra.dashboard.data import RunData
from infra.dashboard.server import Dashboard
from infra.summary import summarize
from tests.infra.episode_run import environment_run, episode, group

EPISODE_KEYS = ("episodes", "turns_mean", "tool_calls_mean", "env_errors", "episode_tokens_mean")


class _Metrics(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, object] = {}
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-metric" in a:
            self.values[a["data-metric"]] = json.loads(a["data-value"])
        if "id" in a:
            self.ids.add(a["id"])


def _api(dash: Dashboard, path: str) -> dict:
    status, ctype, body = dash.render(path)
    assert status == 200 and ctype == "application/json", body
    return json.loads(body)


def test_episodes_figures_agree_with_brigade_summary_and_the_api_holds_the_rest(tmp_path):
    store = environment_run(Store(str(tmp_path / "b")))
    dash = Dashboard(store)
    expected = summarize(store)
    assert {k: _api(dash, "/api/summary")[k] for k in EPISODE_KEYS} == {k: expected[k] for k in EPISODE_KEYS}
    eps = _api(dash, "/api/episodes")
    assert eps["episodes"] == 7 and eps["turns_mean"] == 12 / 7 and eps["env_errors"] == 2
    assert eps["turns_distribution"] == {"1": 2, "2": 5}
    assert eps["tool_calls_distribution"] == {"0": 6, "1": 1}
    assert eps["episodes_moved_replica"] == 1 and eps["finish_reasons"] == {"done": 7}
    assert eps["env_errors_by_call"] == {"step": 2}
    assert [e["error"] for e in eps["last_errors"]] == [
        "ValueError: step 0 got nonsense",
        "ValueError: step 1 got nonsense",
    ]
    assert {e["episode"] for e in eps["last_errors"]} == {"p3-abc-0", "p3-abc-1"}

    # the page shows the same figures, and the last errors' text
    html = page.panels(dash.data)
    parsed = _Metrics()
    parsed.feed(html)
    assert "episodes" in parsed.ids
    assert {k: parsed.values[k] for k in EPISODE_KEYS} == {k: expected[k] for k in EPISODE_KEYS}
    assert "ValueError: step 1 got nonsense" in html

    # and the terminal, in one line
    console = Console(record=True, width=400)
    console.print(terminal.render(dash.data))
    text = console.export_text()
    assert "episodes 7, turns 1.71 mean (1: 2, 2: 5), tool calls 0.14 mean, env errors 2" in text, text
    assert "step: ValueError: step 1 got nonsense" in text


def test_a_refresh_counts_only_what_is_new(tmp_path):
    store = environment_run(Store(str(tmp_path / "b")))
    data = RunData(store)
    data.refresh()
    data.refresh()  # nothing new: nothing counted twice
    assert data.episodes.figures()["episodes"] == 7 and data.episodes.errors == 2
    ShardWriter(store, "rollout-0").write([group("p9", [episode([(0, 2, 0, "r0")], 2)] * 2)])
    events.EventLog(store, "rollout_worker", "rollout-0-events").emit(
        events.ENV_FAILED, episode="p9-x-0", prompt_id="p9", call="reset", error="TimeoutError: reset", version=0
    )
    data.refresh()
    expected = summarize(store)
    assert {k: data.summary()[k] for k in EPISODE_KEYS} == {k: expected[k] for k in EPISODE_KEYS}
    assert expected["episodes"] == 9 and expected["env_errors"] == 3
    assert data.episodes.detail()["last_errors"][-1]["error"] == "TimeoutError: reset"


def test_a_single_turn_run_shows_no_episodes(tmp_path):
    store = Store(str(tmp_path / "b"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=2), "test")
    one = Sample(completion_ids=[1, 2], logprobs=[-0.1, -0.2], text="4", reward=1.0, replica="r0")
    ShardWriter(store, "rollout-0").write([group("p", [one, one])])
    dash = Dashboard(store)
    assert not set(EPISODE_KEYS) & set(_api(dash, "/api/summary")) and _api(dash, "/api/episodes") == {}
    assert "id='episodes'" not in page.panels(dash.data)
    console = Console(record=True, width=400)
    console.print(terminal.render(dash.data))
    assert "env errors" not in console.export_text()


def test_a_reply_split_by_a_version_switch_is_not_an_episode(tmp_path):
    """With --rollout.switch-after a single reply can carry `turns` (one span per version that sampled it) but
    no loss mask: the summary, the dashboard and the audit count no episode of it (rollout_worker/switch.py)."""
    store = Store(str(tmp_path / "b"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=2), "test")
    switched = Sample(
        completion_ids=[1, 2, 3, 4],
        logprobs=[-0.1, -0.2, -0.3, -0.4],
        turns=[Turn(start=0, end=2, version=0, replica="r0"), Turn(start=2, end=4, version=1, replica="r0")],
        text="4",
        reward=1.0,
        replica="r0",
    )
    assert not switched.is_episode
    ShardWriter(store, "rollout-0").write([group("p", [switched, switched])])
    dash = Dashboard(store)
    assert not set(EPISODE_KEYS) & set(_api(dash, "/api/summary")) and _api(dash, "/api/episodes") == {}
    assert audit.episodes({"s#0": group("p", [switched, switched])})["episodes"] == 0
