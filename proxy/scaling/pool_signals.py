"""A shared pool's signals: the attached runs' own, as their rollout workers report them, summed by weight.

A pool's bucket has no trainer, and its proxy never reads a run's bucket, so each run's rollout worker reads
the run's pace (bucket/pace.py, the reading a single-run proxy does) and sends it on every lease renewal
(bucket.pool.RunPace); the pool keeps the latest per run until the run detaches (proxy/pool/runs.py). Here
they become one look's signals for the same rule (desired.py):

* the trainers' waiting share: the runs' shares averaged by weight (sum of weight x wait over the sum of
  the weights), over the runs that report one. The replicas are shared by weight, so a run of weight 2
  waiting 30 % asks for as much more generation as two runs of weight 1 waiting 30 % would;
* the backlog in steps: averaged by weight the same way; in groups: the plain sum;
* a run that reports nothing yet (no trainer step seen, a finished trainer, a worker older than this
  contract, or one that did not renew since it attached) counts in neither: it says nothing about the pool's
  pace, as an unknown wait says nothing in a single run. No run reporting: unknown (the rule holds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from bucket.pool import RunPace


@dataclass(frozen=True)
class RunReport:
    """One admitted run as the pool's autoscaler sees it."""

    weight: float
    pace: RunPace | None  # the latest its workers reported (None: none yet)
    age_s: float | None  # since that report reached the pool


Reports = Callable[[], Mapping[str, RunReport]]


def _weighted(values: list[tuple[float, float]]) -> float | None:
    total = sum(w for w, _ in values)
    return sum(w * v for w, v in values) / total if total > 0 else None


class PoolSignals:
    """The signals source of a pool's autoscaler: in memory (nothing to poll), read at every look."""

    def __init__(self, reports: Reports) -> None:
        self.reports = reports

    def poll(self, now: float) -> None:
        """Nothing to read: the runs' reports came with their lease renewals."""

    def trainer_wait(self, now: float) -> float | None:
        known = [(r.weight, r.pace.trainer_wait) for r in self.reports().values() if r.pace is not None]
        return _weighted([(w, v) for w, v in known if v is not None])

    def backlog_steps(self) -> float | None:
        known = [(r.weight, r.pace.backlog_steps) for r in self.reports().values() if r.pace is not None]
        return _weighted([(w, v) for w, v in known if v is not None])

    def backlog_groups(self) -> int:
        return sum(r.pace.backlog_groups for r in self.reports().values() if r.pace is not None)

    def runs(self) -> dict[str, dict[str, float | int | None]]:
        """Per run, what went into the look (the `desired_replicas` event's `signals.runs`)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for run_id, r in sorted(self.reports().items()):
            pace = r.pace or RunPace()
            out[run_id] = {
                "weight": r.weight,
                "trainer_wait": pace.trainer_wait,
                "backlog_steps": pace.backlog_steps,
                "backlog_groups": pace.backlog_groups,
                "reported": r.pace is not None,
                "age_s": None if r.age_s is None else round(r.age_s, 1),
            }
        return out
