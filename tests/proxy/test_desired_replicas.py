"""The desired replica count: each signal moves it the right way, flickering signals do not flap it, a cool-down
follows each move, and it stays within its bounds (proxy/scaling/desired.py, a pure rule fed looks by hand).
Then the bucket's side (signals.py: the trainer's waiting share and the backlog from events and progress.json),
and the wiring through a proxy in front of fake replicas: the gauge on /metrics and the event in the bucket."""

from __future__ import annotations

import asyncio
import time

import pytest

from bucket import appendlog, events, layout
from bucket.events import EventLog, EventTail
from bucket.pace import RunSignals
from bucket.progress import TrainerDone, TrainerProgress, mark_done, write_progress
from proxy.scaling.desired import DesiredReplicas, Policy, Signals
from tests.proxy.test_lifecycle import until
from tests.proxy.test_proxy_fanout import FakeReplica, config, running

WINDOW, COOLDOWN = 60.0, 180.0
POLICY = Policy(min_replicas=1, max_replicas=8, window_s=WINDOW, cooldown_s=COOLDOWN)


def look(replicas=2, wait=0.0, backlog=0.0, inflight=4, queued=0, busy=None) -> Signals:
    busy = min(replicas, inflight) if busy is None else busy  # by default the requests spread over the replicas
    return Signals(
        replicas=replicas, trainer_wait=wait, backlog_steps=backlog, inflight=inflight, queued=queued, busy=busy
    )


def feed(rule: DesiredReplicas, signals, start: float, seconds: float, every: float = 5.0) -> list[int]:
    """Looks every `every` s from `start` for `seconds` s; a callable gives the signals of each look by index."""
    out, i = [], 0
    while i * every <= seconds:
        s = signals(i) if callable(signals) else signals
        out.append(rule.observe(s, start + i * every).desired)
        i += 1
    return out


def started(replicas: int = 2, policy: Policy = POLICY) -> DesiredReplicas:
    rule = DesiredReplicas(policy)
    assert rule.observe(look(replicas, wait=0.1), 0.0).changed  # the first replicas seen: what was started
    return rule


# -- each signal moves the count the right way -------------------------------------------------------------------
def test_a_trainer_waiting_for_rollouts_while_generations_run_asks_for_more_replicas_in_proportion():
    rule = started(2)
    # waiting 50 % of the time: generation must go twice as fast; not before the signal held a whole window
    counts = feed(rule, look(2, wait=0.5), 1.0, WINDOW)
    assert counts[:-1] == [2] * (len(counts) - 1) and counts[-1] == 4
    assert "waited 50%" in rule.reason and "2 -> 4" in rule.reason
    # waiting a little above the threshold: one more (2 / 0.79 = 2.5, rounded up)
    rule = started(2)
    assert feed(rule, look(2, wait=0.21), 1.0, WINDOW)[-1] == 3
    # waiting nearly all the time: at most double
    rule = started(3)
    assert feed(rule, look(3, wait=0.95), 1.0, WINDOW)[-1] == 6


def test_fewer_replicas_when_one_fewer_would_still_not_be_busy_however_many_requests_are_in_flight():
    """Groups sent as n = 1 requests: 16 requests in flight, on one replica of four at a time, are one replica's
    work; requests counted, it never looked idle. One fewer is asked for while N - 1 would be busy at most 60 %."""
    rule = started(4)
    counts = feed(rule, look(4, backlog=2.0, inflight=16, busy=1), 1.0, WINDOW)
    assert counts[-1] == 3 and "1.0 replicas had work on average, 33% of 3" in rule.reason, rule.reason
    rule = started(2)  # two replicas both busy most of the time: one could not carry it
    assert set(feed(rule, lambda i: look(2, backlog=2.0, busy=2 if i % 4 else 1), 1.0, 3 * WINDOW)) == {2}


def test_a_replica_that_starts_serving_restarts_the_window():
    """Asked 1 -> 2 (short cool-down); the trainer's wait trails the new replica by its own horizon, so the looks
    before and just after it came up describe one replica: the next move needs a whole window at two."""
    policy = Policy(min_replicas=1, max_replicas=8, window_s=WINDOW, cooldown_s=10.0)
    rule = started(1, policy)
    assert feed(rule, look(1, wait=0.5), 1.0, WINDOW)[-1] == 2
    t = 1.0 + WINDOW
    assert set(feed(rule, look(1, wait=0.5), t + 5, 30)) == {2}  # the second one is starting
    t += 40
    # serving from t on: the wait is still high for a while (its horizon), then the new count meets the demand
    counts = feed(rule, lambda i: look(2, wait=0.5 if i < 6 else 0.1), t, WINDOW + 10)
    assert set(counts) == {2}, counts  # never doubled on the old count's wait
    # and a wait that stays high at two replicas for a whole window still moves it
    counts = feed(rule, look(2, wait=0.5), t + WINDOW + 15, WINDOW)
    assert counts[-1] == 4, counts


