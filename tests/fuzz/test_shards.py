"""The trainer's reading of rollout shards, fuzzed: a real RolloutBuffer over hostile shards (hypothesis, fixed seed).

Whatever a shard holds, `poll` never raises, its cursor moves past the shard (a bad shard never wedges a restart),
and every group `take` hands to a step is one the trainer can train: token ids inside the model's vocabulary,
finite logprobs and rewards, one logprob per completion token. The named tests below are the regressions of what
the fuzzer found.
"""

from __future__ import annotations

import json
import math
import tempfile

from hypothesis import HealthCheck, given, settings

from bucket import layout
from bucket.appendlog import record_key
from bucket.rollouts import ScoredGroup
from bucket.store import Store
from tests.fuzz.hostile import encode, hostile_bytes
from trainer.buffer import RolloutBuffer

VOCAB = 49152  # SmolLM2's embedding rows: the trainer passes its model's
SAMPLE = {"completion_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "text": "12", "reward": 1.0}
EPISODE = {**SAMPLE, "loss_mask": [1, 0, 1], "turns": [{"start": 0, "end": 1, "version": 1},
                                                      {"start": 2, "end": 3, "version": 1}]}  # fmt: skip
GROUP = {"prompt_id": "p", "prompt": "q", "prompt_ids": [1, 2, 3], "adapter_version": 1,
         "sampling": {"temperature": 1.0}, "samples": [SAMPLE, EPISODE]}  # fmt: skip
SHARD = {"worker": "w", "created_at": 1.0, "groups": [GROUP]}


def _trainable(group: ScoredGroup) -> None:
    assert all(0 <= t < VOCAB for t in group.prompt_ids)
    assert group.samples
    for s in group.samples:
        assert all(0 <= t < VOCAB for t in s.completion_ids)
        assert len(s.logprobs) == len(s.completion_ids) == len(s.mask)
        assert all(math.isfinite(x) for x in s.logprobs) and math.isfinite(s.reward)


def _poll(shards: list[bytes]) -> RolloutBuffer:
    store = Store(tempfile.mkdtemp(prefix="fuzz-shards-"))
    for seq, data in enumerate(shards):
        store.put_bytes(record_key(layout.ROLLOUTS, "w", seq), data)
    buffer = RolloutBuffer(store, max_staleness=4, vocab_size=VOCAB)
    buffer.poll(current_version=1)
    return buffer


@settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=hostile_bytes(SHARD), last=hostile_bytes(SHARD))
def test_no_hostile_shard_reaches_a_batch_or_stops_the_reader(first: bytes, last: bytes):
    buffer = _poll([first, encode(SHARD), last])
    assert buffer.cursors == {"w": 2}  # read past every shard, good or bad
    batch = buffer.take(100, current_version=1)
    for _, group in batch:
        _trainable(group)
    assert len(batch) + len(buffer.invalid) + len(buffer.dropped) >= 2  # the valid middle shard's group at least
    assert "rollouts/w/000000/000000000001.json" not in buffer.invalid


# -- what the fuzzer found, as plain regressions --------------------------------------------------------------


def _with(**sample: object) -> bytes:
    return encode({**SHARD, "groups": [{**GROUP, "samples": [{**SAMPLE, **sample}, SAMPLE]}]})


def test_a_shard_that_is_not_json_is_recorded_and_skipped():
    # it used to raise BucketError out of poll(): the trainer died, and again on every restart
    for junk in (b'{"worker": "w", "gro', b"\x80\xff", b"[" * 50_000, b"[1, 2]", b"null"):
        buffer = _poll([junk, encode(SHARD)])
        assert buffer.invalid == ["rollouts/w/000000/000000000000.json"], junk[:20]
        assert [gid.shard_key for gid, _ in buffer.take(10, 1)] == ["rollouts/w/000000/000000000001.json"]


def test_nan_or_infinite_logprobs_and_rewards_are_never_trained():
    for bad in ({"logprobs": [-0.5, float("nan"), -0.1]}, {"logprobs": [float("-inf"), -1.0, -0.1]},
                {"reward": float("nan")}, {"reward": float("inf")}):  # fmt: skip
        buffer = _poll([_with(**bad)])
        assert buffer.invalid == ["rollouts/w/000000/000000000000.json"], bad
        assert not buffer.take(10, 1)


def test_token_ids_outside_the_vocabulary_are_never_trained():
    for bad in ({"completion_ids": [5, VOCAB, 7]}, {"completion_ids": [5, -1, 7]}, {"completion_ids": [2**70, 1, 1]}):
        buffer = _poll([_with(**bad)])
        assert buffer.invalid == ["rollouts/w/000000/000000000000.json"], bad
    prompt = encode({**SHARD, "groups": [{**GROUP, "prompt_ids": [1, VOCAB + 5]}]})
    assert _poll([prompt]).invalid == ["rollouts/w/000000/000000000000.json"]
    assert not _poll([encode(SHARD)]).invalid  # the largest id inside is fine: VOCAB - 1
    edge = _poll([_with(completion_ids=[VOCAB - 1, 0, 1])])
    assert not edge.invalid and len(edge.take(10, 1)) == 1


def test_a_group_without_samples_is_refused():
    buffer = _poll([json.dumps({**SHARD, "groups": [{**GROUP, "samples": []}]}).encode()])
    assert buffer.invalid == ["rollouts/w/000000/000000000000.json"]
