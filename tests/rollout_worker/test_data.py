"""Prompt data: file formats, chat prompts, GSM8K files, malformed rows, the held-out split, epochs, shuffles,
the curriculum and the data cursor. Files are written by the tests; nothing is downloaded."""

from __future__ import annotations

import json

import pytest

from bucket.datacursor import DataCursor, read_data_cursor, write_data_cursor
from rollout_worker.prompts import DataError, load_data, prompt_key, read_dataset
from rollout_worker.sampler import PromptSampler, Ticket

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "topic": "sums"} for i in range(12)]
CHAT = [{"prompt": [{"role": "user", "content": f"Name {i}."}], "answer": str(i)} for i in range(5)]


def write(path, rows, kind: str) -> str:
    import pandas as pd

    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif kind == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_each_file_format_keeps_every_column(tmp_path, kind):
    ds = read_dataset(write(tmp_path / f"data.{kind}", ROWS, kind))
    assert len(ds) == len(ROWS)
    row = ds[3]
    assert row["prompt"] == "What is 3 + 1?" and str(row["answer"]) == "4" and row["topic"] == "sums"
    assert row["prompt_id"] == "row-3"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_chat_prompts_in_trls_conversational_format(tmp_path, kind):
    ds = read_dataset(write(tmp_path / f"chat.{kind}", CHAT, kind))
    assert ds[2]["prompt"] == [{"role": "user", "content": "Name 2."}]


def test_gsm8k_layout_gives_chat_prompts_and_final_answers(tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"},
    ]
    ds = read_dataset("gsm8k:" + write(tmp_path / "gsm.jsonl", rows, "jsonl"))
    assert ds[0]["prompt"][0]["role"] == "user" and ds[0]["prompt"][0]["content"].startswith("Tom has 3 apples")
    assert [ds[0]["answer"], ds[1]["answer"]] == ["7", "2400"]
    assert ds[1]["solution"] == "2400"


