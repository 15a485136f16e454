"""The two environment contracts users already write, told apart by whether the class has `step`.

  TRL's `environment_factory` ("tools"): `reset(**row) -> str | None` (a string is appended to the last user
      message), every public method a tool, optional `get_reward() -> float` read when the episode ends.
  Text-step ("step"): `reset(**row) -> str` is the first observation (gymnasium's `(observation, info)` is read
      too), `step(action: str) -> (observation, reward, done, info)`; gymnasium's five-tuple
      `(observation, reward, terminated, truncated, info)` is read too. skyrl-gym, TextArena and OpenEnv
      environments are run through adapters to this contract (libraries/).

`--rollout.environment package.module:factory` names a callable (a class, or a function) returning one instance
per episode, as TRL's `environment_factory` is. This module is imported by the environment's own process
(host.py) and by the worker, which checks that the name imports before anything is generated.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_worker.environments.schema import EnvSpecError, tool_schema

TOOLS, STEP = "tools", "step"
NOT_TOOLS = frozenset({"reset", "get_reward"})  # TRL's: every other public method is a tool


class EnvError(RuntimeError):
    """An environment that broke its contract, raised, hung or died: ends its own episode, never the worker."""


def import_factory(spec: str) -> Callable[[], Any]:
    """The callable named by 'package.module:factory', or a library's environment by name ('textarena:GAME',
    'skyrl-gym:ID', 'openenv:TARGET': libraries/); a bad name is a setting error, reported at start."""
    from rollout_worker.environments import libraries  # its adapters import their library only when used

    if libraries.is_library(spec):
        return libraries.factory(spec)
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise EnvSpecError(f"--rollout.environment {spec!r}: give it as package.module:factory")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise EnvSpecError(f"--rollout.environment {spec!r} cannot be imported ({exc})") from None
    if not callable(obj):
        raise EnvSpecError(f"--rollout.environment {spec!r} is not callable: name a class or a function")
    return obj


@dataclass
class Described:
    """What the worker needs to know of an instance: its contract, its tools' schemas, whether it scores."""

    kind: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    has_reward: bool = False


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """The instance's tools, as TRL finds them: functions on the class (not properties), public, not reset or
    get_reward. Given the class itself (the worker's check at start), its functions."""
    cls = env if inspect.isclass(env) else type(env)
    return {
        name: getattr(env, name)
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def describe(env: Any) -> Described:
    """The contract an instance (or a class) follows; raises EnvSpecError when it follows neither, or when a
    tool's schema cannot be built."""
    cls = (env if inspect.isclass(env) else type(env)).__name__
    if not callable(getattr(env, "reset", None)):
        raise EnvSpecError(f"environment {cls} has no reset method: both contracts need reset(**row)")
    if callable(getattr(env, "step", None)):
        return Described(STEP)
    has_reward = callable(getattr(env, "get_reward", None))
    return Described(TOOLS, [tool_schema(fn) for fn in tool_methods(env).values()], has_reward)


def check_observation(value: Any, kind: str) -> str | None:
    """reset's return, checked: a string (or None, for TRL's contract); a text-step environment may return
    gymnasium's `(observation, info)` too."""
    if value is None and kind == TOOLS:
        return None
    if kind == STEP and isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = value[0]
    if not isinstance(value, str):
        wanted = "a string or None" if kind == TOOLS else "a string (the first observation)"
        raise EnvError(f"reset returned {type(value).__name__} {value!r:.80}; the contract wants {wanted}")
    return value


def check_step(value: Any) -> tuple[str, float, bool]:
    """step's return, checked: (observation, reward, done[, truncated], info) -> (observation, reward, done)."""
    if not isinstance(value, (tuple, list)) or len(value) not in (4, 5):
        raise EnvError(
            f"step returned {type(value).__name__} {value!r:.80}; the contract wants (observation, reward, done, "
            "info) or gymnasium's (observation, reward, terminated, truncated, info)"
        )
    obs, reward, *flags = value[:-1]
    if not isinstance(obs, str):
        raise EnvError(f"step's observation is {type(obs).__name__} {obs!r:.80}, not a string")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward:
        raise EnvError(f"step's reward is {reward!r:.80}, not a number")
    return obs, float(reward), any(bool(f) for f in flags)


def check_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise EnvError(f"get_reward returned {value!r:.80}, not a number")
    return float(value)
