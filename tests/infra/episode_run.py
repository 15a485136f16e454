"""A small environment run's bucket, written through the real writers (ShardWriter, EventLog): episode groups
(samples with turns and a loss mask) and env_failed events, for the audit's and the dashboard's tests.

No job runs: what these tests check is how the bucket is read, and a real environment run takes a minute of
vLLM per episode batch (tests/e2e/test_environments_local.py runs one)."""

from __future__ import annotations

from bucket import events
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, Turn
from bucket.store import Store

PROMPT_IDS = [5, 6]


def episode(
    turns: list[tuple[int, int, int, str]],
    n: int,
    mask: list[int] | None = None,
    tool_calls: int = 0,
    finish: str | None = "done",
) -> Sample:
    """An episode of `n` tokens after the prompt whose turns sampled [start, end) at version on replica; masked
    outside the turns unless `mask` says otherwise."""
    spans = [Turn(start=a, end=b, version=v, replica=r) for a, b, v, r in turns]
    inside = [0] * n
    for t in spans:
        inside[t.start : t.end] = [1] * (t.end - t.start)
    return Sample(
        completion_ids=list(range(100, 100 + n)),
        logprobs=[-0.5 if m else 0.0 for m in inside],
        loss_mask=inside if mask is None else mask,
        turns=spans,
        text=f"episode of {len(spans)} turns",
        reward=1.0,
        finish_reason=finish,
        replica=spans[0].replica,
        tool_calls=tool_calls,
    )


def group(prompt_id: str, samples: list[Sample], version: int = 0) -> ScoredGroup:
    return ScoredGroup(
        prompt_id=prompt_id,
        prompt=f"question {prompt_id}",
        prompt_ids=PROMPT_IDS,
        adapter_version=version,
        sampling=SamplingParams(temperature=1.0),
        samples=samples,
    )


def good_groups() -> list[ScoredGroup]:
    """Three whole groups of two episodes: 2 + 2, 1 + 2 (a tool call), 2 + 1 turns; the last group's second
    episode moved replica between its turns (as when its replica died)."""
    two = [(0, 3, 0, "r0"), (5, 7, 0, "r0")]
    return [
        group("p0", [episode(two, 7), episode(two, 7)]),
        group("p1", [episode([(0, 4, 0, "r1")], 4, tool_calls=1), episode(two, 7)]),
        group("p2", [episode(two, 7), episode([(0, 3, 0, "r0"), (5, 6, 0, "r1")], 6)]),
    ]


def environment_run(store: Store, extra: list[ScoredGroup] = (), errors: int = 2) -> Store:
    """The good groups (and `extra`) in two shards, and `errors` env_failed events of prompt p3, whose group
    holds the one episode of two that did not fail."""
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=2), "test")
    writer = ShardWriter(store, "rollout-0")
    good = good_groups()
    writer.write(good[:2])
    writer.write([good[2], group("p3", [episode([(0, 2, 0, "r0")], 2)]), *extra])
    ev = events.EventLog(store, "rollout_worker", "rollout-0-events")
    for i in range(errors):
        ev.emit(
            events.ENV_FAILED,
            episode=f"p3-abc-{i}",
            prompt_id="p3",
            call="step",
            error=f"ValueError: step {i} got nonsense",
            version=0,
        )
    return store
