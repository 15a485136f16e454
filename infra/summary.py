"""A run's summary, computed from the bucket alone (events, checkpoints, shards).

Used by `brigade local` at the end of a run, by `brigade summary`, and by the
end-to-end test, so what the user reads is what the test checks.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

from bucket import checkpoints, events
from bucket.config import open_bucket
from bucket.progress import read_done
from bucket.rollouts import ShardRead, read_shards
from bucket.store import Store
from infra.best_version import best_figures, best_line
from infra.config import Config
from infra.summary_lengths import drops_by_reason, length_figures
from infra.summary_lengths import lines as length_lines
from infra.summary_phases import phase_figures


def accuracy_curve(evals: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Held-out accuracy per evaluated version, in the order evaluated, for the run's evaluation set (the last
    one used, should a run have been evaluated on several); `t` = seconds since the run's first event (`t0`).

    Complete evaluations only: a cut one (`partial`) judged a subset, so its accuracy is not the version's."""
    evals = [e for e in evals if not e.get("partial")]
    if not evals:
        return []
    eval_set = evals[-1].get("eval_set")
    return [
        {"version": e["version"], "accuracy": e["accuracy"], "total": e["total"], "t": e["ts"] - t0, "ts": e["ts"]}
        for e in evals
        if e.get("eval_set") == eval_set
    ]


def learning_figures(
    evals: list[dict[str, Any]], steps: list[dict[str, Any]], reward_failures: int, t0: float | None
) -> dict[str, Any]:
    """Held-out accuracy (base and final) and the reward over steps: shared with the dashboard, so both agree."""
    curve = accuracy_curve(evals, t0) if t0 is not None else []
    base = [c for c in curve if c["version"] == 0]
    adapted = [c for c in curve if c["version"] > 0]
    return {
        "base_accuracy": base[-1]["accuracy"] if base else None,
        "final_accuracy": max(adapted, key=lambda c: c["version"])["accuracy"] if adapted else None,
        "final_accuracy_version": max(c["version"] for c in adapted) if adapted else None,
        "accuracy_curve": curve,
        **best_figures(curve),
        "evaluations_cut": evaluations_cut(evals),
        "reward_curve": [{"step": e["step"], "reward": e["reward"], "ts": e["ts"]} for e in steps],
        "reward_failures": reward_failures,
    }


