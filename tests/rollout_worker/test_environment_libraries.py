"""Environments of libraries by name (`textarena:`, `skyrl-gym:`, `openenv:`), gymnasium's reset, an async
environment's own event loop, and what an environment's process may read of the worker's environment.

Everything runs as the worker runs it: each instance in its own process (rollout_worker/environments/host.py), the
real libraries (TextArena, skyrl-gym as installed by `bash infra/install.sh`), no replica. Training through
`brigade local` is tests/e2e/test_environment_libraries.py.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from bucket.config import ConfigError
from rollout_worker.config import RolloutConfig
from rollout_worker.environments.contract import STEP, EnvError
from rollout_worker.environments.env_vars import environment_of
from rollout_worker.environments.groups import check_environment
from rollout_worker.environments.host import EnvHosts
from rollout_worker.environments.libraries.seeds import INSTRUCTION, seeds_rows
from rollout_worker.preflight import preflight

HERE = "tests.rollout_worker.test_environment_libraries"
T = 30.0  # a call's timeout: the first one imports the library in a fresh process


class GymStyle:
    """gymnasium's own shapes: reset -> (observation, info), step -> five-tuple."""

    def reset(self, **row):
        self.n = 0
        return " Say anything.", {"seed": row.get("seed")}

    def step(self, action: str):
        self.n += 1
        return f"heard {action}", 0.5, self.n >= 2, False, {}


class AsyncConnection:
    """An async environment holding a connection across its calls, as OpenEnv's WebSocket client does: reset opens a
    TCP connection to a server on its own loop, every step talks over it. A fresh event loop per call would close
    the connection's loop after reset."""

    async def reset(self, **row) -> str:
        async def echo(reader, writer):
            while line := await reader.readline():
                writer.write(line.upper())
                await writer.drain()

        self.server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        return " connected"

    async def step(self, action: str):
        self.writer.write(action.encode() + b"\n")
        await self.writer.drain()
        answer = (await self.reader.readline()).decode().strip()
        return answer, 1.0, action == "bye", {}

    async def close(self) -> None:
        self.writer.close()
        self.server.close()


class Snoop:
    """An environment that reads everything its process was given."""

    def reset(self, **row) -> str:
        return json.dumps(dict(os.environ))

    def step(self, action: str):
        return "", 0.0, True, {}


async def run_env(spec: str, row: dict, actions: list[str], passed_env=()) -> tuple[dict, str, list]:
    """`spec` made, reset with `row` and stepped with `actions` in an environment process of its own (host.py)."""
    hosts = EnvHosts(max_idle=1, passed_env=passed_env)
    proc = hosts.acquire()
    try:
        info = await proc.call("create", spec, timeout_s=T)
        first = await proc.call("reset", row, timeout_s=T)
        steps = [await proc.call("step", a, timeout_s=T) for a in actions]
    finally:
        hosts.release(proc)
        hosts.close()
    return info, first, steps


def test_a_textarena_game_runs_unchanged_one_game_per_seed():
    row = {"prompt": INSTRUCTION, "seed": 7}

    # a binary search on GuessTheNumber (1..20): the game's own hints steer it, and it ends with TextArena's reward
    async def play() -> tuple[str, list]:
        hosts = EnvHosts(max_idle=1)
        proc = hosts.acquire()
        try:
            assert (await proc.call("create", "textarena:GuessTheNumber-v0", timeout_s=T))["kind"] == STEP
            opening = await proc.call("reset", row, timeout_s=T)
            low, high, out = 1, 20, []
            for _ in range(6):
                guess = (low + high) // 2
                obs, reward, done, _info = await proc.call("step", f"My guess: [{guess}]", timeout_s=T)
                out.append((guess, obs, reward, done))
                if done:
                    break
                low, high = (guess + 1, high) if "higher" in obs else (low, guess - 1)
            return opening, out
        finally:
            hosts.release(proc)
            hosts.close()

    opening, game = asyncio.run(play())
    assert "You are playing Guess The Number" in opening and "[5]" in opening  # the game's own rules, appended
    *middle, (_, _, reward, done) = game
    assert done and reward == 1.0, game  # found it: TextArena's reward for a win, read from env.close()
    assert all(r == 0.0 and not d and ("higher" in o or "lower" in o) for _, o, r, d in middle), middle
    assert all("My guess" not in o for _, o, _, _ in game)  # the player's own move is not echoed back
    # the same row (same seed) is the same game: every episode of a group faces one target
    assert asyncio.run(play())[1] == game
    other = asyncio.run(run_env("textarena:GuessTheNumber-v0", {**row, "seed": 8}, ["[10]"]))[2]
    assert other[0][0] in ("The target number is higher.", "The target number is lower.")