def test_a_trainer_waiting_with_nothing_in_flight_waits_on_something_replicas_cannot_fix():
    rule = started(2)
    assert set(feed(rule, look(2, wait=0.9, inflight=0), 1.0, 3 * WINDOW)) == {2}


def test_a_backlog_over_its_bound_with_idle_replicas_asks_for_one_fewer():
    rule = started(4)
    counts = feed(rule, look(4, wait=0.0, backlog=2.0, inflight=0), 1.0, WINDOW)
    assert counts[-1] == 3 and set(counts[:-1]) == {4}
    assert "4 -> 3" in rule.reason and "at least 2.0 steps of rollouts unread" in rule.reason


@pytest.mark.parametrize(
    "busy",
    [
        {"backlog": 0.5},  # under its bound: generation is not ahead of the trainer
        {"queued": 3},  # requests wait in the proxy for a slot: the replicas are full
        {"inflight": 40},  # 10 requests in flight per replica: busy, not idle
        {"wait": None},  # no trainer step seen: nothing says the trainer is fed
    ],
)
def test_no_fewer_replicas_unless_the_backlog_is_over_its_bound_and_the_replicas_idle(busy):
    rule = started(4)
    signals = {"wait": 0.0, "backlog": 2.0, "inflight": 0, **busy}
    assert set(feed(rule, look(4, **signals), 1.0, 3 * WINDOW)) == {4}


# -- hysteresis, cool-down, stickiness ---------------------------------------------------------------------------
def test_a_waiting_share_flickering_around_the_up_threshold_never_flaps_the_count():
    rule = started(2)
    flicker = lambda i: look(2, wait=0.25 if i % 2 else 0.18)  # noqa: E731
    assert set(feed(rule, flicker, 1.0, 10 * WINDOW)) == {2}


def test_a_backlog_and_waiting_flickering_around_the_down_thresholds_never_flap_the_count():
    rule = started(4)
    waits = lambda i: look(4, wait=0.04 if i % 2 else 0.06, backlog=2.0, inflight=0)  # noqa: E731
    backlogs = lambda i: look(4, wait=0.0, backlog=1.1 if i % 3 else 0.9, inflight=0)  # noqa: E731
    assert set(feed(rule, waits, 1.0, 10 * WINDOW)) == {4}
    assert set(feed(rule, backlogs, 1.0 + 11 * WINDOW, 10 * WINDOW)) == {4}


def test_a_wait_between_the_two_thresholds_holds_the_count_either_way():
    rule = started(3)
    assert set(feed(rule, look(3, wait=0.1, backlog=5.0, inflight=0), 1.0, 5 * WINDOW)) == {3}


def test_after_a_move_the_count_stays_put_for_the_cool_down_then_moves_again():
    rule = started(2)
    counts = feed(rule, look(2, wait=0.5), 1.0, WINDOW)
    assert counts[-1] == 4
    moved_at = 1.0 + WINDOW
    # the new replicas serve, the trainer still waits: nothing moves during the cool-down
    counts = feed(rule, look(4, wait=0.5), moved_at + 5, COOLDOWN - 10)
    assert set(counts) == {4}
    assert rule.observe(look(4, wait=0.5), moved_at + COOLDOWN).desired == 8


def test_more_waits_for_the_replicas_already_asked_for_and_a_crash_does_not_lower_the_count():
    rule = started(2)
    assert feed(rule, look(2, wait=0.5), 1.0, WINDOW)[-1] == 4
    # only 3 of the 4 ever serve (one crashed, or is still starting): no further rise, and no fall to 3
    later = 1.0 + WINDOW + COOLDOWN
    assert set(feed(rule, look(3, wait=0.5), later, 3 * WINDOW)) == {4}


def test_the_count_starts_at_what_was_started_as_replicas_register_one_by_one():
    rule = DesiredReplicas(POLICY)
    assert rule.observe(look(0), 0.0).desired == 1 and rule.desired is None  # nothing seen: no count yet
    assert [rule.observe(look(n), t).desired for n, t in ((1, 5.0), (3, 10.0), (2, 15.0))] == [1, 3, 3]
    assert rule.reason == "started with 3 replicas"


# -- bounds ------------------------------------------------------------------------------------------------------
def test_the_count_stays_within_min_and_max_replicas():
    bounded = Policy(min_replicas=2, max_replicas=5, window_s=WINDOW, cooldown_s=0.0)
    rule = started(4, bounded)
    assert feed(rule, look(4, wait=0.6), 1.0, WINDOW)[-1] == 5  # 8 asked, max 5
    assert "4 -> 5" in rule.reason
    rule = started(2, bounded)
    assert set(feed(rule, look(2, backlog=9.0, inflight=0), 1.0, 5 * WINDOW)) == {2}  # never below min
    rule = DesiredReplicas(bounded)
    assert rule.observe(look(7), 0.0).desired == 5 and "max_replicas 5" in rule.reason  # started above max


