"""Reward functions, with TRL's signature, and how the worker calls them.

    f(completions, prompts, completion_ids, **dataset_columns) -> list[float | None]   (sync or async)

As in TRL, `completions` and `prompts` are plain strings for a text prompt and
chat messages for a conversational one (`[{"role": "assistant", "content": ...}]`
per completion), so TRL's own reward functions (`trl.rewards:accuracy_reward`)
work unchanged. `None` means "not applicable to this sample". Several functions
are summed, each times its weight. Any importable function of that shape can be
named in --rollout.reward-funcs as module:function.

Built in:
  exact_match         1.0 when the completion's answer (its last number) equals the `answer` column by value
  math_verify_reward  1.0 when math-verify finds the completion's answer equivalent to `answer` (LaTeX, fractions, ...)
  format_reward       1.0 when the completion is the answer alone (one number, nothing else)

`Scorer` runs every function in a process pool, off the worker's request loop:
math-verify's timeouts rely on signals, which work only in a process's main
thread, and a slow reward must never stall generation. A function that raises
or outlives `timeout_s` gives None for that group (counted, never a crash).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import multiprocessing
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from bucket.config import ConfigError

log = logging.getLogger("brigade.rollout")

RewardFunc = Callable[..., Any]  # returns list[float | None], or an awaitable of it

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ONLY_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string or as TRL's conversational form."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def extract_number(text: str) -> float | None:
    """The answer a completion gives: its last number (thousands separators ignored), or None.

    One extractor for training and evaluation, base model and adapters alike. The
    last number, not the first: a model that restates the question ("3 + 4 = 7")
    is judged by its result.
    """
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def same_number(text: str, answer: Any) -> bool:
    """Whether the completion's answer equals `answer` by value."""
    got = extract_number(text)
    try:
        return got is not None and got == float(str(answer).replace(",", ""))
    except ValueError:
        return False


def exact_match(completions: list[Any], answer: list[Any], **_: object) -> list[float | None]:
    """1.0 when the completion's last number equals the answer by value, else 0.0."""
    return [1.0 if same_number(completion_text(c), a) else 0.0 for c, a in zip(completions, answer)]


def format_reward(completions: list[Any], **_: object) -> list[float | None]:
    """1.0 when the completion is a number and nothing else (the format the built-in prompts ask for)."""
    return [1.0 if _ONLY_NUMBER.fullmatch(completion_text(c)) else 0.0 for c in completions]


def math_verify_reward(completions: list[Any], answer: list[Any], **_: object) -> list[float | None]:
    """1.0 when math-verify judges the completion's answer equivalent to the gold answer; None if the gold
    answer does not parse (not applicable). Runs math-verify's own timeouts, so it needs a main thread:
    the worker calls it in its reward process pool."""
    from math_verify import parse, verify

    out: list[float | None] = []
    for c, a in zip(completions, answer):
        gold = parse(str(a))
        if not gold:
            out.append(None)
            continue
        out.append(1.0 if verify(gold, parse(completion_text(c))) else 0.0)
    return out


def import_reward(spec: str) -> RewardFunc:
    """The function named by 'module:function'; a bad name is a setting error, reported before any generation."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"reward function {spec!r} cannot be imported ({exc}); give it as module:function") from None
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is not callable")
    return fn


# What the worker passes every reward function besides the dataset's columns (Scorer.score_batch; episodes add
# `environments`).
PASSED = ("completions", "prompts", "completion_ids")


def missing_arguments(spec: str, columns: set[str]) -> list[str]:
    """The required parameters of the function named `spec` that neither the worker nor `columns` supply: every
    call of it would raise TypeError. Empty when it takes them all (or has no signature to read)."""
    fn = import_reward(spec)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension function without a readable signature
        return []
    given = set(PASSED) | columns
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in named and p.default is p.empty and p.name not in given]


def call_reward(spec: str, kwargs: dict[str, Any]) -> list[float | None]:
    """Run one reward function (in a pool process): import it, call it, await it if async, check the result."""
    fn = import_reward(spec)
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    out = list(out)
    n = len(kwargs["completions"])
    if len(out) != n:
        raise ValueError(f"returned {len(out)} rewards for {n} completions")
    return [None if r is None else float(r) for r in out]


async def _awaited(aw: Any) -> Any:
    return await aw


@dataclass
class Scored:
    """Per completion: the weighted sum (None where every function said None), and each function's failures."""

    totals: list[float | None]
    failures: list[tuple[str, str]]  # (function, error) for each function that raised or timed out


class Scorer:
    """The reward functions, weighted and summed, each call in a process of a pool."""

    def __init__(self, specs: list[str], weights: list[float], timeout_s: float, workers: int = 1):
        if weights and len(weights) != len(specs):
            raise ConfigError(f"{len(weights)} reward weights for {len(specs)} reward functions")
        for spec in specs:
            import_reward(spec)  # a bad name fails at start, not in the pool
        self.specs, self.weights = specs, weights or [1.0] * len(specs)
        self.timeout_s, self.workers = timeout_s, workers
        self.failed = 0  # function calls that raised or timed out
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the worker's event loop and threads are not copied into the pool's processes
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _restart(self, pool: ProcessPoolExecutor) -> None:
        """A call that timed out still occupies a pool process: drop that pool, killing its processes (once: calls
        that failed with it do not restart the pool that replaced it)."""
        if self._pool is not pool:
            return
        self._pool = None
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def _one(self, spec: str, kwargs: dict[str, Any]) -> list[float | None] | str:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        pool = self._executor()
        try:
            fut = loop.run_in_executor(pool, call_reward, spec, kwargs)
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            self._restart(pool)
            return f"timed out after {time.monotonic() - t0:.1f}s"
        except Exception as exc:  # noqa: BLE001 - a user's function may raise anything
            if isinstance(exc, BrokenProcessPool):
                self._restart(pool)
            return f"{type(exc).__name__}: {exc}"

    async def score(
        self, completions: list[Any], prompt: Any, completion_ids: list[list[int]], row: dict[str, Any]
    ) -> Scored:
        """Every function on one group. Dataset columns other than the prompt are passed as keywords, one value
        per completion, as TRL does."""
        n = len(completions)
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        return await self.score_batch(completions, [prompt] * n, completion_ids, columns)

    async def score_batch(
        self, completions: list[Any], prompts: list[Any], completion_ids: list[list[int]], columns: dict[str, list]
    ) -> Scored:
        """Every function on completions of any prompts, each column holding one value per completion."""
        n = len(completions)
        kwargs = {"completions": completions, "prompts": prompts, "completion_ids": completion_ids, **columns}
        # One function at a time: they share the pool, and a timeout restarts it.
        totals: list[float | None] = [None] * n
        failures = []
        for spec, weight in zip(self.specs, self.weights):
            out = await self._one(spec, kwargs)
            if isinstance(out, str):
                self.failed += 1
                failures.append((spec, out))
                log.warning("reward function %s failed on %d completions: %s (their rewards are None)", spec, n, out)
                continue
            totals = [t if r is None else (t or 0.0) + weight * r for t, r in zip(totals, out)]
        return Scored(totals, failures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
