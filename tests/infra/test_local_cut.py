"""A run cut short still leaves its summary, and a cut evaluation is never read as the version's accuracy.

Fast parts only: the evaluation runs against a stand-in for the proxy (some answers never come), and the summary
is written from a bucket holding a hand-made run. `brigade local` itself, cut for real by Ctrl-C and by its wall
limit, is in tests/infra/test_local_interrupt.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx

from bucket import events
from bucket.events import EventLog
from bucket.store import Store
from infra.local_summary import Ending, write_summary
from infra.summary import render, summarize
from rollout_worker.evaluation import Evaluator

ANSWERED = 5  # prompts of the set the stand-in proxy answers; the others hang until the evaluation is cut


class _Prompts:
    """The generator's prompt tokens, stood in: one token id, the row's number, which the stand-in proxy reads."""

    async def prompt_ids(self, row: dict) -> tuple[str, list[int]]:
        return row["prompt"], [row["n"]]


def _evaluator(rows: list[dict]) -> Evaluator:
    async def proxy(request: httpx.Request) -> httpx.Response:
        n = json.loads(request.content)["prompt"][0]
        if n >= ANSWERED:
            await asyncio.sleep(3600)
        # rows 0 and 1 answered right, the rest wrong
        return httpx.Response(200, json={"choices": [{"text": f" {rows[n]['answer'] if n < 2 else -1}"}]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(proxy), base_url="http://proxy")
    data = SimpleNamespace(eval=rows, eval_id="test-set", eval_name="a test set")
    return Evaluator(client, _Prompts(), data, "rollout_worker.rewards:exact_match", max_tokens=8)  # type: ignore[arg-type]


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"{i} + 1 =", "answer": str(i + 1), "n": i} for i in range(n)]


def test_an_evaluation_past_its_timeout_is_recorded_as_partial(tmp_path):
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    ev = EventLog(store, "rollout")

    async def go() -> None:
        evaluator = _evaluator(_rows(12))
        try:
            t0 = time.monotonic()
            result = await evaluator.evaluate(3, "lora-3", timeout_s=1.0)
            assert time.monotonic() - t0 < 30  # bounded: the hanging prompts did not hold it
            assert (result.cut, result.total, result.planned, result.correct) == ("timeout", ANSWERED, 12, 2)
            evaluator.emit(ev, result, "lora-3")
        finally:
            evaluator.close()

    asyncio.run(go())
    (e,) = [e for e in events.read_all(store) if e["kind"] == events.EVAL]
    assert e["partial"] is True and e["cut"] == "timeout" and (e["total"], e["planned"]) == (ANSWERED, 12)
    s = summarize(store)
    # a partial accuracy is not the version's: not on the curve, not the final accuracy, but named
    assert s["accuracy_curve"] == [] and s["final_accuracy"] is None
    assert s["evaluations_cut"] == [
        {"version": 3, "cut": "timeout", "judged": ANSWERED, "planned": 12, "partial_accuracy": 0.4, "ts": e["ts"]}
    ]
    assert "evaluation of v3 cut (timeout) after 5 of 12 prompts: partial accuracy 0.400" in render(s)


def test_stopping_the_worker_cuts_its_evaluation_and_records_what_it_judged(tmp_path):
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    ev = EventLog(store, "rollout")

    async def go() -> None:
        evaluator = _evaluator(_rows(8))
        try:
            task = asyncio.create_task(evaluator.run(ev, 0, "base", timeout_s=None))
            await asyncio.sleep(0.5)  # the answered prompts are in; the rest hang
            await evaluator.cut(task)
            assert task.done()
        finally:
            evaluator.close()

    asyncio.run(go())
    (e,) = [e for e in events.read_all(store) if e["kind"] == events.EVAL]
    assert (e["partial"], e["cut"], e["total"], e["planned"], e["correct"]) == (True, "stopped", ANSWERED, 8, 2)


def _hand_made_run(store: Store) -> None:
    """Four steps, versions 1 and 2, the base evaluated in full and v2's evaluation cut by a stop."""
    store.check_reachable(create=True)
    trainer, proxy, rollout = EventLog(store, "trainer"), EventLog(store, "proxy"), EventLog(store, "rollout")
    common = {"eval_set": "s", "eval_name": "s", "judge": "j", "max_tokens": 8, "seconds": 1.0, "model": "m"}
    rollout.emit(events.EVAL, version=0, accuracy=0.25, correct=4, total=16, partial=False, **common)
    for step in range(1, 5):
        trainer.emit(events.TRAIN_STEP, step=step, reward=0.1 * step, ratio=1.0, samples=8, **{"perf/step_s": 2.0})
        if step % 2 == 0:
            v = step // 2
            trainer.emit(events.PUBLISHED, version=v, step=step, committed_at=time.time(), lora_name=f"r-v{v}")
            proxy.emit(events.LOADED_ALL, version=v, seconds=0.5)
    rollout.emit(
        events.EVAL, version=2, accuracy=0.5, correct=3, total=6, partial=True, cut="stopped", planned=16, **common
    )


