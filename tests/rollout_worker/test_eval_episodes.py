"""The held-out evaluation of an environment run goes through its environment (rollout_worker/environments/held_out.py):
one greedy episode per held-out row, in the environment's own process, with training's bounds and reward, recorded
as an `eval` event with the episodes' mean reward and the environment errors beside the accuracy.

The Evaluator runs against the session's two real vLLM replicas through a real proxy (in this process,
tests/helpers.proxied), and its event is read back from a bucket. The environments are written here, as a user
writes one: a text-step game whose reward the model cannot change (so what the event must say is known), one
that raises on the rows marked broken, and one that hangs.
"""

from __future__ import annotations

import asyncio
import json
import time

import psutil

from bucket import events
from bucket.events import EventLog
from bucket.store import Store
from rollout_worker.config import RolloutConfig
from rollout_worker.environments.held_out import HeldOutEpisodes
from rollout_worker.evaluation import EPISODE_JUDGE, Evaluator
from rollout_worker.prompts import load_data
from tests.helpers import proxied

HERE = "tests.rollout_worker.test_eval_episodes"


class FourWords:
    """Four steps of 0.25 each; a row marked `broken` raises at its first step (a game server down)."""

    def reset(self, **row) -> str:
        self.left, self.broken = 4, bool(row.get("broken"))
        return " Reply with one word."

    def step(self, action: str):
        if self.broken:
            raise ConnectionError("the game's server is down")
        self.left -= 1
        return "Another word.", 0.25, self.left == 0, {}


class Stuck(FourWords):
    def step(self, action: str):
        time.sleep(600)  # past the evaluation's bound: cut, and its process killed


def bonus(completions, environments, **_) -> list[float | None]:
    """A reward function reading each episode's instance as it ended (environments=, as training passes it)."""
    return [None if env is None else 0.25 * (env.left == 1) for env in environments]


def _data(tmp_path, broken: set[int]):
    path = tmp_path / f"held_out{''.join(f'-{i}' for i in sorted(broken))}.jsonl"  # one file per set
    rows = [{"prompt": f"Game {i}.", "answer": str(i), "broken": i in broken} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_data("arithmetic", str(path), len(rows))


def _env_hosts() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "rollout_worker.environments.host" in p.cmdline()]


async def _evaluate(store, manifest, client, rc: RolloutConfig, data, timeout_s: float | None) -> Evaluator:
    episodes = HeldOutEpisodes.for_settings(rc, client, manifest.base_model, 16)
    evaluator = Evaluator(client, None, data, rc.eval_judge, rc.eval_max_tokens, episodes=episodes)  # type: ignore[arg-type]
    try:
        await evaluator.run(EventLog(store, "rollout"), 0, manifest.base_model, timeout_s)
    finally:
        evaluator.close()
    return evaluator


def test_held_out_episodes_are_run_and_judged_by_the_environment(vllm_replicas, tmp_path):
    """Three turns (max_turns), each stepped: 0.75 from the game plus the bonus of 0.25 = 1.0, a success at the
    default threshold; the broken row's episode ends with its error, counted and left out, the rest judged."""
    store, _, manifest = vllm_replicas
    run = Store(str(tmp_path / "bucket"))
    run.check_reachable(create=True)
    rc = RolloutConfig(
        environment=f"{HERE}:FourWords",
        max_turns=3,
        max_completion_length=6,
        reward_funcs=[f"{HERE}:bonus"],
    )

    # the same episodes judged with a threshold above what an episode can score: none succeeds, same mean reward
    run2 = Store(str(tmp_path / "bucket2"))
    run2.check_reachable(create=True)
    strict = rc.model_copy(update={"eval_success_threshold": 1.5})

    async def body() -> None:
        async with proxied(store, manifest) as (_, client):
            await _evaluate(run, manifest, client, rc, _data(tmp_path, broken={2}), timeout_s=None)
            await _evaluate(run2, manifest, client, strict, _data(tmp_path, broken=set()), timeout_s=None)

    asyncio.run(body())
    (e,) = [e for e in events.read_all(run) if e["kind"] == events.EVAL]
    assert e["partial"] is False and "cut" not in e, e
    assert (e["total"], e["env_errors"], e["correct"], e["accuracy"], e["mean_reward"]) == (3, 1, 3, 1.0, 1.0), e
    (error,) = e["env_error_examples"]
    assert (error["prompt_id"], error["call"]) == ("row-2", "step") and "the game's server is down" in error["error"]
    assert (e["judge"], e["environment"], e["reward_funcs"]) == (EPISODE_JUDGE, f"{HERE}:FourWords", [f"{HERE}:bonus"])
    assert (e["success_threshold"], e["max_turns"], e["max_tokens"]) == (1.0, 3, 6)
    for ex in e["examples"]:  # the whole exchange: three replies, each answered by the game (the last one too)
        assert ex["completion"].count("[assistant]") == 3 and ex["completion"].count("[user] Another word.") == 3, ex
        assert ex["reward"] == 1.0
    (e2,) = [e for e in events.read_all(run2) if e["kind"] == events.EVAL]
    assert (e2["total"], e2["env_errors"], e2["correct"], e2["accuracy"], e2["mean_reward"]) == (4, 0, 0, 0.0, 1.0)
    assert not _env_hosts(), "an environment process outlived the evaluation"


def test_an_evaluation_whose_environment_hangs_is_cut_and_recorded(vllm_replicas, tmp_path):
    """Every episode stuck in step: past eval_timeout_s the evaluation is cut, recorded as partial with nothing
    judged, and the stuck processes are killed; one whose every episode raised is recorded as failed, saying why."""
    store, _, manifest = vllm_replicas
    run = Store(str(tmp_path / "bucket"))
    run.check_reachable(create=True)
    stuck = RolloutConfig(environment=f"{HERE}:Stuck", max_completion_length=4)
    broken = RolloutConfig(environment=f"{HERE}:FourWords", max_completion_length=4)

    async def body() -> None:
        async with proxied(store, manifest) as (_, client):
            t0 = time.monotonic()
            await _evaluate(run, manifest, client, stuck, _data(tmp_path, broken=set()), timeout_s=5)
            assert time.monotonic() - t0 < 60  # cut at its bound, not at the environment's 30 s call timeout
            await _evaluate(run, manifest, client, broken, _data(tmp_path, broken={0, 1, 2, 3}), timeout_s=None)

    asyncio.run(body())
    cut, failed = [e for e in events.read_all(run) if e["kind"] == events.EVAL]
    assert (cut["partial"], cut["cut"], cut["planned"], cut["total"], cut["accuracy"]) == (True, "timeout", 4, 0, None)
    assert (cut["env_errors"], cut["mean_reward"]) == (0, None)
    assert (failed["partial"], failed["cut"], failed["accuracy"], failed["env_errors"]) == (True, "failed", None, 4)
    assert "every episode ended in an environment error" in failed["error"] and "server is down" in failed["error"]
    assert not _env_hosts(), "a stuck environment's process outlived the cut evaluation"
