"""Prompt tokens and completions, through the proxy's vLLM-compatible API.

No tokenizer lives here: prompts are tokenised by the replicas' own tokenizer
(`/tokenize`), so the prompt ids the trainer sees are exactly what vLLM
generated from. Completions are asked for one at a time (`n=1`) so the proxy
can spread a group's samples over the replicas.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from bucket.rollouts import Sample, SamplingParams


class Generator:
    def __init__(
        self, client: httpx.AsyncClient, base_model: str, sampling: SamplingParams, max_completion_length: int
    ):
        self.client, self.base_model, self.sampling = client, base_model, sampling
        self.max_completion_length = max_completion_length
        self.token_cache: dict[str, list[int]] = {}  # the dataset is cycled: each prompt is tokenised once

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
            resp = await self.client.post("/tokenize", json=body)
            resp.raise_for_status()
            self.token_cache[key] = resp.json()["tokens"]
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        return text, self.token_cache[key]

    async def completions(self, model: str, ids: list[int], n: int) -> list[Sample]:
        return list(await asyncio.gather(*(self.one_completion(model, ids) for _ in range(n))))

    async def one_completion(self, model: str, ids: list[int]) -> Sample:
        """One sampled completion with vLLM's logprob of each token (the trainer's importance-ratio denominator)."""
        resp = await self.client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": ids,
                "max_tokens": self.max_completion_length,
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "top_k": self.sampling.top_k,
                "logprobs": 0,
                "return_token_ids": True,
                "n": 1,
            },
        )
        if resp.status_code != 200:
            raise RuntimeError(f"generation failed (HTTP {resp.status_code}): {resp.text[:300]}")
        choice = resp.json()["choices"][0]
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
        )