def test_a_run_cut_at_its_wall_limit_still_writes_its_summary_and_plot(tmp_path, capsys):
    store = Store(str(tmp_path / "bucket"))
    _hand_made_run(store)
    started = time.monotonic() - 100
    ok = write_summary(
        store,
        str(tmp_path),
        Ending("wall_limit", "the run did not finish within --local.max-wall-s 120s"),
        started=started,
        started_at=time.time() - 100,
        replica_startup_s=30.0,
        max_steps=30,
        max_wall_s=120.0,
    )
    assert ok
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["cut"] == "wall_limit" and s["steps"] == 4 and s["adapter_versions"] == 2
    note = "cut at the wall limit of 120 s after 4 of 30 steps; the evaluation of v2 was cut after 6 of 16 prompts"
    assert s["cut_note"] == note
    assert s["base_accuracy"] == 0.25 and s["final_accuracy"] is None and s["final_evaluation"] == "cut"
    assert s["cpu"]["cpu_class"] in ("avx2", "avx512") and "avx2" in s["cpu"]["cpu_flags"]
    out = capsys.readouterr().out
    assert note in out and "summary written to" in out and "trained samples/s" in out
    assert "evaluation of v2 cut (stopped) after 6 of 16 prompts: partial accuracy 0.500" in out
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_summary_that_cannot_be_read_is_reported_not_raised(tmp_path, capsys):
    store = Store(str(tmp_path / "bucket"))
    _hand_made_run(store)
    kwargs = {"started": time.monotonic(), "started_at": time.time(), "replica_startup_s": 0.0, "max_steps": 30}
    # the run dir is a file: summary.json cannot be written there
    (tmp_path / "not-a-dir").write_text("")
    assert not write_summary(store, str(tmp_path / "not-a-dir"), Ending("job_failed", "x"), max_wall_s=60, **kwargs)
    assert "could not write the summary" in capsys.readouterr().err
    # a run cut before anything was done: an empty bucket still gives a summary
    empty = Store(str(tmp_path / "empty"))
    empty.check_reachable(create=True)
    assert write_summary(empty, str(tmp_path), Ending("interrupted", "Ctrl-C"), max_wall_s=60, **kwargs)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["cut_note"] == "interrupted (Ctrl-C or SIGTERM) after 0 of 30 steps" and s["final_evaluation"] is None


def test_brigade_eval_bounds_each_evaluation_and_prints_a_cut_one_as_partial(tmp_path, monkeypatch, capsys):
    # `brigade eval` with its proxy and evaluation stood in: what it passes as the bound, and what it reports
    import rollout_worker.main
    from bucket.manifest import RunSpec, init_or_check
    from infra.config import load
    from infra.eval import evaluate_versions
    from rollout_worker.evaluation import EvalResult

    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(), "local")
    bounds = []

    async def no_proxy(*_args) -> None:
        pass

    async def cut_evaluation(self, version, model, timeout_s=None):
        bounds.append(timeout_s)
        return EvalResult(version, 2, ANSWERED, timeout_s or 0.0, [], planned=12, cut="timeout")

    monkeypatch.setattr(rollout_worker.main, "wait_for_proxy", no_proxy)
    monkeypatch.setattr(Evaluator, "evaluate", cut_evaluation)
    config = load(overrides={"bucket.url": store.url, "rollout.eval_timeout_s": 7.0, "rollout.eval_size": 12})
    (row,) = asyncio.run(evaluate_versions(config, "0"))
    assert bounds == [7.0]
    assert row == dict(version=0, accuracy=0.4, correct=2, total=ANSWERED, partial=True, cut="timeout", planned=12)
    assert f"CUT (timeout) after {ANSWERED} of 12 prompts: partial accuracy 0.400" in capsys.readouterr().out
    (e,) = [e for e in events.read_all(store) if e["kind"] == events.EVAL]
    assert e["partial"] is True and e["cut"] == "timeout"
    # 0 means no bound, as in the worker
    bounds.clear()
    asyncio.run(evaluate_versions(load(overrides={"bucket.url": store.url, "rollout.eval_timeout_s": 0}), "0"))
    assert bounds == [None]
