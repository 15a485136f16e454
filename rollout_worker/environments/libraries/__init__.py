"""Environments of libraries, named instead of written: `--rollout.environment LIBRARY:TARGET`.

    textarena:GAME-ID         a single-player TextArena game (`textarena:GuessTheNumber-v0`)   textarena.py
    skyrl-gym:ENV-ID          a skyrl-gym text environment (`skyrl-gym:gsm8k`)                 skyrl_gym.py
    openenv:URL | module:Cls  an OpenEnv server by its URL, or its Environment class in-process openenv.py

Each adapter is a class of brigade's text-step contract (contract.py: `reset(**row) -> str`, `step(action) ->
(observation, reward, done, info)`) around the library's own environment, which runs unchanged. The adapter
modules import their library only when an instance is made, in the environment's own process (host.py): the worker
reads the name without it, and checks it at start in a process of its own (`check_spec`).

A library's environment draws its episode from a seed rather than from a prompt, so a run that names one without a
dataset gets rows of one instruction with a `seed` column (seeds.py); skyrl-gym's environments score against the
row's ground truth and need the user's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rollout_worker.environments.schema import EnvSpecError

LIBRARIES = ("textarena", "skyrl-gym", "openenv")
EXAMPLES = {
    "textarena": "textarena:GuessTheNumber-v0",
    "skyrl-gym": "skyrl-gym:gsm8k",
    "openenv": "openenv:http://127.0.0.1:8000 or openenv:my_env.server:MyEnvironment",
}
EXTRAS = {"textarena": "brigade[textarena]", "skyrl-gym": "brigade[skyrl-gym]", "openenv": "brigade[openenv]"}


def is_library(spec: str) -> bool:
    """Whether `spec` names a library's environment (LIBRARY:TARGET) rather than a factory (module:callable)."""
    return spec.partition(":")[0] in LIBRARIES


def split(spec: str) -> tuple[str, str]:
    """(library, target), or EnvSpecError with the form to use."""
    library, _, target = spec.partition(":")
    if library not in LIBRARIES:
        raise EnvSpecError(f"--rollout.environment {spec!r} names no library; known: {', '.join(LIBRARIES)}")
    if not target.strip():
        raise EnvSpecError(f"--rollout.environment {spec!r}: name the environment, e.g. {EXAMPLES[library]}")
    return library, target.strip()


def _adapter(library: str) -> Any:
    if library == "textarena":
        from rollout_worker.environments.libraries.textarena import TextArenaGame

        return TextArenaGame
    if library == "skyrl-gym":
        from rollout_worker.environments.libraries.skyrl_gym import SkyRLGymEnv

        return SkyRLGymEnv
    from rollout_worker.environments.libraries.openenv import OpenEnvEnv

    return OpenEnvEnv


def factory(spec: str) -> Callable[[], Any]:
    """One adapter instance per episode, as a factory named by module:callable gives one."""
    library, target = split(spec)
    return functools.partial(_adapter(library), target)


async def check_spec(spec: str) -> None:
    """Raises EnvSpecError saying what is wrong when the named environment cannot run here: the library is not
    installed, the id is unknown, the game needs more than one player, the server does not answer."""
    library, target = split(spec)
    await _adapter(library).check(target)


def missing_library(library: str, exc: ImportError) -> EnvSpecError:
    return EnvSpecError(
        f"--rollout.environment {library}:...: the {library} library does not import ({exc}); install the rollout "
        f"worker with `pip install '{EXTRAS[library]}'`"
    )


def default_dataset(spec: str) -> str:
    """The --rollout.dataset a run that names `spec` and no dataset trains on (seeds.py); ValueError when the
    library's environments need the user's rows."""
    library, target = split(spec)
    if library == "skyrl-gym":
        raise ValueError(
            f"--rollout.environment {spec} needs --rollout.dataset: skyrl-gym's environments score a reply against "
            "the row's ground truth, so give rows with the question as `prompt` and a `ground_truth` (or `answer`, "
            "or skyrl's `reward_spec`) column"
        )
    from rollout_worker.environments.libraries.seeds import DEFAULT_ROWS, seeds_spec

    return seeds_spec(DEFAULT_ROWS)