def evaluations_cut(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations that ended early (timed out, cut by the worker stopping) or failed: which version, why, and
    how many prompts were judged of the set's."""
    return [
        {
            "version": e["version"],
            "cut": e.get("cut", "cut"),
            "judged": e.get("total", 0),
            "planned": e.get("planned"),
            "partial_accuracy": e.get("accuracy"),
            "ts": e["ts"],
        }
        for e in evals
        if e.get("partial")
    ]


def final_evaluation(summary: dict[str, Any]) -> str | None:
    """How the newest published version (the base, without one) was evaluated: 'complete', 'cut' or 'not run';
    None for a run without evaluations."""
    if not summary.get("accuracy_curve") and not summary.get("evaluations_cut"):
        return None
    final = max((v["version"] for v in summary.get("versions", [])), default=0)
    if any(c["version"] == final for c in summary["accuracy_curve"]):
        return "complete"
    return "cut" if any(c["version"] == final for c in summary["evaluations_cut"]) else "not run"


def episode_figures(shards: Sequence[ShardRead], evs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An environment run's episodes (--rollout.environment), from its shards and env_failed events; {} for a
    single-turn run. `episodes` counts the episodes written (one sample each, `turns` set); an episode whose
    environment failed is not written, and is counted in `env_errors` instead. `tool_calls_unparsed` counts the
    replies that looked like a tool call in the run's format but gave none (tool_call_unparsed events), with the
    first one's reason: a model writing calls in another format than the one chosen shows here, not as silence."""
    eps = [(g, s) for read in shards for _, g in read.groups() for s in g.samples if s.is_episode]
    errors = sum(1 for e in evs if e["kind"] == events.ENV_FAILED)
    unparsed = [e for e in evs if e["kind"] == events.TOOL_CALL_UNPARSED]
    if not eps and not errors and not unparsed:
        return {}

    def mean(xs: list[float]) -> float | None:
        return statistics.fmean(xs) if xs else None

    return {
        "episodes": len(eps),
        "turns_mean": mean([len(s.turns or []) for _, s in eps]),
        "tool_calls_mean": mean([s.tool_calls for _, s in eps]),
        "env_errors": errors,
        "tool_calls_unparsed": len(unparsed),
        "tool_call_unparsed_example": f"{unparsed[0].get('format', '')}: {unparsed[0].get('reason', '')}"
        if unparsed
        else "",
        # the whole stream: the group's prompt and the sample's tokens after it (replies, template, tools)
        "episode_tokens_mean": mean([len(g.prompt_ids) + len(s.completion_ids) for g, s in eps]),
    }


def summarize(store: Store) -> dict[str, Any]:
    evs = events.read_all(store)
    steps = [e for e in evs if e["kind"] == events.TRAIN_STEP]
    published = {e["version"]: e for e in evs if e["kind"] == events.PUBLISHED}
    loaded_all = {}
    for e in evs:
        if e["kind"] == events.LOADED_ALL and e["version"] not in loaded_all:
            loaded_all[e["version"]] = e
    loaded_on: dict[int, set[str]] = {}
    for e in evs:
        if e["kind"] == events.LOADED:
            loaded_on.setdefault(e["version"], set()).add(e["replica"])
    versions = []
    for v, pub in sorted(published.items()):
        done = loaded_all.get(v)
        versions.append(
            {
                "version": v,
                "step": pub.get("step"),
                "lora_name": pub.get("lora_name"),
                # a pool run's bucket has no per-replica loads: its rollout worker's event names the replicas
                "replicas_loaded": sorted(loaded_on.get(v) or (done or {}).get("replica_ids") or []),
                # committed (trainer's clock) -> loaded on every replica (proxy's clock); one clock in `brigade local`
                "commit_to_all_loaded_s": (done["ts"] - pub["committed_at"]) if done else None,
                # the fan-out alone, on the proxy's clock
                "fanout_s": done.get("seconds") if done else None,
            }
        )
    shards = read_shards(store, {})
    lineage = checkpoints.lineage(store)
    evals = [e for e in evs if e["kind"] == events.EVAL]
    figures = run_figures(
        steps,
        versions,
        rollout_shards=len(shards),
        rollout_shards_invalid=[s.record.key for s in shards if s.shard is None],
        groups_written=sum(len(s.shard.groups) for s in shards if s.shard),
        lineage=lineage,
        done=read_done(store) is not None,
        evals=evals,
        eval_skips=[e for e in evs if e["kind"] == events.EVAL_SKIPPED],
        reward_failures=sum(1 for e in evs if e["kind"] == events.REWARD_FAILED),
        first_ts=evs[0]["ts"] if evs else None,
    )
    phases = phase_figures(steps, [e for e in evs if e["kind"] == events.CURRICULUM], evals)
    return figures | episode_figures(shards, evs) | length_figures(shards, lineage) | phases


def run_figures(
    steps: list[dict[str, Any]],
    versions: list[dict[str, Any]],
    *,
    rollout_shards: int,
    rollout_shards_invalid: list[str],
    groups_written: int,
    lineage: list[checkpoints.TrainerState],
    done: bool,
    evals: list[dict[str, Any]],
    reward_failures: int,
    first_ts: float | None,
    eval_skips: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The summary's figures from what was read of the bucket: one definition for `brigade summary` (which reads
    it all at once) and the dashboard (which reads it incrementally), so the page shows what the command prints."""
    rewards = [e["reward"] for e in steps]
    quarter = max(1, len(rewards) // 4)
    samples = sum(e["samples"] for e in steps)
    # TRL's count: every sample of the step's groups, those with equal rewards included (TRL runs them
    # through forward and backward with zero advantage; brigade sets them aside before the forward pass).
    consumed = sum(e.get("samples_consumed", e["samples"]) for e in steps)
    train_wall = (steps[-1]["ts"] - steps[0]["ts"] + steps[0]["perf/step_s"]) if steps else 0.0
    latencies = [v["commit_to_all_loaded_s"] for v in versions if v["commit_to_all_loaded_s"] is not None]
    figures = {
        "steps": len(steps),
        "trained_samples": samples,
        "trained_samples_per_s": samples / train_wall if train_wall > 0 else 0.0,
        "consumed_samples_per_s": consumed / train_wall if train_wall > 0 else 0.0,
        "mean_reward": statistics.fmean(rewards) if rewards else None,
        "reward_first_steps": statistics.fmean(rewards[:quarter]) if rewards else None,
        "reward_last_steps": statistics.fmean(rewards[-quarter:]) if rewards else None,
        "ratio_mean": statistics.fmean(e["ratio"] for e in steps) if steps else None,
        "adapter_versions": len(versions),
        "versions": versions,
        "sync_p50_s": statistics.median(latencies) if latencies else None,
        # nearest rank: with a run's few versions, the p95 is its slowest but one or two, never interpolated
        "sync_p95_s": sorted(latencies)[math.ceil(0.95 * len(latencies)) - 1] if latencies else None,
        "rollout_shards": rollout_shards,
        "rollout_shards_invalid": rollout_shards_invalid,
        "groups_written": groups_written,
        "groups_trained": sum(len(st.trained) for st in lineage),
        "groups_dropped_stale": sum(len(st.dropped_stale) for st in lineage),
        "groups_dropped_by_reason": drops_by_reason(steps),
        "groups_skipped_zero_variance": sum(len(st.skipped_zero_variance) for st in lineage),
        "groups_pending": len(lineage[-1].pending) if lineage else 0,
        "done": done,
        **learning_figures(evals, steps, reward_failures, first_ts),
    }
    figures["final_evaluation"] = final_evaluation(figures)
    # Versions that came due for evaluation while one still ran: skipped, so that training never waits on it.
    figures["evaluations_skipped"] = sorted({int(v) for e in eval_skips for v in e.get("versions", [])})
    return figures


def render(summary: dict[str, Any]) -> str:
    def f(x: Any, fmt: str = ".3f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"steps                 {summary['steps']}",
        f"trained samples/s     {f(summary['trained_samples_per_s'], '.2f')}  ({summary['trained_samples']} samples; "
        f"{f(summary.get('consumed_samples_per_s'), '.2f')}/s with equal-reward groups, as TRL counts)",
        f"mean reward           {f(summary['mean_reward'])}  (first quarter {f(summary['reward_first_steps'])}, "
        f"last quarter {f(summary['reward_last_steps'])})",
        f"ratio (mean)          {f(summary['ratio_mean'], '.4f')}",
        f"rollout groups        {summary['groups_written']} written, {summary['groups_trained']} trained, "
        f"{summary['groups_dropped_stale']} dropped as stale, "
        f"{summary['groups_skipped_zero_variance']} skipped (equal rewards), "
        f"{summary['groups_pending']} read but untrained at the end",
        f"held-out accuracy     base {f(summary.get('base_accuracy'))} -> final {f(summary.get('final_accuracy'))}"
        f"  (version {summary.get('final_accuracy_version') or '-'}; greedy, {len(summary.get('accuracy_curve', []))} "
        "evaluations)",
        *best_line(summary),
        *length_lines(summary),
        *evaluation_notes(summary),
        *episode_lines(summary),
        f"adapter versions      {summary['adapter_versions']}  (sync p50 {f(summary['sync_p50_s'], '.2f')} s, "
        f"p95 {f(summary.get('sync_p95_s'), '.2f')} s)",
        "  version  step  committed -> loaded on every replica   fan-out   replicas",
    ]
    for v in summary["versions"]:
        lines.append(
            f"  v{v['version']:<7} {v['step'] if v['step'] is not None else '-':>4}  "
            f"{f(v['commit_to_all_loaded_s'], '.2f'):>12} s"
            f"{'':22}{f(v['fanout_s'], '.2f'):>6} s   {len(v['replicas_loaded'])}"
        )
    return "\n".join(lines)


def episode_lines(summary: dict[str, Any]) -> list[str]:
    """The episodes line of an environment run (nothing for a single-turn run)."""
    if "episodes" not in summary:
        return []

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"episodes              {summary['episodes']} written, {summary['env_errors']} ended by an environment "
        f"error; per episode: {f(summary['turns_mean'])} turns, {f(summary['tool_calls_mean'])} tool calls, "
        f"{f(summary['episode_tokens_mean'])} tokens"
    ]
    if summary.get("tool_calls_unparsed"):
        lines.append(
            f"tool calls unparsed   {summary['tool_calls_unparsed']} replies looked like a tool call but gave none "
            f"(first: {summary['tool_call_unparsed_example'][:200]}); if the model writes another format, set "
            "--rollout.tool-call-format"
        )
    return lines


def evaluation_notes(summary: dict[str, Any]) -> list[str]:
    """Lines naming the evaluations that were cut or failed, and a final version left unevaluated."""
    lines = []
    for c in summary.get("evaluations_cut", []):
        what = "failed" if c["cut"] == "failed" else f"cut ({c['cut']}) after {c['judged']} of {c['planned']} prompts"
        acc = c["partial_accuracy"]
        part = "" if acc is None else f": partial accuracy {acc:.3f} on those, not the version's"
        lines.append(f"  evaluation of v{c['version']} {what}{part}")
    skipped = summary.get("evaluations_skipped") or []
    if skipped:
        lines.append(
            "  not evaluated (an evaluation was still running, or a newer version was already live): "
            + ", ".join(f"v{v}" for v in skipped)
        )
    final = max((v["version"] for v in summary.get("versions", [])), default=0)
    if summary.get("final_evaluation") == "not run":
        lines.append(f"  the newest version v{final} was not evaluated")
    return lines


def run(config: Config) -> int:
    store = open_bucket(config.bucket)
    s = summarize(store)
    print(render(s))
    print(json.dumps(s))
    return 0
