"""Format 4's sample: an episode's token stream with its loss mask and turns, and the single-turn case.

What a writer gets wrong (lengths that disagree, a mask value other than 0/1,
overlapping turns, a trained token no turn holds, an episode that did not
begin on the group's version) is refused with an error that says what; the
tolerant shard reader reports such a shard and reads the rest.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from bucket import appendlog, layout
from bucket.manifest import FORMAT_VERSION, RunSpec, UnknownFormat, init_or_check, read_manifest
from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter, Turn, read_shards
from bucket.store import Store


def _episode(**update) -> dict:
    """Two turns on v2: the reply [0, 3), the environment's 2 tokens, the reply [5, 7), a trailing message."""
    sample = {
        "completion_ids": [11, 12, 13, 90, 91, 14, 15, 92],
        "logprobs": [-0.5, -0.1, -0.2, 0.0, 0.0, -1.0, -0.3, 0.0],
        "loss_mask": [1, 1, 1, 0, 0, 1, 1, 0],
        "turns": [
            {"start": 0, "end": 3, "version": 2, "replica": "r0"},
            {"start": 5, "end": 7, "version": 2, "replica": "r0"},
        ],
        "text": "",
        "reward": 1.0,
        "tool_calls": 1,
    }
    return {**sample, **update}


def _group(*samples: dict, version: int = 2) -> ScoredGroup:
    return ScoredGroup(
        prompt_id="p",
        prompt="q",
        prompt_ids=[1, 2],
        adapter_version=version,
        sampling=SamplingParams(temperature=1.0),
        samples=[Sample(**s) for s in samples],
    )


def test_a_format_3_bucket_is_refused_as_the_format_rule_says(local_store: Store):
    """Format 3's shards would parse (a sample without a mask is the one-turn case), but a reader knows one
    format: a bucket written before episodes is refused with the same clear error as any other format."""
    assert FORMAT_VERSION == 7
    init_or_check(local_store, RunSpec(), "test")
    data = json.loads(local_store.get_bytes(layout.RUN_MANIFEST))
    local_store.put_json(layout.RUN_MANIFEST, {**data, "format_version": 3})
    with pytest.raises(UnknownFormat, match=r"format is 3; this brigade reads and writes format 7 only"):
        read_manifest(local_store)


def test_an_episode_round_trips_and_a_single_turn_sample_stays_small(local_store: Store):
    single = {"completion_ids": [4, 5], "logprobs": [-0.1, -0.2], "text": "2", "reward": 0.0}
    ShardWriter(local_store, "w0").write([_group(_episode(), single)])
    [read] = read_shards(local_store, {})
    raw = json.loads(local_store.get_bytes(read.record.key))["groups"][0]["samples"]
    assert "loss_mask" not in raw[1] and "turns" not in raw[1]  # None fields are not written
    [(_, group)] = read.groups()
    episode, one = group.samples
    assert episode.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0] and episode.trained_tokens == 5
    assert [(t.start, t.end, t.version) for t in episode.turns] == [(0, 3, 2), (5, 7, 2)]
    assert episode.tool_calls == 1
    # the one-turn case: every token trained, one turn at the group's version
    assert one.loss_mask is None and one.turns is None and one.mask == [1, 1] and one.trained_tokens == 2


@pytest.mark.parametrize(
    "update, message",
    [
        ({"logprobs": [-0.5] * 7}, "7 logprobs for 8 completion tokens"),
        ({"loss_mask": [1, 1, 1, 0]}, "loss_mask has 4 entries for 8 completion tokens"),
        ({"loss_mask": [1, 1, 1, 0, 0, 1, 2, 0]}, r"loss_mask holds \[2\]"),
        ({"turns": []}, "turns is empty"),
        (
            {"turns": [{"start": 0, "end": 3, "version": 2}, {"start": 2, "end": 7, "version": 2}]},
            r"turn 1 spans \[2, 7\), which overlaps",
        ),
        ({"turns": [{"start": 0, "end": 3, "version": 2}, {"start": 5, "end": 9, "version": 2}]}, "runs past the 8"),
        ({"turns": [{"start": 0, "end": 3, "version": 2}]}, r"marks tokens \[5, 6\] as sampled, but no turn span"),
        ({"turns": [{"start": 3, "end": 3, "version": 2}]}, "empty or reversed"),
    ],
)
def test_a_sample_whose_parts_disagree_is_refused_with_what_is_wrong(update, message):
    with pytest.raises(ValidationError, match=message):
        Sample(**_episode(**update))


def test_an_episode_begins_on_its_group_version():
    later = {"turns": [{"start": 0, "end": 3, "version": 2}, {"start": 5, "end": 7, "version": 3}]}
    assert _group(_episode(**later)).samples[0].turns[1].version == 3  # a later turn may say another version
    with pytest.raises(ValidationError, match="first turn was served by version 2, the group says 1"):
        _group(_episode(), version=1)


def test_the_reader_reports_a_bad_episode_shard_and_reads_the_rest(local_store: Store):
    bad = _group(_episode()).model_dump()
    bad["samples"][0]["loss_mask"] = [1, 1]
    appendlog.LogWriter(local_store, layout.ROLLOUTS, "w0").append({"worker": "w0", "groups": [bad]})
    ShardWriter(local_store, "w0").write([_group(_episode())])
    reads = read_shards(local_store, {})
    assert [r.shard is not None for r in reads] == [False, True]
    assert "loss_mask has 2 entries for 8 completion tokens" in reads[0].error
    assert isinstance(reads[1].groups()[0][1].samples[0].turns[0], Turn)
