"""A pool's proxy refuses a generation whose version left the run's staleness window (409 `adapter_retired`,
proxy/pool/runs.py): the worker generates the same prompt again with a live version, and loses no group.

The proxy here is an httpx.MockTransport: the real pool proxy's refusal is tested in
tests/proxy/test_pool_retired.py, and a real one cannot be made to retire a version between two given requests.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bucket.manifest import RunManifest, RunSpec
from bucket.rollouts import SamplingParams
from bucket.version import Version
from rollout_worker.generation import AdapterRetired, GenerationFailed, Generator
from rollout_worker.live_adapter import LiveAdapter
from rollout_worker.rewards import Scored
from rollout_worker.worker import Worker

MANIFEST = RunManifest(**RunSpec(num_generations=2).model_dump(), run_id="r", created_at=0.0)
RETIRED_BODY = {
    "error": {"message": "r-v000001 is past run r's staleness window", "code": 409},
    "reason": "adapter_retired",
}


def proxy(retired: set[str], other_409: bool = False) -> tuple[httpx.AsyncClient, list[str]]:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2, 3]})
        asked.append(body["model"])
        if body["model"] in retired:
            return httpx.Response(409, json=RETIRED_BODY)
        if other_409:
            return httpx.Response(409, json={"error": {"message": "something else", "code": 409}})
        choices = [
            {"index": i, "text": "7", "token_ids": [9], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}
            for i in range(body["n"])
        ]
        return httpx.Response(200, json={"model": body["model"], "choices": choices})

    return httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://proxy"), asked


class Scorer:
    async def score(self, completions, prompt, ids, row) -> Scored:  # noqa: ANN001 - the real one's signature
        return Scored([1.0] * len(completions), [])


class Events:
    def emit(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass


def worker(client: httpx.AsyncClient, shape: str) -> Worker:
    """A Worker with only what `generate_group` uses (the rest reads datasets and buckets)."""
    w = Worker.__new__(Worker)
    w.manifest, w.sampling, w.scorer, w.ev = MANIFEST, SamplingParams(temperature=1.0), Scorer(), Events()
    w.adapters = LiveAdapter(client, MANIFEST)
    w.adapters.version = Version(1)  # what the worker last saw live when the group started
    w.generator = Generator(client, MANIFEST.base_model, w.sampling, 8, shape)
    return w


@pytest.mark.parametrize("shape", ["n_group", "n_1"])
def test_a_group_refused_as_retired_is_generated_again_with_the_newer_version(shape):
    async def body():
        client, asked = proxy(retired={"r-v000001"})
        w = worker(client, shape)

        async def newer_goes_live() -> None:  # the live view moves on while the refused group waits
            await asyncio.sleep(0.2)
            w.adapters.version = Version(2)

        w.adapters.refresh = lambda: asyncio.sleep(0)  # type: ignore[method-assign] # the view is the test's
        _, group = await asyncio.gather(newer_goes_live(), w.generate_group({"prompt": "2+5?", "prompt_id": "p"}))
        assert group.adapter_version == 2 and len(group.samples) == 2
        assert asked[-(1 if shape == "n_group" else 2) :] == ["r-v000002"] * (1 if shape == "n_group" else 2)
        assert w.generator.retries["adapter_retired"] == 1
        await client.aclose()

    asyncio.run(body())


def test_another_409_still_fails_the_group_at_once():
    async def body():
        client, asked = proxy(retired=set(), other_409=True)
        w = worker(client, "n_group")
        with pytest.raises(GenerationFailed) as failed:
            await w.generate_group({"prompt": "2+5?", "prompt_id": "p"})
        assert not isinstance(failed.value, AdapterRetired) and asked == ["r-v000001"]
        await client.aclose()

    asyncio.run(body())
