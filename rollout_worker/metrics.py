"""The rollout worker's Prometheus metrics, served on `[rollout] metrics_host:metrics_port` at /metrics.

Names follow every brigade job's convention (proxy/metrics.py): `brigade_rollout_<what>_<unit>`, counters
ending in `_total`. Counters are bumped by the worker's loop; the state it is in (adapter version, groups
in flight, held back by the trainer, request retries) is read from the worker when Prometheus scrapes, so
the generation loop touches no Prometheus object for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import Counter, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bucket.rollouts import Sample
from jobkit.metrics import ScrapeCollector, ServedMetrics


class _Live(ScrapeCollector):
    """The worker's state at scrape time, from `source()` (a dict of plain numbers)."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, Any]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.source is None:
            return
        v = self.source()
        for name, doc, value in (
            ("adapter_version", "Adapter version new groups generate with (0 = the base model).", v["version"]),
            ("inflight_groups", "Prompt groups being generated now.", v["inflight"]),
            ("unconsumed_groups", "Groups scored or in flight that the trainer has not read yet.", v["unconsumed"]),
            (
                "waiting_for_trainer",
                "1 while no new group may start because the trainer has not read enough (max_unconsumed_groups, or "
                "pacing: then brigade_rollout_paced is 1 too).",
                v["waiting"],
            ),
            (
                "paced",
                "1 while no new group may start because the trainer could not train it inside max_staleness "
                "(pacing: rollout_worker/pacing.py).",
                v["paced"],
            ),
        ):
            yield GaugeMetricFamily(f"brigade_rollout_{name}", doc, value=value)
        yield CounterMetricFamily(
            "brigade_rollout_shards_written", "Rollout shards written to the bucket.", value=v["shards"]
        )
        retries = CounterMetricFamily(
            "brigade_rollout_request_retries",
            "Requests to the proxy sent again after a 5xx or no answer, by reason.",
            labels=["reason"],
        )
        for reason, n in v["retries"].items():
            retries.add_metric([reason], n)
        yield retries
        unparsed = CounterMetricFamily(
            "brigade_rollout_tool_calls_unparsed",
            "Episode replies that looked like a tool call but did not parse in the run's tool-call format, by format "
            "(each also a tool_call_unparsed event with the reason).",
            labels=["format"],
        )
        for fmt, n in v.get("tool_calls_unparsed", {}).items():
            unparsed.add_metric([fmt], n)
        yield unparsed
        # the in-flight version switch (rollout.switch_after; rollout_worker/switch.py): absent while it is off
        for key, name, doc in SWITCH_COUNTERS:
            if key in v.get("switch", {}):
                yield CounterMetricFamily(f"brigade_rollout_{name}", doc, value=v["switch"][key])


SWITCH_COUNTERS = (
    ("continued", "switch_continuations", "Completions continued as a new request at a chunk boundary."),
    ("switched", "switch_switches", "Continuations under a newer version than the one that sampled the chunk before."),
    (
        "reprefill_tokens",
        "switch_reprefill_tokens",
        "Context tokens (prompt and tokens so far) a switch made a replica compute again under the new adapter.",
    ),
)


class RolloutMetrics(ServedMetrics):
    """What the rollout worker exports; a registry of its own (several workers can live in one test process)."""

    def __init__(self) -> None:
        super().__init__("rollout")
        r = self.registry
        self.live = _Live()
        r.register(self.live)
        self.groups = Counter("brigade_rollout_groups_scored", "Prompt groups generated and scored.", registry=r)
        self.groups_failed = Counter(
            "brigade_rollout_groups_failed", "Prompt groups given up (a request failed after its retries).", registry=r
        )
        self.generated_tokens = Counter(
            "brigade_rollout_generated_tokens",
            "Tokens the model sampled in the scored groups (an episode's template, environment and tool tokens are "
            "not counted: they were not generated).",
            registry=r,
        )
        self.clipped = Counter(
            "brigade_rollout_completions_clipped",
            "Completions cut at their token limit (finish_reason 'length': max_completion_length, or an episode's "
            "room left); rate over the rate of sample_reward_count is TRL's clipped_ratio.",
            registry=r,
        )
        self.reward = Summary(
            "brigade_rollout_sample_reward",
            "Reward of each completion (mean over a window: rate of _sum / rate of _count).",
            registry=r,
        )
        self.trainer_wait_seconds = Counter(
            "brigade_rollout_trainer_wait_seconds",
            "Time paused with nothing in flight because the trainer has not read enough (backpressure).",
            registry=r,
        )

    def group(self, samples: Sequence[Sample]) -> None:
        """A scored group's samples counted: its tokens sampled, those cut at their limit, every reward."""
        self.groups.inc()
        self.generated_tokens.inc(sum(s.trained_tokens for s in samples))
        self.clipped.inc(sum(s.clipped for s in samples))
        for s in samples:
            self.reward.observe(s.reward)
