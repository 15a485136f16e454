"""benchmarks/scaling/shared_pool.py's arithmetic on synthetic figures: shares, ratios, the sync p95, the cross-run
audit, and the per-run counters read back from the exposition the proxy renders (no vLLM here)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.scaling import shared_pool_figures as fig
from proxy.metrics import _per_run

WEIGHTS = {"run-a": 1.0, "run-b": 1.0, "run-c": 2.0}


def test_tokens_in_proportion_to_the_weights_are_each_runs_fair_share():
    assert fig.fair_fractions(WEIGHTS) == {"run-a": 0.25, "run-b": 0.25, "run-c": 0.5}
    assert fig.share_vs_weight({"run-a": 250, "run-b": 250, "run-c": 500}, WEIGHTS) == pytest.approx(
        {"run-a": 1.0, "run-b": 1.0, "run-c": 1.0}
    )
    # run-a took 30 % where 25 % was its due, run-b 20 %: 1.2 and 0.8, the edges of the goal's band
    share = fig.share_vs_weight({"run-a": 300, "run-b": 200, "run-c": 500}, WEIGHTS)
    assert share == pytest.approx({"run-a": 1.2, "run-b": 0.8, "run-c": 1.0})
    # a run the proxy never counted served nothing; nothing served at all gives no share
    assert fig.share_vs_weight({"run-a": 500, "run-c": 500}, WEIGHTS)["run-b"] == 0.0
    assert fig.share_vs_weight({}, WEIGHTS) == {"run-a": None, "run-b": None, "run-c": None}
    with pytest.raises(ValueError, match="add up"):
        fig.fair_fractions({"run-a": 0.0})


def test_throughput_goal_is_a_floor_on_each_runs_fair_fraction_of_its_alone_figure():
    shared = {"run-a": 20.0, "run-b": 21.0, "run-c": 40.0}
    alone = {"run-a": 100.0, "run-b": 100.0, "run-c": 100.0}
    vs = fig.ratios(shared, alone)
    assert vs == pytest.approx({"run-a": 0.2, "run-b": 0.21, "run-c": 0.4})
    assert fig.throughput_met(vs, WEIGHTS)  # floors 0.2, 0.2, 0.4
    assert not fig.throughput_met({**vs, "run-c": 0.39}, WEIGHTS)  # run-c below 0.8 x 1/2
    assert not fig.throughput_met({"run-a": 0.3, "run-b": 0.3}, WEIGHTS)  # run-c not measured: not met
    assert fig.ratios({"run-a": 5.0, "run-b": None}, {"run-a": 0.0, "run-b": 1.0}) == {"run-a": None, "run-b": None}


def test_sync_ratio_pools_every_runs_versions_and_keeps_each_runs_own():
    assert fig.percentile([], 95) is None
    assert fig.percentile(range(1, 21), 95) == 19  # nearest rank: the 19th of 20
    assert fig.percentile([3.0], 50) == 3.0
    shared = {"run-a": [2.0] * 19 + [6.0], "run-b": [3.0] * 20}
    alone = {"run-a": [2.0] * 10, "run-b": [2.0] * 9 + [4.0]}
    sync = fig.sync_figures(shared, alone)
    # pooled: 40 shared versions, the 38th is 3.0; 20 alone, the 19th is 2.0
    assert sync["pooled"] == {
        "shared_p95_s": 3.0,
        "alone_p95_s": 2.0,
        "versions_shared": 40,
        "versions_alone": 20,
        "p95_vs_alone": 1.5,
    }
    assert sync["per_run"]["run-a"]["p95_vs_alone"] == 1.0  # 2.0 / 2.0: the one slow version is the 20th
    assert sync["per_run"]["run-b"]["p95_vs_alone"] == 0.75
    assert fig.sync_figures({"run-a": [1.0]}, {})["pooled"]["p95_vs_alone"] is None


def test_the_audit_counts_only_another_runs_adapters_as_cross_run_uses():
    runs = ["run-a", "run-a2", "run-c"]
    pairs = [
        ("run-a", "run-a-v000003"),  # its own
        ("run-a", "base"),
        ("run-a", "run-a2-v000003"),  # run-a2's adapter, although run-a's id is a prefix of it
        ("run-c", "run-a-v000001"),
        ("run-c", "run-c-v000010"),
        ("run-c", ""),  # no model recorded
        ("run-c", "some-other-model"),
    ]
    audit = fig.cross_run_uses(pairs, runs, "base")
    assert audit == {
        "checked": 7,
        "own": 2,
        "base": 1,
        "unrecorded": 1,
        "uses": 2,
        "unknown": 1,
        "by_pair": {"run-a<-run-a2": 1, "run-c<-run-a": 1},
    }


def _rendered(runs: dict[str, dict[str, float]]) -> str:
    """The per-run families exactly as the proxy's /metrics renders them."""

    class Runs:
        def collect(self):
            yield from _per_run(runs)

    registry = CollectorRegistry()
    registry.register(Runs())
    return generate_latest(registry).decode()