def test_library_environments_are_checked_at_start_multi_agent_games_refused():
    check_environment("textarena:GuessTheNumber-v0")
    # what `brigade local` and the worker check before anything starts (rollout_worker/preflight.py)
    with pytest.raises(ConfigError, match="TicTacToe-v0 is not a single-player game.*multi-agent games are refused"):
        preflight(RolloutConfig(environment="textarena:TicTacToe-v0", eval_size=4))
    with pytest.raises(ConfigError, match="no game 'GuessTheNumbr-v0' \\(did you mean GuessTheNumber-v0"):
        check_environment("textarena:GuessTheNumbr-v0")
    with pytest.raises(ConfigError, match="skyrl-gym has no environment 'gsm9k'; its environments: .*gsm8k"):
        check_environment("skyrl-gym:gsm9k")
    with pytest.raises(ConfigError, match="name the environment, e.g. textarena:GuessTheNumber-v0"):
        check_environment("textarena:")
    with pytest.raises(ConfigError, match="OpenEnv server http://127.0.0.1:9 does not answer|openenv library"):
        check_environment("openenv:http://127.0.0.1:9")


def test_skyrl_gym_environments_run_unchanged_scored_against_the_rows_ground_truth():
    prompt = [{"role": "user", "content": "What is 2 + 3? End with #### and the number."}]
    info, first, steps = asyncio.run(run_env("skyrl-gym:gsm8k", {"prompt": prompt, "answer": 5}, ["#### 5"]))
    assert info["kind"] == STEP and first == "" and steps == [("", 1.0, True, {})]
    # the multi-turn one: a wrong answer gets its own next instruction as a user message, and a turn reward
    _, _, steps = asyncio.run(
        run_env("skyrl-gym:gsm8k_multi_turn", {"prompt": prompt, "ground_truth": "5"}, ["#### 4", "#### 5"])
    )
    (obs, reward, done, _), last = steps
    assert "#### ANSWER" in obs and 0.0 < reward < 1.0 and not done, steps[0]
    assert last[1:3] == (1.0, True)
    with pytest.raises(EnvError, match="give the dataset a ground_truth"):
        asyncio.run(run_env("skyrl-gym:gsm8k", {"prompt": prompt}, []))


def test_gymnasium_reset_and_an_async_environment_that_keeps_its_connection():
    info, first, steps = asyncio.run(run_env(f"{HERE}:GymStyle", {"prompt": "x", "seed": 1}, ["a", "b"]))
    assert info["kind"] == STEP and first[0] == " Say anything." and steps[1][2:4] == (True, False)
    _, first, steps = asyncio.run(run_env(f"{HERE}:AsyncConnection", {"prompt": "x"}, ["hello", "again", "bye"]))
    assert first == " connected"
    assert [s[:3] for s in steps] == [("HELLO", 1.0, False), ("AGAIN", 1.0, False), ("BYE", 1.0, True)]


def test_an_environment_cannot_read_the_workers_credentials(monkeypatch):
    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIA-test",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "AWS_SESSION_TOKEN": "session",
        "BRIGADE_POOL_TOKEN": "pool-token",
        "BRIGADE_PROXY_ADMIN_TOKEN": "admin",
        "HF_TOKEN": "hf_x",
        "GOOGLE_APPLICATION_CREDENTIALS": "/keys.json",
    }
    for name, value in {**secrets, "JUDGE_API_KEY": "judge", "UNRELATED": "u", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    _, seen, _ = asyncio.run(run_env(f"{HERE}:Snoop", {"prompt": "x"}, [], passed_env=["JUDGE_API_KEY", "HF_TOKEN"]))
    env = json.loads(seen)
    assert not set(secrets) & set(env), sorted(env)  # not even HF_TOKEN, which the run named
    assert not any(v in seen for v in secrets.values())
    assert env["JUDGE_API_KEY"] == "judge" and env["OMP_NUM_THREADS"] == "1" and "UNRELATED" not in env
    assert env["PATH"] == os.environ["PATH"] and env["PYTHONPATH"]  # what it needs to run, and to import its module
    # the setting refuses a credential by name, and the pool token under the name the run gave it
    with pytest.raises(ValueError, match="never reach an environment"):
        RolloutConfig(environment_env=["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(ValueError, match=r"\['MY_POOL_KEY'\]"):
        RolloutConfig(pool_token_env="MY_POOL_KEY", environment_env=["MY_POOL_KEY"])
    assert "AWS_SECRET_ACCESS_KEY" not in environment_of(["AWS_SECRET_ACCESS_KEY"], source=secrets)


def test_a_library_environment_without_a_dataset_trains_on_rows_of_seeds():
    settings = RolloutConfig(environment="textarena:GuessTheNumber-v0")
    assert settings.dataset == "seeds:400" and settings.reward_funcs == []
    rows = seeds_rows("seeds:3")
    assert [r["seed"] for r in rows] == [0, 1, 2] and len({json.dumps(r["prompt"]) for r in rows}) == 1
    assert RolloutConfig(environment="textarena:GuessTheNumber-v0", dataset="rows.jsonl").dataset == "rows.jsonl"
    with pytest.raises(ValueError, match="skyrl-gym:gsm8k needs --rollout.dataset"):
        RolloutConfig(environment="skyrl-gym:gsm8k")
    with pytest.raises(ValueError, match="seeds:N with N a positive number"):
        seeds_rows("seeds:x")
