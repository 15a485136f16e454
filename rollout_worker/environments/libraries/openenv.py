"""`--rollout.environment openenv:TARGET`: an OpenEnv environment, unchanged, as a text-step environment.

    openenv:http://HOST:PORT   a running OpenEnv server (a container, a Space): OpenEnv's own GenericEnvClient,
                               async over its persistent WebSocket session, one session per episode. The client
                               lives on the environment process's one event loop (host.py), so the connection
                               opened by `reset` serves every `step` of the episode.
    openenv:module:Class       the server-side `Environment` class itself, made in the environment's process (no
                               server): `Class()`, then its reset_async / step_async.

    reset(**row)   reset(seed=row's seed); the observation's text (below) is appended to the row's prompt
    step(reply)    the reply as the action's one text field (the action schema must have exactly one string field
                   besides `metadata`, else the environment is refused at start); the observation's text is the
                   next user message, its `reward` (None = 0) adds to the episode's, its `done` ends the episode
    close()        the client's session is closed (a server-side class: its close())

An observation's text: its one string field when it has exactly one besides done/reward/metadata, else its fields
as JSON.
"""

from __future__ import annotations

import importlib
import json
import typing
from typing import Any

from rollout_worker.environments.libraries.common import row_seed
from rollout_worker.environments.schema import EnvSpecError

SKIPPED = ("done", "reward", "metadata")


def _import() -> Any:
    try:
        import openenv.core
    except ImportError as exc:
        from rollout_worker.environments.libraries import missing_library

        raise missing_library("openenv", exc) from None
    return openenv.core


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://", "ws://", "wss://"))


def text_field(schema: dict[str, Any], where: str) -> str:
    """The action's one string field (a JSON schema's properties), or EnvSpecError naming the fields it has."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) != 1:
        raise EnvSpecError(
            f"OpenEnv {where}: its action has fields {sorted(props)}; brigade sends each reply as the action's one "
            "text field, so it needs exactly one string field"
        )
    return strings[0]


def observation_text(obs: Any) -> str:
    data = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs or {})
    fields = {k: v for k, v in data.items() if k not in SKIPPED}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return str(next(iter(fields.values())))
    return json.dumps(fields, sort_keys=True, default=str)


def _environment_class(target: str) -> type:
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise EnvSpecError(f"openenv:{target}: give an OpenEnv server's URL or its Environment class as module:Class")
    core = _import()
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise EnvSpecError(f"openenv:{target} cannot be imported ({exc})") from None
    base = core.env_server.Environment
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise EnvSpecError(f"openenv:{target} is not a subclass of OpenEnv's Environment")
    return cls


def _action_class(cls: type) -> type:
    hint = typing.get_type_hints(cls.step).get("action")
    if isinstance(hint, type) and hasattr(hint, "model_json_schema"):
        return hint
    for base in getattr(cls, "__orig_bases__", ()):  # Environment[MyAction, MyObservation, MyState]
        args = typing.get_args(base)
        if args and isinstance(args[0], type) and hasattr(args[0], "model_json_schema"):
            return args[0]
    raise EnvSpecError(f"OpenEnv {cls.__name__}: its step() names no Action class (annotate step's action)")


class OpenEnvEnv:
    """One episode of an OpenEnv environment (a server by URL, or its class in-process)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.client: Any = None
        self.env: Any = None
        self.field = ""
        self.action_cls: Any = None

    @classmethod
    async def check(cls, target: str) -> None:
        _import()  # the client (or the class's base) is OpenEnv's own: the library must be installed
        if is_url(target):
            await cls._schema_field(target)
        else:
            env_cls = _environment_class(target)
            text_field(_action_class(env_cls).model_json_schema(), target)

    @staticmethod
    async def _schema_field(url: str) -> str:
        import httpx

        http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                resp = await client.get(f"{http}/schema")
                resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise EnvSpecError(f"OpenEnv server {url} does not answer GET /schema ({exc!r}): is it running?") from None
        return text_field(resp.json().get("action") or {}, url)

    async def reset(self, **row: Any) -> str:
        seed = row_seed(row)
        if is_url(self.target):
            core = _import()
            self.field = await self._schema_field(self.target)
            self.client = core.GenericEnvClient(base_url=self.target)
            result = await self.client.reset(seed=seed)
            obs = result.observation
        else:
            env_cls = _environment_class(self.target)
            self.action_cls = _action_class(env_cls)
            self.field = text_field(self.action_cls.model_json_schema(), self.target)
            self.env = env_cls()
            obs = await self.env.reset_async(seed=seed)
        text = observation_text(obs)
        return f"\n\n{text}" if text else ""

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.client is not None:
            result = await self.client.step({self.field: action})
            obs, reward, done = result.observation, result.reward, result.done
        else:
            obs = await self.env.step_async(self.action_cls(**{self.field: action}))
            reward, done = obs.reward, obs.done
        return observation_text(obs), float(reward or 0.0), bool(done), {}

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        elif self.env is not None:
            self.env.close()
