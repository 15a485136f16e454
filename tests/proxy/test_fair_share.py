"""Runs sharing one pool get the replicas' slots in proportion to their weights (weighted fair queuing on tokens).

The slot gate alone (a replica the test frees one sequence at a time, so the order of hand-overs is the whole
observable), then through the proxy with a fake replica of test_proxy_fanout.py that answers at once behind a
registered max_num_seqs of 1: the order its requests reached it is the order the proxy handed the slot out.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from bucket import priority
from proxy.serving.slots import FairShare, PrioritySlots, run_of_model
from tests.proxy.test_proxy_fanout import FakeReplica, config, register_fake, running

TOKENS = 100.0  # every request's charge here unless a test says otherwise


class Replica:
    """Slots of `capacity` sequences that the test frees one at a time, recording which run got each."""

    def __init__(self, capacity: int = 1, weights: dict[str, float] | None = None) -> None:
        self.fair = FairShare(weights.get if weights else None)
        self.slots = PrioritySlots(capacity, self.fair)
        self.granted: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def fill(self) -> None:
        for _ in range(self.slots.capacity):
            await self.slots.acquire()  # busy: everything asked from now on waits

    async def ask(self, run: str, count: int = 1, tokens: float = TOKENS, p: int = priority.GENERATION, tag=None):
        async def one() -> None:
            await self.slots.acquire(p, 1, run, tokens)
            self.granted.append(tag or run)

        self.tasks += [asyncio.create_task(one()) for _ in range(count)]
        await settle()  # they are waiting now, in the order asked

    async def serve(self, count: int) -> list[str]:
        """Free one sequence `count` times: who got them."""
        before = len(self.granted)
        for _ in range(count):
            self.slots.release()
            await settle()
        return self.granted[before:]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_two_runs_of_weights_1_and_2_are_served_tokens_1_to_2():
    async def body() -> Counter:
        r = Replica(weights={"a": 1.0, "b": 2.0})
        await r.fill()
        await r.ask("a", 200)
        await r.ask("b", 200)
        served = Counter(await r.serve(150))  # both keep a deep backlog throughout
        await r.close()
        assert r.slots.waiting == 0 and all(s.waiting == 0 for s in r.fair.runs.values())
        return served

    served = asyncio.run(body())
    assert served["b"] / served["a"] == pytest.approx(2.0, rel=0.1), served


def test_a_run_whose_completions_run_long_gets_fewer_requests_for_the_same_tokens():
    """The charge at dispatch is an estimate; `correct` (the answer's real completion) makes the share tokens."""

    async def body() -> Counter:
        r = Replica()
        await r.fill()
        await r.ask("long", 100)
        await r.ask("short", 100)
        got = []
        for _ in range(100):
            (run,) = await r.serve(1)
            got.append(run)
            if run == "long":
                r.fair.correct(run, 300.0)  # 400 tokens where 100 were expected
        await r.close()
        return Counter(got)

    served = asyncio.run(body())
    assert served["short"] / served["long"] == pytest.approx(4.0, rel=0.1), served


def test_a_deep_queue_does_not_starve_a_run_that_sends_one_request():
    async def body() -> list[str]:
        r = Replica()
        await r.fill()
        await r.ask("deep", 100)
        await r.serve(30)  # the deep run alone for a while: its virtual time is far ahead of the small run's 0
        await r.ask("small")
        return await r.serve(2)

    order = asyncio.run(body())
    assert "small" in order, f"one slot turn after it arrived the small run still waits: {order}"


def test_an_idle_run_that_comes_back_gets_its_share_and_no_burst():
    async def body() -> tuple[Counter, Counter]:
        r = Replica()
        await r.fill()
        await r.ask("a", 200)
        await r.ask("b", 10)
        together = Counter(await r.serve(20))  # b's 10 requests served alongside a's: then b is idle
        await r.serve(100)  # a alone
        await r.ask("b", 100)  # b is back with a deep queue: it may not claim the 100 turns it was idle
        after = Counter(await r.serve(40))
        await r.close()
        return together, after

    together, after = asyncio.run(body())
    assert together == {"a": 10, "b": 10}
    assert 18 <= after["b"] <= 22, after


def test_requests_parked_in_another_class_earn_no_credit():
    """A run whose evaluations wait behind generation does not lend a newcomer its old virtual time."""

    async def body() -> Counter:
        r = Replica()
        await r.fill()
        await r.ask("evaluator", 5, p=priority.EVALUATION)  # waits at its virtual time of now (0) ...
        await r.ask("a", 100)
        await r.ask("b", 100)
        await r.serve(60)  # ... while generation moves on
        await r.ask("newcomer", 50)
        served = Counter(await r.serve(30))
        await r.close()
        return served

    served = asyncio.run(body())
    assert served == {"a": 10, "b": 10, "newcomer": 10}


def test_a_period_without_contention_earns_no_credit():
    """A run served alone while nobody waited is not owed anything by it: both enter the contention even."""

    async def body() -> Counter:
        r = Replica(capacity=2)
        for _ in range(50):  # busy run alone, never waiting
            await r.slots.acquire(0, 1, "busy", TOKENS)
            r.slots.release()
        await r.fill()
        await r.ask("quiet", 100)  # the quiet run starts waiting first, at the busy run's virtual time
        await r.ask("busy", 100)
        served = Counter(await r.serve(40))
        await r.close()
        return served

    served = asyncio.run(body())
    assert served == {"quiet": 20, "busy": 20}


def test_priority_classes_beat_fairness():
    async def body() -> list[str]:
        r = Replica()
        await r.fill()
        await r.ask("hog", 40)
        await r.serve(30)
        await r.ask("small", 5, p=priority.EVALUATION, tag="small-eval")  # behind its share, yet after generation
        await r.ask("small", 5, tag="small-gen")
        await r.ask("hog", 1, p=priority.CONTROL, tag="hog-control")  # ahead of its share, yet first
        order = await r.serve(21)
        await r.close()
        return order

    order = asyncio.run(body())
    assert order[0] == "hog-control", order
    assert order[-5:] == ["small-eval"] * 5, order  # after every generation (all arrived within AGING_S x 10)
    assert order[1:11].count("small-gen") == 5, order  # generation: the two runs take turns


def test_cancelled_waiters_leave_every_count_as_it_was():
    async def body() -> None:
        r = Replica()
        await r.fill()
        await r.ask("a", 3)
        await r.ask("b", 3)
        for t in r.tasks[:2] + r.tasks[3:4]:  # two of a's, one of b's: clients that left
            t.cancel()
        await settle()
        assert r.slots.waiting == 3 and r.fair.runs["a"].waiting == 1 and r.fair.runs["b"].waiting == 2
        assert sorted(await r.serve(3)) == ["a", "b", "b"]
        assert r.slots.waiting == 0 and r.fair.runs["a"].waiting == r.fair.runs["b"].waiting == 0

    asyncio.run(body())


def test_accounts_are_bounded_and_forget_idle_runs():
    fair = FairShare(max_runs=4, forget_s=60.0)
    for k in range(10):
        fair.charge(f"run{k}", TOKENS)
    assert len(fair.snapshot()) == 4  # the most recently active ones
    fair.charge("run9", TOKENS)
    fair.prune(time.monotonic() + 61.0)
    assert list(fair.runs) == ["run9"], "runs idle for forget_s kept their labels"
    assert fair.snapshot()["run9"] == {"tokens": 2 * TOKENS, "requests": 2, "waiting": 0, "weight": 1.0}
    odd = FairShare({"zero": 0.0, "nan": float("nan")}.get)
    assert odd.weight("zero") == odd.weight("nan") == 1.0


@pytest.mark.parametrize(
    "model, run",
    [
        ("run-1-v000007", "run-1"),
        ("exp_a-v000123", "exp_a"),
        ("a-v000001-v000002", "a-v000001"),
        ("Qwen/Qwen2.5-1.5B", ""),
        ("base", ""),
        ("run-v7", ""),
        ("my-own-adapter", ""),
    ],
)
def test_the_run_of_a_model_name(model, run):
    assert run_of_model(model) == run


def test_through_the_proxy_runs_share_a_saturated_replica_by_weight_and_are_counted(run_store):
    store, manifest = run_store
    fake = FakeReplica("r0")
    fake.loaded.update({"a-v000001": "/a/a/v000001", "b-v000001": "/a/b/v000001"})
    register_fake(store, manifest, "r0", priority_scheduling=True, max_num_seqs=1, control_seqs=1)

    async def body() -> tuple[list[str], bytes]:
        cfg = config([], refresh_s=0.05, replica_timeout_s=30)
        async with running(store, manifest, cfg, [fake], adapter_root="/a") as (proxy, client, _):
            proxy.forwarder.set_weights({"a": 1.0, "b": 2.0}.get)
            proxy.forwarder.run_of = run_of_model
            for _ in range(100):
                if "r0" in proxy.routable:
                    break
                await asyncio.sleep(0.05)
            fake.hold = asyncio.Event()  # the first request keeps the one sequence until all are queued

            def ask(run: str, k: int) -> asyncio.Task:
                body = {"model": f"{run}-v000001", "prompt": [k, k + 1, k + 2, k + 3], "max_tokens": 4}
                return asyncio.create_task(client.post("/v1/completions", json=body))

            tasks = [ask(run, 10 * k) for k in range(40) for run in ("a", "b")]
            deadline = time.monotonic() + 20
            while sum(s.waiting for s in proxy.forwarder._replica_slots.values()) < len(tasks) - 1:
                assert time.monotonic() < deadline, "the requests did not all reach the proxy's queue"
                await asyncio.sleep(0.01)
            fake.hold.set()
            for resp in await asyncio.gather(*tasks):
                assert resp.status_code == 200, resp.text
            metrics = proxy.render_metrics()
        return [b["model"].split("-v")[0] for kind, b in fake.calls if kind == "completions"], metrics

    order, metrics = asyncio.run(body())
    first = Counter(order[1:46])  # the hand-overs while both runs still had a backlog
    assert first["b"] / first["a"] == pytest.approx(2.0, rel=0.1), (first, order)
    assert b'brigade_proxy_run_served_requests_total{run="a"} 40.0' in metrics
    assert b'brigade_proxy_run_served_requests_total{run="b"} 40.0' in metrics
    assert b'brigade_proxy_run_weight{run="b"} 2.0' in metrics
    assert b'brigade_proxy_run_waiting_requests{run="a"} 0.0' in metrics


def test_the_order_is_the_rule_itself_under_random_traffic(monkeypatch):
    """Against a direct reading of the rule (every waiting run scanned at every turn): random runs, weights,
    costs, priorities, charges from another replica and late corrections, all in one order of hand-overs."""
    import random

    from proxy.serving import slots as slots_module

    monkeypatch.setattr(slots_module, "AGING_S", 1e6)  # strict classes: the reference needs no clock
    rng = random.Random(20)
    weights = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 3.0}
    classes = (priority.CONTROL, priority.GENERATION, priority.GENERATION, priority.EVALUATION)

    class Reference:
        def __init__(self) -> None:
            self.vtime = dict.fromkeys(weights, 0.0)
            self.floor = 0.0
            self.waiting: list[tuple[int, int, str, float]] = []  # (priority, arrival, run, tokens)

        def charge(self, run: str, tokens: float) -> None:
            self.vtime[run] += tokens / weights[run]
            self.floor = max(self.floor, self.vtime[run])

        def enter(self, p: int, k: int, run: str, tokens: float) -> None:
            if not any(w[0] == p and w[2] == run for w in self.waiting):
                start = min((self.vtime[w[2]] for w in self.waiting if w[0] == p), default=self.floor)
                self.vtime[run] = max(self.vtime[run], start)
            self.waiting.append((p, k, run, tokens))

        def serve(self) -> str:
            p = min(w[0] for w in self.waiting)
            heads = {}
            for w in self.waiting:
                if w[0] == p and w[2] not in heads:
                    heads[w[2]] = w
            w = min(heads.values(), key=lambda w: (self.vtime[w[2]], w[1]))
            self.waiting.remove(w)
            self.charge(w[2], w[3])
            return f"{w[2]}{w[1]}"

    async def body() -> tuple[list[str], list[str]]:
        r, ref, expected, k = Replica(weights=weights), Reference(), [], 0
        await r.fill()
        for _ in range(600):
            step = rng.random()
            if step < 0.5 or not ref.waiting:
                run, p, tokens = rng.choice("abcd"), rng.choice(classes), float(rng.randint(10, 500))
                ref.enter(p, k, run, tokens)
                await r.ask(run, tokens=tokens, p=p, tag=f"{run}{k}")
                k += 1
            elif step < 0.6:  # another replica serves a run (the virtual times are the pool's)
                run, tokens = rng.choice("abcd"), float(rng.randint(10, 500))
                r.fair.charge(run, tokens)
                ref.charge(run, tokens)
            else:
                expected.append(ref.serve())
                (got,) = await r.serve(1)
                if rng.random() < 0.3:  # its usage came back: longer than expected
                    extra = float(rng.randint(0, 300))
                    r.fair.correct(got[0], extra)
                    ref.charge(got[0], extra)
        await r.close()
        return expected, r.granted

    expected, granted = asyncio.run(body())
    assert len(granted) > 100 and granted == expected
