"""The dashboard's Episodes section, for environment runs (`--rollout.environment`; issue 30, item 8).

`Episodes` counts what the dashboard reads incrementally: each episode sample of the shards (`turns`
set) and each `env_failed` event. Its `figures()` are `brigade summary`'s episode figures with their
definitions (infra/summary.py `episode_figures`), so the page, `/api/summary` and the command agree;
`detail()` (`/api/episodes`) adds the turns distribution, finish reasons and the last errors. A
single-turn run has neither, and the section, the API's figures and the terminal line are absent.
"""

from __future__ import annotations

import collections
from html import escape
from typing import Any

from rich.markup import escape as escape_markup

from bucket.rollouts import Sample, ScoredGroup
from infra.dashboard.markup import metric, number

LAST_ERRORS = 10  # env_failed events kept with their text


class Episodes:
    def __init__(self) -> None:
        self.count = 0
        self.turns: collections.Counter[int] = collections.Counter()  # turns per episode -> episodes
        self.tool_calls: collections.Counter[int] = collections.Counter()
        self.finish: collections.Counter[str] = collections.Counter()
        self.tokens = 0  # prompt and stream, summed over episodes
        self.moved = 0  # episodes whose turns were served by more than one replica
        self.errors = 0
        self.errors_by_call: collections.Counter[str] = collections.Counter()
        self.last_errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=LAST_ERRORS)

    def add(self, g: ScoredGroup, s: Sample) -> None:
        """One sample of a shard; single replies (no loss mask; `turns` only when a version switch split one)
        are not episodes."""
        if not s.is_episode or s.turns is None:
            return
        self.count += 1
        self.turns[len(s.turns)] += 1
        self.tool_calls[s.tool_calls] += 1
        self.finish[s.finish_reason or "?"] += 1
        self.tokens += len(g.prompt_ids) + len(s.completion_ids)
        self.moved += len({t.replica for t in s.turns}) > 1

    def failed(self, e: dict[str, Any]) -> None:
        """One env_failed event (the rollout worker's: episode, prompt_id, call, error, version)."""
        self.errors += 1
        self.errors_by_call[str(e.get("call", "?"))] += 1
        keep = ("ts", "episode", "prompt_id", "call", "error", "version")
        self.last_errors.append({k: e.get(k) for k in keep})

    def figures(self) -> dict[str, Any]:
        """`brigade summary`'s episode figures; {} for a single-turn run (as the command leaves them out)."""
        if not self.count and not self.errors:
            return {}
        n = self.count

        def mean(total: float) -> float | None:
            return total / n if n else None

        return {
            "episodes": n,
            "turns_mean": mean(sum(k * c for k, c in self.turns.items())),
            "tool_calls_mean": mean(sum(k * c for k, c in self.tool_calls.items())),
            "env_errors": self.errors,
            "episode_tokens_mean": mean(self.tokens),
        }

    def detail(self) -> dict[str, Any]:
        """Everything the section shows: the figures, the distributions, and the last errors (newest last)."""
        return {
            **self.figures(),
            "turns_distribution": {str(k): self.turns[k] for k in sorted(self.turns)},
            "tool_calls_distribution": {str(k): self.tool_calls[k] for k in sorted(self.tool_calls)},
            "finish_reasons": dict(self.finish.most_common()),
            "episodes_moved_replica": self.moved,
            "env_errors_by_call": dict(self.errors_by_call.most_common()),
            "last_errors": list(self.last_errors),
        }


_metric, _f = metric, number


def _bars(counts: dict[str, int], label: str) -> str:
    """A distribution as table rows with a bar each (share of the total)."""
    total = sum(counts.values()) or 1
    rows = "".join(
        f"<tr><td>{escape(k)}</td><td>{c}</td><td class='l'><span style='display:inline-block;height:9px;"
        f"width:{240 * c / total:.0f}px;background:#2f6fdb'></span> {100 * c / total:.0f} %</td></tr>"
        for k, c in counts.items()
    )
    return f"<table><tr><th>{escape(label)}</th><th>episodes</th><th class='l'>share</th></tr>{rows}</table>"


def episodes_panel(ep: Episodes) -> str:
    """The section; '' for a single-turn run."""
    d = ep.detail()
    if not d.get("episodes") and not d.get("env_errors"):
        return ""
    figs = (
        "<div class='figure'><small>episodes written</small><b>"
        f"{_metric('episodes', d['episodes'], str(d['episodes']))}"
        f"</b><small>{d['episodes_moved_replica']} moved replica mid-episode</small></div>"
        f"<div class='figure'><small>turns per episode (mean)</small><b>"
        f"{_metric('turns_mean', d['turns_mean'], _f(d['turns_mean'], '.2f'))}</b></div>"
        f"<div class='figure'><small>tool calls per episode (mean)</small><b>"
        f"{_metric('tool_calls_mean', d['tool_calls_mean'], _f(d['tool_calls_mean'], '.2f'))}</b></div>"
        f"<div class='figure'><small>tokens per episode (mean)</small><b>"
        f"{_metric('episode_tokens_mean', d['episode_tokens_mean'], _f(d['episode_tokens_mean'], '.1f'))}</b>"
        "<small>prompt and stream</small></div>"
        f"<div class='figure'><small>environment errors</small><b class='{'bad' if d['env_errors'] else 'good'}'>"
        f"{_metric('env_errors', d['env_errors'], str(d['env_errors']))}</b><small>"
        + escape(", ".join(f"{k} {v}" for k, v in d["env_errors_by_call"].items()) or "no episode ended by one")
        + "</small></div>"
    )
    errors = "".join(
        f"<tr><td class='l'>{escape(str(e.get('episode')))}</td><td class='l'>{escape(str(e.get('call')))}</td>"
        f"<td>v{e.get('version')}</td><td class='text'>{escape(str(e.get('error')))}</td></tr>"
        for e in reversed(d["last_errors"])
    )
    error_table = (
        "<h3 style='font-size:13px'>Last environment errors (newest first; the episode is left out of its group)"
        "</h3><table><tr>"
        "<th class='l'>episode</th><th class='l'>call</th><th>version</th><th class='l'>error</th></tr>"
        f"{errors}</table>"
        if errors
        else ""
    )
    finish = ", ".join(f"{escape(k)} {v}" for k, v in d["finish_reasons"].items())
    return (
        "<section id='episodes'><h2>Episodes (environment run)</h2>"
        f"<div class='figures'>{figs}</div><div class='grid' style='margin-top:8px'>"
        f"<div>{_bars(d['turns_distribution'], 'turns')}</div>"
        f"<div>{_bars(d['tool_calls_distribution'], 'tool calls')}</div></div>"
        f"<p class='muted'>how episodes ended: {finish or '-'}</p>{error_table}</section>"
    )


def terminal_line(ep: Episodes) -> str | None:
    """`brigade dashboard --terminal`'s line for an environment run (rich markup); None for a single-turn run."""
    d = ep.detail()
    if not d.get("episodes") and not d.get("env_errors"):
        return None
    dist = ", ".join(f"{k}: {v}" for k, v in d["turns_distribution"].items())
    line = (
        f"episodes {d['episodes']}, turns {_f(d['turns_mean'], '.2f')} mean ({dist}), "
        f"tool calls {_f(d['tool_calls_mean'], '.2f')} mean, env errors {d['env_errors']}"
    )
    if d["last_errors"]:
        last = d["last_errors"][-1]
        why = f"{last.get('call')}: {str(last.get('error'))[:120]}"
        line += f" [dim](last: {escape_markup(why)})[/dim]"
    return line
