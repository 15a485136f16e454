"""The length check's inputs: the environment's tools, and the replicas' tokenizer through /tokenize.

`brigade local` runs the check (rollout_worker/length_check.py) before its replicas start, with the model
folder's tokenizer; a rollout worker started on its own runs it again before its first group with the
replicas' own tokenizer, on fewer rows (each is a request to the proxy), so that a deployment without
`brigade local` is refused too before it spends a step on cut tool calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from bucket.config import ConfigError
from rollout_worker.config import RolloutConfig
from rollout_worker.environments.contract import TOOLS, EnvError, describe, import_factory
from rollout_worker.environments.host import EnvProcess
from rollout_worker.environments.libraries import is_library
from rollout_worker.environments.schema import EnvSpecError
from rollout_worker.length_check import LengthCheck, check_lengths
from rollout_worker.lengths import fit_episodes

log = logging.getLogger(__name__)

WORKER_ROWS = 32  # rows the worker tokenizes through the proxy (brigade local checked more, locally)


async def environment_tools(spec: str, timeout_s: float, passed_env: Sequence[str] = ()) -> list[dict[str, Any]] | None:
    """The tools' schemas of the environment `spec` (None for a text-step environment). A class's are read
    from the class (no instance made); any other factory's from one instance made in an environment process
    of its own, as an episode's is: a factory that raises or hangs costs this check, never the job (EnvError)."""
    if is_library(spec):
        return None  # a library's adapter is a text-step environment: no tools
    factory = import_factory(spec)
    if inspect.isclass(factory):
        described = describe(factory)
        return list(described.tools) if described.kind == TOOLS else None
    proc = EnvProcess(passed_env)
    try:
        info = await proc.call("create", spec, timeout_s=timeout_s)
    finally:
        proc.close()
    return list(info["tools"]) if info.get("kind") == TOOLS else None


async def tools_or_warn(settings: RolloutConfig) -> list[dict[str, Any]] | None:
    if not settings.environment:
        return None
    try:
        return await environment_tools(settings.environment, settings.environment_timeout_s, settings.environment_env)
    except (EnvError, EnvSpecError) as exc:
        log.warning("lengths not checked against the environment's tools: making one failed: %s", exc)
        return None


def report(check: LengthCheck, where: str) -> None:
    """Warnings logged; refusals raised as one ConfigError (exit status 2, no traceback)."""
    for warning in check.warnings:
        log.warning("%s", warning)
    if check.refusals:
        raise ConfigError(f"{where}: the lengths set cannot serve this run:\n  " + "\n  ".join(check.refusals))


class ProxyTokens:
    """The replicas' tokenizer, through the proxy's /tokenize (what the worker's prompts really become)."""

    def __init__(self, client: httpx.Client, base_model: str):
        self.client, self.base_model = client, base_model

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        resp = self.client.post("/tokenize", json={"model": self.base_model, **body})
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    def encode(self, text: str) -> list[int]:
        return self._tokens({"prompt": text})

    def max_model_len(self) -> int | None:
        """The replicas' limit on a request, as vLLM's /tokenize reports it (None from a server that does not)."""
        resp = self.client.post("/tokenize", json={"model": self.base_model, "prompt": "x"})
        resp.raise_for_status()
        value = resp.json().get("max_model_len")
        return int(value) if isinstance(value, int) else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        return self._tokens(body | ({"tools": tools} if tools else {}))


async def check_worker_lengths(
    settings: RolloutConfig, train: Any, eval_rows: Any, url: str, headers: dict[str, str], base_model: str
) -> None:
    """The worker's check, before its first group: raises ConfigError when a tool call or answer cannot fit. An
    episode bound not given is first fitted to the replicas' max_model_len (`settings` changes then)."""
    tools = await tools_or_warn(settings)
    train = train.select(range(min(WORKER_ROWS, len(train))))
    if eval_rows is not None and len(eval_rows):
        eval_rows = eval_rows.select(range(min(WORKER_ROWS, len(eval_rows))))

    def run() -> LengthCheck:
        with httpx.Client(base_url=url, headers=headers, timeout=settings.request_timeout_s) as client:
            tokens = ProxyTokens(client, base_model)
            # the replicas' max_model_len: a deployment started without `brigade local` has it from its own flags
            limit = tokens.max_model_len()
            fitted = fit_episodes(settings, limit)  # before the Worker reads the settings (the shards' bound)
            if fitted:
                log.info("%s", fitted)
            return check_lengths(settings, train, eval_rows, tokens, tools, limit)

    report(await asyncio.to_thread(run), "rollout worker")
