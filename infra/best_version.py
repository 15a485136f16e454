"""The best held-out version of a run beside its final one, and whether the final fell below it (issue 34).

A longer run can peak and then lose held-out accuracy while its training reward keeps rising; the summary, the
dashboard and `brigade export --version best` name the best version so that nothing learned is lost. The fall
is called out when the final evaluation is more than two standard errors below the best: the standard error of
an evaluation of n prompts at the best's accuracy p is sqrt(p (1 - p) / n) (0.032 for 200 sums at 0.72), so
a smaller gap is within what re-evaluating the same version could show.
"""

from __future__ import annotations

import math
from typing import Any

WARN_STANDARD_ERRORS = 2.0


def best_figures(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """`best_accuracy`, `best_version` (the earliest of equals), `final_below_best_se` (how many standard errors
    the final is below the best; 0 when it is the best) and `final_below_best` (more than WARN_STANDARD_ERRORS),
    over the adapter versions of an accuracy curve (summary.accuracy_curve); None when none was evaluated."""
    adapted = [c for c in curve if c["version"] > 0]
    if not adapted:
        return {"best_accuracy": None, "best_version": None, "final_below_best_se": None, "final_below_best": False}
    best = max(adapted, key=lambda c: (c["accuracy"], -c["version"]))
    final = max(adapted, key=lambda c: c["version"])
    p, n = best["accuracy"], max(1, best.get("total") or 1)
    se = math.sqrt(max(p * (1 - p), 1e-12) / n)
    below = max(0.0, (best["accuracy"] - final["accuracy"]) / se)
    return {
        "best_accuracy": best["accuracy"],
        "best_version": best["version"],
        "final_below_best_se": round(below, 2),
        "final_below_best": below > WARN_STANDARD_ERRORS,
    }


def best_line(summary: dict[str, Any]) -> list[str]:
    """The summary's line naming the best version, and its warning when the final fell below it."""
    if summary.get("best_version") is None:
        return []
    line = f"best held-out         v{summary['best_version']} {summary['best_accuracy']:.3f}"
    if summary.get("final_below_best"):
        line += (
            f"; WARNING: the final version is {summary['final_below_best_se']:.1f} standard errors below it (the run "
            f"lost held-out accuracy): brigade export --version best"
        )
    return [line]


def resolve_version(version: str | int | None, curve: list[dict[str, Any]]) -> int | None:
    """`--version` as `brigade export` takes it: a number, `best` (the best held-out version), or None (newest)."""
    if version is None or isinstance(version, int):
        return version
    if version == "best":
        best = best_figures(curve)["best_version"]
        if best is None:
            raise ValueError("no adapter version of this run has a complete held-out evaluation: give --version N")
        return best
    try:
        return int(version)
    except ValueError:
        raise ValueError(f"--version {version!r}: give a version number or 'best'") from None
