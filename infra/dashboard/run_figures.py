"""The run figures of `brigade summary` beyond steps, rewards and sync: the best held-out version beside the
final one (infra/best_version.py), and what was dropped, the lengths generated against trained and the share
cut at their token limit (infra/summary_lengths.py). Every key carries its exact value, as the page's other
figures do."""

from __future__ import annotations

from html import escape
from typing import Any

from infra.dashboard.markup import figure, metric, number


def _lengths(key: str, dist: dict[str, Any] | None) -> str:
    d = dist or {}
    return metric(key, dist, f"mean {number(d.get('mean'), '.1f')}, p90 {number(d.get('p90'), 'd')}")


def best_and_lengths(s: dict[str, Any]) -> str:
    below = s.get("final_below_best")
    warn = (
        f"final {number(s.get('final_below_best_se'), '.1f')} standard errors below it"
        if below
        else "final within noise"
    )
    best = figure(
        "best held-out version",
        "v"
        + metric("best_version", s.get("best_version"), str(s.get("best_version") or "-"))
        + " "
        + metric("best_accuracy", s.get("best_accuracy"), number(s.get("best_accuracy"))),
        metric("final_below_best", below, escape(warn))
        + " ("
        + metric("final_below_best_se", s.get("final_below_best_se"), number(s.get("final_below_best_se"), ".1f"))
        + " SE)",
    )
    drops = s.get("groups_dropped_by_reason") or {}
    text = ", ".join(f"{n} {reason}" for reason, n in drops.items()) or "none"
    lengths = figure(
        "completion tokens trained / generated",
        metric(
            "trained_len_vs_generated",
            s.get("trained_len_vs_generated"),
            number(s.get("trained_len_vs_generated"), ".2f"),
        ),
        "generated "
        + _lengths("completion_len_generated", s.get("completion_len_generated"))
        + "; trained "
        + _lengths("completion_len_trained", s.get("completion_len_trained"))
        + "; cut at the token limit: "
        + metric("clipped_ratio", s.get("clipped_ratio"), number(s.get("clipped_ratio"), ".0%"))
        + " ("
        + metric("completions_clipped", s.get("completions_clipped"), str(s.get("completions_clipped", "-")))
        + ")"
        + "; dropped: "
        + metric("groups_dropped_by_reason", drops, text),
    )
    return best + lengths
