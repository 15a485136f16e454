"""The summary's figures on what was dropped and why, and on completion lengths generated against trained.

Dropping late groups trains mostly on short answers (docs/long-rollouts.md): these figures show whether a
run did. Drops come from the trainer's `train_step` events (`dropped/<reason>`, trainer/buffer.py); lengths
from the shards (every sample written) and the checkpoints' lineage (the groups trained). Completions cut at
their token limit (Sample.clipped) are counted too: a run whose replies mostly end there rewards cut answers,
and the summary says which setting to raise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bucket.checkpoints import TrainerState
from bucket.rollouts import ShardRead

# The share of completions cut at their limit from which the summary says so on a line of its own: there most
# rewards judge unfinished replies, and a task that needs more tokens than it is given looks unlearnable.
# The default sums run cuts 39 % over its first 12 steps (it learns to answer in fewer); reasoning-gym's
# basic_arithmetic at the same 16 tokens 83 %, reward 0 throughout (Intel Xeon, 2026-12-06).
CLIPPED_WARN = 0.75


def drops_by_reason(steps: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Groups the trainer dropped, by reason, summed over its steps' events (drops after the last step are not
    in an event yet: the checkpoints' `groups_dropped_stale` counts them)."""
    out: dict[str, int] = {}
    for e in steps:
        for key, n in e.items():
            if key.startswith("dropped/") and isinstance(n, int | float):
                reason = key.removeprefix("dropped/")
                out[reason] = out.get(reason, 0) + int(n)
    return dict(sorted(out.items()))


def distribution(xs: list[int]) -> dict[str, float | int | None]:
    """count, mean, p50, p90 (nearest rank) and max."""
    if not xs:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "max": None}
    s = sorted(xs)

    def rank(q: float) -> int:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {"count": len(s), "mean": statistics.fmean(s), "p50": rank(0.5), "p90": rank(0.9), "max": s[-1]}


def group_lengths(shards: Sequence[ShardRead]) -> dict[str, list[int]]:
    """Sampled tokens per completion (an episode's mask-1 tokens) of every group written, by group id."""
    return {str(gid): [s.trained_tokens for s in group.samples] for read in shards for gid, group in read.groups()}


def clipped_count(shards: Sequence[ShardRead]) -> int:
    """Samples written whose reply was cut at its token limit (Sample.clipped)."""
    return sum(s.clipped for read in shards for _, group in read.groups() for s in group.samples)


def length_figures(shards: Sequence[ShardRead], lineage: Sequence[TrainerState]) -> dict[str, Any]:
    """The lengths of every sample written and of those trained, the ratio of their means (1.00: training
    saw the lengths generation produced), and the fraction of samples cut at their token limit."""
    return lengths_figures(group_lengths(shards), lineage, clipped_count(shards))


def lengths_figures(lengths: Mapping[str, list[int]], lineage: Sequence[TrainerState], clipped: int) -> dict[str, Any]:
    """`length_figures` from lengths and a clipped count already read (the dashboard reads shards as they come)."""
    trained_ids = {g for st in lineage for g in st.trained}
    generated = [n for ns in lengths.values() for n in ns]
    trained = [n for gid, ns in lengths.items() if gid in trained_ids for n in ns]
    gen, tr = distribution(generated), distribution(trained)
    ratio = tr["mean"] / gen["mean"] if gen["mean"] and tr["mean"] is not None else None
    return {
        "completion_len_generated": gen,
        "completion_len_trained": tr,
        "trained_len_vs_generated": ratio,
        # TRL's completions/clipped_ratio: the share of completions that hit the length limit
        "completions_clipped": clipped,
        "clipped_ratio": clipped / len(generated) if generated else None,
    }


def lines(summary: dict[str, Any]) -> list[str]:
    """The summary's lines for drops by reason and the two length distributions."""
    drops = summary.get("groups_dropped_by_reason") or {}
    out = [
        "dropped by reason     "
        + (", ".join(f"{n} {reason}" for reason, n in drops.items()) if drops else "none")
        + "  (stale: read outside max_staleness; rollout pacing keeps it 0)"
    ]
    gen, tr = summary.get("completion_len_generated"), summary.get("completion_len_trained")
    if gen and gen["count"]:

        def d(x: dict[str, Any]) -> str:
            mean = "-" if x["mean"] is None else f"{x['mean']:.1f}"
            return f"mean {mean}, p50 {x['p50'] or '-'}, p90 {x['p90'] or '-'}, max {x['max'] or '-'} ({x['count']})"

        ratio = summary.get("trained_len_vs_generated")
        clipped = summary.get("clipped_ratio")
        out += [
            f"completion tokens     generated {d(gen)}"
            + ("" if clipped is None else f"; {clipped:.0%} cut at the token limit"),
            f"                      trained   {d(tr)}; trained/generated mean "
            + ("-" if ratio is None else f"{ratio:.3f}"),
        ]
        if clipped is not None and clipped >= CLIPPED_WARN:
            out.append(
                f"  {clipped:.0%} of the completions were cut at their token limit ({gen['max']} tokens at most): "
                "their rewards judged unfinished replies; raise --rollout.max-completion-length"
                + (" (and --rollout.max-episode-tokens, an episode's room)" if "episodes" in summary else "")
            )
    return out
