"""Prompt tokens and completions, through the proxy's vLLM-compatible API.

No tokenizer lives here: prompts are tokenised by the replicas' own tokenizer
(`/tokenize`), so the prompt ids the trainer sees are exactly what vLLM
generated from. A group's completions are asked for in one request (`n=G`,
`generation_shape = "n_group"`, the default: one prefill and one answer) or
one at a time (`n=1`); the proxy keeps a group's siblings on one replica
either way (they share its prompt's KV cache).

A request that fails for a reason that can pass (the proxy could not reach a
replica, a replica died mid-answer, a timeout) is sent again, with back-off,
instead of losing the whole group; one that can never succeed (a 4xx: a bad
body, an adapter that is not loaded) fails the group at once.

With `rollout.switch_after` set (`switch`, rollout_worker/switch.py), a completion is asked for in chunks and
each unfinished one continued on its own, under the newest live version when the switch rule says so.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import httpx

from bucket.pool import ADAPTER_RETIRED
from bucket.rollouts import Sample, SamplingParams
from rollout_worker.config import RolloutConfig
from rollout_worker.switch import Live, Pieces, Switch

log = logging.getLogger("brigade.rollout")

RETRY_STATUSES = frozenset({500, 502, 503, 504})
MAX_ATTEMPTS = 6
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 8.0


class GenerationFailed(RuntimeError):
    """A completion that failed for good (or after every retry)."""


class AdapterRetired(GenerationFailed):
    """A pool's proxy did not generate with this version: it fell past the run's staleness window while the
    request waited (its samples would not be trained on). The group is generated again with a live version."""


class Generator:
    def __init__(
        self,
        client: httpx.AsyncClient,
        base_model: str,
        sampling: SamplingParams,
        max_completion_length: int,
        shape: str = "n_1",
    ):
        self.client, self.base_model, self.sampling = client, base_model, sampling
        self.max_completion_length = max_completion_length
        self.shape = shape  # "n_1": one request per completion; "n_group": one request for the group
        self.token_cache: dict[str, list[int]] = {}  # the dataset is cycled: each prompt is tokenised once
        self.retries: collections.Counter[str] = collections.Counter()  # requests sent again, by reason (metrics)
        self.switch: Switch | None = None  # rollout.switch_after set: chunked completions (switch.py)
        # vLLM's request priority (bucket/priority.py); None sends none (training generation's 0). Evaluation
        # episodes set EVALUATION, so that their turns queue behind the rollouts training waits for.
        self.priority: int | None = None

    @classmethod
    def for_settings(
        cls, client: httpx.AsyncClient, base_model: str, sampling: SamplingParams, rc: RolloutConfig, live: Live
    ) -> Generator:
        """The worker's generator: the `[rollout]` table's length and shape, and the switch when it is on."""
        gen = cls(client, base_model, sampling, rc.max_completion_length, rc.generation_shape)
        if rc.switch_after is not None:
            gen.switch = Switch(rc.switch_after, rc.switch_chunk_tokens, live)
        return gen

    async def prompt_ids(self, row: dict[str, Any]) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids); a chat prompt gets the chat template and its assistant turn."""
        prompt = row["prompt"]
        key = repr(prompt)
        if key not in self.token_cache:
            body: dict[str, Any] = {"model": self.base_model}
            if isinstance(prompt, list):
                body |= {"messages": prompt, "add_generation_prompt": True}
            else:
                body |= {"prompt": prompt}
            resp = await self._post("/tokenize", body)
            self.token_cache[key] = resp.json()["tokens"]
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        return text, self.token_cache[key]

    async def completions(self, model: str, ids: list[int], n: int) -> list[Sample]:
        """`n` completions; each is retried on its own, and a group fails only after every sibling has ended."""
        if self.shape == "n_group":
            resp = await self._post("/v1/completions", self._body(model, ids, n, self._first_chunk()))
            data = _check_served(model, resp.json())
            samples = [self._sample(resp, choice, data) for choice in sorted(data["choices"], key=_index)]
            if len(samples) != n:
                raise GenerationFailed(f"asked for {n} completions in one request, got {len(samples)}")
            if self.switch is None:
                return samples
            # the siblings continue one by one: each its own n=1 request (one may switch, another may be done)
            version = self.switch.live.version_of(model)
            rest = await asyncio.gather(*(self._continued(ids, s, version) for s in samples), return_exceptions=True)
            return _all(rest)
        return _all(await asyncio.gather(*(self.one_completion(model, ids) for _ in range(n)), return_exceptions=True))

    async def one_completion(self, model: str, ids: list[int]) -> Sample:
        """One sampled completion with vLLM's logprob of each token (the trainer's importance-ratio denominator)."""
        resp = await self._post("/v1/completions", self._body(model, ids, 1, self._first_chunk()))
        data = _check_served(model, resp.json())
        sample = self._sample(resp, data["choices"][0], data)
        if self.switch is None:
            return sample
        return await self._continued(ids, sample, self.switch.live.version_of(model))

    def _first_chunk(self) -> int:
        size = self.switch.chunk_tokens if self.switch is not None else self.max_completion_length
        return min(size, self.max_completion_length)

    async def _continued(self, ids: list[int], first: Sample, version: int) -> Sample:
        """A completion whose first chunk `version` sampled, continued chunk by chunk until it stops or its
        budget is spent; each continuation's prompt is the prompt plus every token so far (switch.py)."""
        sw = self.switch
        assert sw is not None
        pieces = Pieces()
        pieces.add(first, version)
        while pieces.unfinished(self.max_completion_length):
            nxt = sw.version_for(pieces.version)
            sw.counted(pieces.version, nxt, len(ids) + len(pieces.ids))
            model = sw.model_name(nxt)
            room = min(sw.chunk_tokens, self.max_completion_length - len(pieces.ids))
            resp = await self._post("/v1/completions", self._body(model, ids + pieces.ids, 1, room))
            data = _check_served(model, resp.json())
            chunk = self._sample(resp, data["choices"][0], data)
            if not chunk.completion_ids and chunk.finish_reason == "length":
                raise GenerationFailed(f"{model} continued a completion with no token and finish_reason 'length'")
            pieces.add(chunk, nxt)
        return pieces.sample()

    def _body(self, model: str, ids: list[int], n: int, max_tokens: int | None = None) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens or self.max_completion_length,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
            "logprobs": 0,
            "return_token_ids": True,
            "n": n,
        } | ({} if self.priority is None else {"priority": self.priority})

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        """POST through the proxy; a 5xx or no answer is sent again with back-off, a 4xx fails at once. `headers`:
        an episode's turns carry its key (X-Session-ID, rollout_worker/environments/)."""
        delay = RETRY_FIRST_S
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                resp = await self.client.post(path, json=body, headers=headers)
            except httpx.TransportError as exc:
                problem, reason = f"{type(exc).__name__}: {exc}", "no_answer"
            else:
                if resp.status_code == 200:
                    return resp
                problem, reason = f"HTTP {resp.status_code}: {resp.text[:300]}", f"http_{resp.status_code}"
                if resp.status_code == 409 and _reason(resp) == ADAPTER_RETIRED:
                    raise AdapterRetired(f"{path}: {problem}")
                if resp.status_code not in RETRY_STATUSES:
                    raise GenerationFailed(f"{path} failed ({problem})")
            if attempt == MAX_ATTEMPTS:
                break
            self.retries[reason] += 1
            log.warning(
                "%s failed (%s); retrying in %.1fs (attempt %d of %d)", path, problem, delay, attempt, MAX_ATTEMPTS
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
        raise GenerationFailed(f"{path} failed after {MAX_ATTEMPTS} attempts (last: {problem})")

    def _sample(self, resp: httpx.Response, choice: dict[str, Any], data: dict[str, Any]) -> Sample:
        token_ids = choice.get("token_ids")
        logprobs = choice["logprobs"]["token_logprobs"]
        if token_ids is None:
            raise RuntimeError(
                "the replica returned no token_ids: it must be a vLLM server that supports return_token_ids"
            )
        return Sample(
            completion_ids=token_ids,
            logprobs=[float(x) for x in logprobs],
            text=choice["text"],
            reward=0.0,  # scored once the whole group is in
            finish_reason=choice.get("finish_reason"),
            replica=resp.headers.get("x-brigade-replica", ""),
            model=str(data.get("model") or ""),
        )


def _all(results: list[Any]) -> list[Sample]:
    """Every sibling's sample, or the failure to raise once all have ended."""
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # any failure but a retired version first: that one is not worth generating the group again
        raise next((r for r in failed if not isinstance(r, AdapterRetired)), failed[0])
    return list(results)


def _check_served(model: str, data: dict[str, Any]) -> dict[str, Any]:
    """The answer, once it says the model asked for served it: a group records the version that served it, so
    an answer from another one must not be kept under it."""
    served = data.get("model")
    if isinstance(served, str) and served != model:
        raise GenerationFailed(f"asked {model!r} for a completion, and {served!r} answered")
    return data


def _index(choice: dict[str, Any]) -> int:
    return int(choice.get("index", 0))


def _reason(resp: httpx.Response) -> object:
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get("reason") if isinstance(body, dict) else None