# -- the bucket's side -------------------------------------------------------------------------------------------
def step_event(log: EventLog, ts: float, wait_s: float, step_s: float = 2.0, groups: int = 2) -> None:
    fields = {"perf/wait_s": wait_s, "perf/step_s": step_s, "samples_consumed": groups * 8}
    log.emit(events.TRAIN_STEP, ts=ts, step=1, **fields)


def shard_event(log: EventLog, worker: str, seq: int, groups: int = 2) -> None:
    log.emit(events.SHARD_WRITTEN, key=appendlog.record_key(layout.ROLLOUTS, worker, seq), groups=groups)


def test_the_trainers_waiting_share_and_the_backlog_come_from_its_steps_and_progress(local_store):
    trainer, worker = EventLog(local_store, "trainer"), EventLog(local_store, "rollout", writer="w-events")
    now = 1000.0
    for i in range(4):  # steps of 2 s, each after 2 s of waiting: half the time waiting; the last ends now
        step_event(trainer, now - 12 + 4 * i, wait_s=2.0)
    for seq in range(3):
        shard_event(worker, "w", seq)
    write_progress(local_store, TrainerProgress(step=4, version=1, cursors={"w": 0}))
    signals = RunSignals(local_store, num_generations=8, window_s=60.0)
    signals.poll(now)
    assert signals.trainer_wait(now) == pytest.approx(0.5)
    assert signals.backlog_groups() == 4 and signals.backlog_steps() == pytest.approx(2.0)  # shards 1, 2 unread
    # silent for 20 s after the last step (beyond one step's 2 s): a starved trainer writes nothing, and waits
    assert signals.trainer_wait(now + 20) == pytest.approx((8 + 18) / (8 + 8 + 18))
    write_progress(local_store, TrainerProgress(step=5, version=1, cursors={"w": 2}))
    mark_done(local_store, TrainerDone(step=5, version=1))
    signals.poll(now + 1)
    assert signals.backlog_groups() == 0 and signals.trainer_wait(now + 1) is None  # a finished trainer waits not


def test_the_event_tail_reads_only_what_is_new_from_the_end_skipping_its_own_writer(local_store):
    old, own = EventLog(local_store, "trainer", writer="old"), EventLog(local_store, "proxy", writer="own")
    for i in range(10):
        old.emit(events.TRAIN_STEP, step=i)
        own.emit(events.ROUTING_SNAPSHOT)
    tail = EventTail(local_store, tail=3, skip=frozenset({"own"}))
    assert [e["step"] for e in tail.read()] == [7, 8, 9]  # started 3 from the end
    new = EventLog(local_store, "rollout", writer="new")
    new.emit(events.SHARD_WRITTEN, key="k")
    old.emit(events.TRAIN_STEP, step=10)
    assert sorted(str(e.get("step", e["kind"])) for e in tail.read()) == ["10", "rollout_shard_written"]
    assert tail.read() == []


# -- through the proxy -------------------------------------------------------------------------------------------
def test_the_proxy_exports_the_desired_count_and_writes_why_it_moved_to_the_bucket(run_store):
    store, manifest = run_store
    fakes = [FakeReplica("r0"), FakeReplica("r1")]
    # the trainer is fed (it waited for nothing, and its 30 s step has just ended), two steps' worth of groups
    # wait unread, and nothing is in flight: one replica is enough
    step_event(EventLog(store, "trainer"), time.time(), wait_s=0.0, step_s=30.0)
    worker = EventLog(store, "rollout", writer="w-events")
    for seq in range(2):
        shard_event(worker, "w", seq)
    cfg = config(fakes, scale_interval_s=0.05, scale_window_s=0.3, scale_cooldown_s=0.0, max_replicas=4)

    async def body():
        async with running(store, manifest, cfg, fakes) as (proxy, client, _):
            await until(lambda: proxy.autoscaler.desired == 1, "the desired count to fall to 1")
            await until(lambda: moves(store)[-1:] == [(1, 2, True)], "the event of the move")
            metrics = (await client.get("/metrics")).text
            assert "brigade_proxy_desired_replicas 1.0" in metrics and "brigade_proxy_replicas 2.0" in metrics

    asyncio.run(body())
    *_, start, fewer = [e for e in events.read_all(store) if e["kind"] == events.DESIRED_REPLICAS]
    assert (start["desired"], start["actual"], start["reason"]) == (2, 2, "started with 2 replicas")
    assert fewer["previous"] == 2 and "2 -> 1" in fewer["reason"] and fewer["job"] == "proxy"
    assert fewer["signals"]["backlog_groups"] == 4 and fewer["signals"]["trainer_wait"] == 0.0


def moves(store) -> list[tuple[int, int, bool]]:
    return [(e["desired"], e["actual"], e["moved"]) for e in events.read_all(store) if e["kind"] == "desired_replicas"]