def test_served_tokens_per_run_are_read_from_the_proxys_exposition():
    before = _rendered({"run-a": {"tokens": 100.0, "requests": 2, "waiting": 5, "weight": 1.0}})
    after = _rendered(
        {
            "run-a": {"tokens": 1100.0, "requests": 12, "waiting": 3, "weight": 1.0},
            "run-c": {"tokens": 2000.5, "requests": 20, "waiting": 9, "weight": 2.0},
        }
    )
    assert fig.per_run_counter(after, fig.SERVED_TOKENS) == {"run-a": 1100.0, "run-c": 2000.5}
    assert fig.per_run_counter(after, "brigade_proxy_run_waiting_requests") == {"run-a": 3.0, "run-c": 9.0}
    tokens = fig.deltas(fig.per_run_counter(before, fig.SERVED_TOKENS), fig.per_run_counter(after, fig.SERVED_TOKENS))
    assert tokens == {"run-a": 1000.0, "run-c": 2000.5}  # run-c was not counted before: from 0
    requests = fig.deltas(
        fig.per_run_counter(before, fig.SERVED_REQUESTS), fig.per_run_counter(after, fig.SERVED_REQUESTS)
    )
    assert requests == {"run-a": 10.0, "run-c": 20.0}


def test_goals_follow_the_issues_bounds():
    met = {
        "share_vs_weight": {"run-a": 0.8, "run-b": 1.2, "run-c": 1.0},
        "throughput_vs_alone": {"run-a": 0.2, "run-b": 0.25, "run-c": 0.45},
        "sync_p95_vs_alone": 1.5,
        "cross_run_uses": 0,
        "cross_run_audit": {"checked": 10, "unrecorded": 0},
        "refused_over_capacity": True,
    }
    assert fig.goals(met, WEIGHTS) == {
        "share_vs_weight": True,
        "throughput_vs_alone": True,
        "sync_p95_vs_alone": True,
        "cross_run_uses": True,
        "refused_over_capacity": True,
    }
    missed = {
        **met,
        "share_vs_weight": {"run-a": 0.79, "run-b": 1.2, "run-c": 1.0},
        "sync_p95_vs_alone": 1.51,
        "cross_run_audit": {"checked": 10, "unrecorded": 1},  # a sample that names no model proves nothing
        "refused_over_capacity": False,
    }
    goals = fig.goals(missed, WEIGHTS)
    assert goals == {
        "share_vs_weight": False,
        "throughput_vs_alone": True,
        "sync_p95_vs_alone": False,
        "cross_run_uses": False,
        "refused_over_capacity": False,
    }
    assert not fig.goals({**met, "sync_p95_vs_alone": None}, WEIGHTS)["sync_p95_vs_alone"]
    assert not fig.goals({**met, "cross_run_audit": {"checked": 0}}, WEIGHTS)["cross_run_uses"]
