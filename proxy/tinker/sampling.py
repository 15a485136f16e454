"""A Tinker `sample` as a vLLM completion through the proxy's own forwarder (routing, slots, version holds).

The prompt's token ids go to /v1/completions as a token-id prompt, as the rollout worker sends its own, with
`return_token_ids` and `logprobs: 0` (the sampled token's logprob); the answer's choices become the SDK's
sequences. Stop strings are kept in the tokens (`include_stop_str_in_output`), as Tinker returns them, so a
renderer that parses the reply finds its stop; `stop: []` turns off EOS as well (vLLM's `ignore_eos`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from proxy.serving.forwarding import Forwarder
from proxy.tinker.wire import encode_sample_response


class SampleFailed(Exception):
    """The replica refused or broke off the completion; `user` when the request itself was at fault (4xx)."""

    def __init__(self, message: str, user: bool) -> None:
        super().__init__(message)
        self.user = user


class BufferSink:
    """A generation answer collected in memory (the forwarder's `ClientSink`), for a caller inside the proxy."""

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []
        self.exchange: Any = None
        self.failure: str | None = None
        self.done = asyncio.get_running_loop().create_future()

    def error(self, status: int, body: bytes) -> None:
        self.status, self.chunks = status, [body]
        self.end()

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        self.status = status

    def body(self, data: bytes) -> None:
        self.chunks.append(data)

    def end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def abort(self, message: str) -> None:
        self.failure = message
        self.end()


def completion_body(
    model: str, tokens: list[int], num_samples: int, params: dict[str, Any], prompt_logprobs: bool
) -> dict[str, Any]:
    """The /v1/completions body of one SampleRequest (its `sampling_params` as the SDK sent them)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": tokens,
        "n": num_samples,
        "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0),
        "top_k": params.get("top_k", -1),
        "logprobs": 0,
        "return_token_ids": True,
    }
    if params.get("max_tokens") is not None:
        body["max_tokens"] = params["max_tokens"]
    if params.get("seed") is not None:
        body["seed"] = params["seed"]
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not stop:
            body["ignore_eos"] = True  # Tinker's `stop=[]`: no stop at all, EOS included
        elif all(isinstance(s, int) for s in stop):
            body["stop_token_ids"] = list(stop)
        elif all(isinstance(s, str) for s in stop):
            body["stop"] = list(stop)
            body["include_stop_str_in_output"] = True
        else:
            raise ValueError("sampling_params.stop mixes strings and token ids: give one kind")
    if prompt_logprobs:
        body["prompt_logprobs"] = 0
    return body


async def complete(forwarder: Forwarder, body: dict[str, Any]) -> dict[str, Any]:
    """Send one completion through the forwarder and wait for its whole answer."""
    sink = BufferSink()
    await forwarder.generate("/v1/completions", json.dumps(body).encode(), sink)
    await sink.done
    raw = b"".join(sink.chunks)
    if sink.failure is not None:
        raise SampleFailed(f"the replica broke off the completion: {sink.failure}", user=False)
    if sink.status != 200:
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw[:500].decode(errors="replace")
        raise SampleFailed(f"the replica answered HTTP {sink.status}: {message}", user=400 <= sink.status < 500)
    return json.loads(raw)


def sequences_of(answer: dict[str, Any]) -> list[tuple[list[int], list[float], str]]:
    """(tokens, sampled-token logprobs, stop reason) of each choice, in the choices' order."""
    out = []
    for choice in sorted(answer.get("choices", []), key=lambda c: c.get("index", 0)):
        tokens = choice.get("token_ids")
        if tokens is None:
            raise SampleFailed("the replica returned no token_ids: it must be a vLLM that supports them", user=False)
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        out.append((list(tokens), logprobs, "length" if choice.get("finish_reason") == "length" else "stop"))
    return out


def prompt_logprobs_of(answer: dict[str, Any], prompt: list[int]) -> list[float | None]:
    """The prompt's logprobs (None at the first position, which has no context) from vLLM's `prompt_logprobs`."""
    choices = answer.get("choices") or [{}]
    entries = choices[0].get("prompt_logprobs") or []
    out: list[float | None] = []
    for i, token in enumerate(prompt):
        entry = entries[i] if i < len(entries) else None
        if not entry:
            out.append(None)
            continue
        hit = entry.get(str(token)) or entry.get(token)
        out.append(float(hit["logprob"]) if isinstance(hit, dict) else None)
    return out


KEEP_DONE_S = 300.0  # a finished sample's answer stays this long for the SDK to fetch (and retry fetching)


class SampleRuns:
    """The samples in flight and just finished, by request id (`sample:<uuid>`): asample answers at once with
    the id and its `sample_sequence_ids`, and retrieve_future fetches the answer."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[bytes]] = {}
        self.done_at: dict[str, float] = {}

    def start(
        self, forwarder: Forwarder, request: dict[str, Any], prompt: list[int], with_prompt: bool, last_n: int | None
    ) -> str:
        now = time.monotonic()
        for rid in [r for r, at in self.done_at.items() if now - at > KEEP_DONE_S]:
            self.tasks.pop(rid, None)
            self.done_at.pop(rid, None)
        request_id = f"sample:{uuid.uuid4().hex}"
        self.tasks[request_id] = asyncio.create_task(
            self._run(request_id, forwarder, request, prompt, with_prompt, last_n)
        )
        return request_id

    async def _run(
        self,
        request_id: str,
        forwarder: Forwarder,
        request: dict[str, Any],
        prompt: list[int],
        with_prompt: bool,
        last_n: int | None,
    ) -> bytes:
        try:
            answer = await complete(forwarder, request)
            lps = prompt_logprobs_of(answer, prompt) if with_prompt else None
            if lps is not None and last_n:  # only the last n scored, as the client asked
                lps = [None] * (len(lps) - last_n) + lps[len(lps) - last_n :]
            return encode_sample_response(sequences_of(answer), lps)
        finally:
            self.done_at[request_id] = time.monotonic()

    def known(self, request_id: str) -> bool:
        return request_id in self.tasks

    def answer(self, request_id: str) -> tuple[bytes | None, SampleFailed | None]:
        """(the SampleResponse, None) once done, (None, the failure) if it failed, (None, None) while running."""
        task = self.tasks[request_id]
        if not task.done():
            return None, None
        if task.cancelled():
            return None, SampleFailed("the sample was cancelled", user=False)
        exc = task.exception()
        if isinstance(exc, SampleFailed):
            return None, exc
        if exc is not None:
            return None, SampleFailed(f"sampling failed inside the proxy: {type(exc).__name__}: {exc}", user=False)
        return task.result(), None

    def cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self.tasks.get(rid)
            if task is not None and not task.done():
                task.cancel()

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
