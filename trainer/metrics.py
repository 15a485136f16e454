"""The trainer's Prometheus metrics, served on `[trainer] metrics_host:metrics_port` at /metrics.

Names follow every brigade job's convention (proxy/metrics.py): `brigade_trainer_<what>_<unit>`, counters
ending in `_total`. Besides the series named here, every numeric field of the last `train_step` event is
a gauge under TRL's name mapped into Prometheus' alphabet (lowercased, any character outside
`[a-z0-9_]` replaced by `_`): `clip_ratio/low_mean` -> `brigade_trainer_clip_ratio_low_mean`,
`perf/tok_s` -> `brigade_trainer_perf_tok_s`. They are read from the step's dict at scrape time, so a
metric the loss adds later is exported without touching this file.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from jobkit.metrics import ScrapeCollector, ServedMetrics

PREFIX = "brigade_trainer_"
STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
PUBLISH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# Fields of a train_step event that have a series of their own (or are not a measurement).
NOT_GAUGES = frozenset({"step", "version"})


def prometheus_name(trl_name: str) -> str:
    """TRL's metric name as a brigade trainer series: `clip_ratio/low_mean` -> `brigade_trainer_clip_ratio_low_mean`."""
    return PREFIX + re.sub(r"[^a-z0-9_]", "_", trl_name.lower())


class _LastStep(ScrapeCollector):
    """Every numeric field of the last step, as gauges, read when Prometheus scrapes."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self._lock = threading.Lock()

    def update(self, step: dict[str, Any]) -> None:
        numbers = {k: float(v) for k, v in step.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        with self._lock:
            self.values = {k: v for k, v in numbers.items() if k not in NOT_GAUGES}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            values = dict(self.values)
        for name, value in sorted(values.items()):
            yield GaugeMetricFamily(prometheus_name(name), f"Last optimizer step's {name} (TRL's name).", value=value)


class TrainerMetrics(ServedMetrics):
    """What the trainer exports; a registry of its own, so several trainers can run in one test process."""

    def __init__(self) -> None:
        super().__init__("trainer")
        r = self.registry
        self.last_step = _LastStep()
        r.register(self.last_step)
        self.steps = Counter("brigade_trainer_steps", "Optimizer steps taken by this process.", registry=r)
        self.step_seconds = Histogram(
            "brigade_trainer_step_seconds", "One optimizer step, batch in hand.", buckets=STEP_BUCKETS, registry=r
        )
        self.trained_tokens = Counter(
            "brigade_trainer_trained_tokens", "Tokens through the model in training steps.", registry=r
        )
        self.trained_samples = Counter(
            "brigade_trainer_trained_samples", "Completions trained on (zero-variance groups excluded).", registry=r
        )
        self.groups_dropped = Counter(
            "brigade_trainer_groups_dropped",
            "Groups read but never trained, by reason (stale: outside max_staleness, which pacing keeps at 0).",
            ["reason"],
            registry=r,
        )
        self.wait_seconds = Counter(
            "brigade_trainer_rollout_wait_seconds",
            "Time spent waiting for rollouts (starved when it grows at close to 1 s/s).",
            registry=r,
        )
        self.waiting = Gauge(
            "brigade_trainer_waiting_for_rollouts", "1 while the trainer waits for rollout shards.", registry=r
        )
        self.version = Gauge("brigade_trainer_adapter_version", "Last adapter version published.", registry=r)
        self.published_at = Gauge(
            "brigade_trainer_last_publish_timestamp_seconds", "Wall clock of the last publish.", registry=r
        )
        self.serialize_seconds = Histogram(
            "brigade_trainer_adapter_serialize_seconds",
            "Adapter to safetensors bytes (and its canary), per publish.",
            buckets=PUBLISH_BUCKETS,
            registry=r,
        )
        self.upload_seconds = Histogram(
            "brigade_trainer_adapter_upload_seconds",
            "Adapter files and commit marker written to the bucket, per publish.",
            buckets=PUBLISH_BUCKETS,
            registry=r,
        )

    # -- what the trainer reports ------------------------------------------------------------------
    def step(self, m: dict[str, Any]) -> None:
        self.last_step.update(m)  # first: a scrape that counts this step shows its values
        self.steps.inc()
        step_s = float(m.get("perf/step_s", 0.0))
        self.step_seconds.observe(step_s)
        self.trained_tokens.inc(float(m.get("perf/tok_s", 0.0)) * step_s)
        self.trained_samples.inc(float(m.get("samples", 0)))
        for key, n in m.items():
            if key.startswith("dropped/"):  # trainer/buffer.py's reasons
                self.groups_dropped.labels(key.removeprefix("dropped/")).inc(n)

    def published(self, version: int, serialize_s: float, upload_s: float) -> None:
        self.version.set(version)
        self.published_at.set(time.time())
        self.serialize_seconds.observe(serialize_s)
        self.upload_seconds.observe(upload_s)

    @contextmanager
    def waiting_for_rollouts(self) -> Iterator[None]:
        self.waiting.set(1)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.wait_seconds.inc(time.monotonic() - t0)
            self.waiting.set(0)
