"""benchmarks/scaling/shared_pool.py's arithmetic, kept apart from the processes so that it is tested on synthetic
inputs.

Everything here is pure: figures in, figures out. "Tokens served" is the proxy's own measure (prompt plus
completion tokens given a replica's slots, per run: brigade_proxy_run_served_tokens_total{run=...}), the quantity
its weighted fair queuing shares out; the rollouts' own tokens are the cross-check.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from benchmarks.report import percentile

SHARE_BAND = (0.8, 1.2)  # share_vs_weight: tokens served / weighted fair share, per run
THROUGHPUT_FLOOR = 0.8  # throughput shared >= this x the run's fair fraction of its alone throughput
SYNC_RATIO_MAX = 1.5  # sync p95 shared / sync p95 alone
SERVED_TOKENS = "brigade_proxy_run_served_tokens_total"
SERVED_REQUESTS = "brigade_proxy_run_served_requests_total"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_RUN_LABEL = re.compile(r'(?:^|,)\s*run="(?P<run>(?:[^"\\]|\\.)*)"')


def fair_fractions(weights: dict[str, float]) -> dict[str, float]:
    """Each run's weighted fair fraction of the pool: weight / sum of the weights."""
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"the weights must add up to more than 0, not {weights}")
    return {run: w / total for run, w in weights.items()}


def share_vs_weight(tokens: dict[str, float], weights: dict[str, float]) -> dict[str, float | None]:
    """Per run: tokens served / (all runs' tokens x its fair fraction); 1.0 is exactly its weighted share.
    None for every run when nothing was served (no share to speak of)."""
    total = sum(tokens.get(run, 0.0) for run in weights)
    fractions = fair_fractions(weights)
    if total <= 0:
        return {run: None for run in weights}
    return {run: tokens.get(run, 0.0) / (total * fractions[run]) for run in weights}


def ratios(numerators: dict[str, float | None], denominators: dict[str, float | None]) -> dict[str, float | None]:
    """numerator / denominator per run of `numerators`; None where either is missing or the denominator is 0."""
    out: dict[str, float | None] = {}
    for run, num in numerators.items():
        den = denominators.get(run)
        out[run] = num / den if num is not None and den else None
    return out


def throughput_met(vs_alone: dict[str, float | None], weights: dict[str, float]) -> bool:
    """Whether every run's shared throughput is at least THROUGHPUT_FLOOR x its fair fraction of its alone
    throughput (a run of weight 2 of 4 should keep >= 0.8 x 1/2 of what it had alone)."""
    fractions = fair_fractions(weights)
    return all(
        vs_alone.get(run) is not None and vs_alone[run] >= THROUGHPUT_FLOOR * fractions[run] - 1e-12 for run in weights
    )


def sync_figures(shared: dict[str, list[float]], alone: dict[str, list[float]]) -> dict[str, Any]:
    """Commit -> live p50/p95 per run in each phase, and the p95 ratio shared / alone: per run, and over every
    run's versions pooled (`pooled`, the benchmark's figure: a 60 s phase gives a run only a few versions)."""
    out: dict[str, Any] = {"per_run": {}}
    for run in sorted(set(shared) | set(alone)):
        s, a = shared.get(run, []), alone.get(run, [])
        p95_s, p95_a = percentile(s, 95), percentile(a, 95)
        out["per_run"][run] = {
            "shared_p50_s": _r(percentile(s, 50)),
            "shared_p95_s": _r(p95_s),
            "alone_p50_s": _r(percentile(a, 50)),
            "alone_p95_s": _r(p95_a),
            "versions_shared": len(s),
            "versions_alone": len(a),
            "p95_vs_alone": _r(p95_s / p95_a) if p95_s is not None and p95_a else None,
        }
    all_s = [x for v in shared.values() for x in v]
    all_a = [x for v in alone.values() for x in v]
    p95_s, p95_a = percentile(all_s, 95), percentile(all_a, 95)
    out["pooled"] = {
        "shared_p95_s": _r(p95_s),
        "alone_p95_s": _r(p95_a),
        "versions_shared": len(all_s),
        "versions_alone": len(all_a),
        "p95_vs_alone": _r(p95_s / p95_a) if p95_s is not None and p95_a else None,
    }
    return out


def cross_run_uses(samples: Iterable[tuple[str, str]], runs: Iterable[str], base_model: str) -> dict[str, Any]:
    """Audit of (run the rollout belongs to, model the replica said served it) pairs: how many were generated
    with another run's adapter (`uses`, by `run<-other`), with the base model, with the run's own adapters, and
    with no model recorded (those prove nothing either way, so they are counted apart)."""
    runs = list(runs)
    patterns = {run: re.compile(rf"^{re.escape(run)}-v\d{{6}}$") for run in runs}
    counts = {"checked": 0, "own": 0, "base": 0, "unrecorded": 0, "uses": 0, "unknown": 0}
    by_pair: dict[str, int] = {}
    for run, model in samples:
        counts["checked"] += 1
        if not model:
            counts["unrecorded"] += 1
        elif model == base_model:
            counts["base"] += 1
        elif run in patterns and patterns[run].match(model):
            counts["own"] += 1
        else:
            owner = next((r for r, p in patterns.items() if p.match(model)), None)
            if owner is None:
                counts["unknown"] += 1  # neither the base, nor a run's adapter: not this pool's name at all
            else:
                counts["uses"] += 1
                by_pair[f"{run}<-{owner}"] = by_pair.get(f"{run}<-{owner}", 0) + 1
    return {**counts, "by_pair": by_pair}


def per_run_counter(metrics_text: str, name: str) -> dict[str, float]:
    """The per-run samples of one counter (`name`, with its _total) in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group("name") != name:
            continue
        run = _RUN_LABEL.search(m.group("labels"))
        if run is not None:
            out[run.group("run")] = out.get(run.group("run"), 0.0) + float(m.group("value"))
    return out


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per run of `after` (a run absent before counts from 0)."""
    return {run: value - before.get(run, 0.0) for run, value in after.items()}


def goals(result: dict[str, Any], weights: dict[str, float]) -> dict[str, bool]:
    """The issue's goal per key, from the benchmark's result."""
    low, high = SHARE_BAND
    share = result.get("share_vs_weight") or {}
    sync = result.get("sync_p95_vs_alone")
    cross = result.get("cross_run_audit") or {}
    return {
        "share_vs_weight": bool(share) and all(v is not None and low <= v <= high for v in share.values()),
        "throughput_vs_alone": throughput_met(result.get("throughput_vs_alone") or {}, weights),
        "sync_p95_vs_alone": sync is not None and sync <= SYNC_RATIO_MAX,
        # zero uses only counts when samples were checked and each named the model that served it
        "cross_run_uses": result.get("cross_run_uses") == 0
        and cross.get("checked", 0) > 0
        and cross.get("unrecorded", 0) == 0,
        "refused_over_capacity": result.get("refused_over_capacity") is True,
    }


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)