def test_malformed_rows_name_the_file_and_the_row(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, row 3 \(line 3\): not valid JSON"):
        read_dataset(str(bad_json))
    bad_prompt = write(tmp_path / "bad_prompt.jsonl", [{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": ""}], "jsonl")
    with pytest.raises(DataError, match=r"bad_prompt\.jsonl, row 3: empty prompt"):
        read_dataset(bad_prompt)
    bad_chat = write(tmp_path / "bad_chat.jsonl", [*CHAT[:1], {"prompt": [{"role": "user"}]}], "jsonl")
    with pytest.raises(DataError, match=r"bad_chat\.jsonl, row 2: a chat prompt is a list of"):
        read_dataset(bad_chat)
    with pytest.raises(DataError, match="no 'prompt' column"):
        read_dataset(write(tmp_path / "noprompt.csv", [{"question": "x"}], "csv"))
    with pytest.raises(DataError, match=r"gsm\.jsonl, row 1"):
        read_dataset("gsm8k:" + write(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "no marker"}], "jsonl"))


def _keys(ds) -> set[str]:
    return {prompt_key(p) for p in ds["prompt"]}


def test_eval_set_is_fixed_and_disjoint_from_every_training_prompt(tmp_path):
    data = load_data("arithmetic", "", 200)
    assert len(data.eval) == 200 and not _keys(data.eval) & _keys(data.train)
    # fixed: the same set whatever else changes (it depends on nothing but eval_size)
    assert load_data("arithmetic", "", 200).eval_id == data.eval_id
    # no prompt any curriculum level can hand out is in the evaluation set, at any seed or epoch
    held_out = _keys(data.eval)
    for seed in (0, 1):
        sampler = PromptSampler(data, "w", seed, threshold=0.0, window=1)
        for _ in range(100):
            ticket, row = sampler.next()
            assert prompt_key(row["prompt"]) not in held_out
            sampler.observe(ticket, 1.0)
        assert sampler.level == len(sampler.levels) - 1
    # held out of a user's file
    path = write(tmp_path / "d.jsonl", ROWS, "jsonl")
    held = load_data(path, "", 4)
    assert len(held.eval) == 4 and len(held.train) == len(ROWS) - 4
    assert not _keys(held.eval) & _keys(held.train)
    # a separate evaluation file: training rows that repeat one of its prompts are dropped
    ev = write(tmp_path / "ev.jsonl", ROWS[:3], "jsonl")
    separate = load_data(path, ev, 10)
    assert len(separate.eval) == 3 and len(separate.train) == len(ROWS) - 3
    assert not _keys(separate.eval) & _keys(separate.train)


def test_epochs_reshuffle_with_the_seed_and_end(tmp_path):
    data = load_data(write(tmp_path / "d.jsonl", ROWS, "jsonl"), "", 2)
    n = len(data.train)

    def order(seed: int, epochs: int) -> list[str]:
        sampler = PromptSampler(data, "w", seed, num_epochs=epochs)
        out = []
        while (nxt := sampler.next()) is not None:
            out.append(nxt[1]["prompt"])
        return out

    two = order(0, 2)
    assert len(two) == 2 * n
    assert sorted(two[:n]) == sorted(two[n:]) == sorted(data.train["prompt"])  # each epoch is every prompt once
    assert two[:n] != two[n:]  # reshuffled
    assert order(0, 2) == two and order(1, 2) != two  # the seed decides the order


def test_curriculum_moves_up_when_the_reward_is_high():
    data = load_data("arithmetic", "", 10)
    sampler = PromptSampler(data, "w", 0, threshold=0.75, window=4)
    rows = [sampler.next() for _ in range(4)]
    assert {r["level"] for _, r in rows} == {0}
    assert [sampler.observe(t, 0.5) for t, _ in rows] == [False] * 4  # 0.5 < 0.75: stays
    moved = [sampler.observe(sampler.next()[0], 1.0) for _ in range(4)]
    assert moved.count(True) == 1 and sampler.level == 1  # once the mean of the last 4 reached 0.75
    assert {sampler.next()[1]["level"] for _ in range(40)} == {0, 1}  # level 1 joins level 0, it does not replace it
    off = PromptSampler(data, "w", 0, curriculum=False)
    assert len(off.levels) == 1


def test_cursor_in_the_bucket_continues_the_data(tmp_path, store):
    data = load_data(write(tmp_path / "d.jsonl", ROWS, "jsonl"), "", 2)
    first = PromptSampler(data, "w1", 7)
    handed = [first.next() for _ in range(5)]
    for ticket, _ in handed[:2] + handed[3:]:  # the third is still in flight when the worker dies
        first.written_out(ticket)
    write_data_cursor(store, first.cursor())
    cursor = read_data_cursor(store, "w1")
    assert isinstance(cursor, DataCursor) and cursor.positions == {"0": 2}
    again = PromptSampler(data, "w1", 7, cursor=cursor)
    # the restarted worker goes on with the first prompt whose group was not written
    assert [again.next()[1]["prompt"] for _ in range(3)] == [r["prompt"] for _, r in handed[2:5]]
    # a cursor of other data (another seed) is not applied
    assert PromptSampler(data, "w1", 8, cursor=cursor).next()[0].position == 0
    assert read_data_cursor(store, "nobody") is None


def test_a_level_reached_keeps_the_earlier_ones_weighted_by_what_their_groups_still_teach():
    """Issue 34: once the sums moved to level 2 (an operand above 50) every training prompt lay outside the
    held-out set's operands (up to 50). Now every level reached gives prompts, as often as its recent groups had
    unequal rewards: a mastered level (all groups equal) is asked rarely but never dropped."""
    data = load_data("arithmetic", "", 10)

    def at_level_2(mix: str) -> PromptSampler:
        sampler = PromptSampler(data, "w", 0, threshold=0.75, window=8, mix=mix)
        while sampler.level < 2:
            ticket, _ = sampler.next()
            # the earlier levels are mastered: every group of them is all right (equal rewards)
            sampler.observe(ticket, 1.0, informative=False)
        return sampler

    sampler = at_level_2("informative")
    drawn = []
    for _ in range(2000):
        ticket, row = sampler.next()
        assert ticket.level == row["level"]
        drawn.append(ticket.level)
        sampler.observe(ticket, 0.5, informative=ticket.level == 2)  # only the newest level still teaches
    share = {lv: drawn.count(lv) / len(drawn) for lv in (0, 1, 2)}
    # weights: mastered levels (1 + 0) / (2 + 8) = 0.1 each, the newest (1 + 8) / (2 + 8) = 0.9
    assert share[2] > 0.75 and 0.03 < share[0] < 0.15 and 0.03 < share[1] < 0.15, share
    assert sampler.weights() == [0.1, 0.1, 0.9]
    # a mastered level the model starts to forget (its groups differ again) is asked more again
    for _ in range(8):
        sampler.observe(Ticket(0, 0), 0.5, informative=True)
    assert sampler.weights()[0] == 0.9
    # each level keeps its own seeded sequence: the cursor still names every prompt handed out
    assert sampler.cursor().level == 2

    newest = at_level_2("newest")
    assert {newest.next()[0].level for _ in range(200)} == {2}
