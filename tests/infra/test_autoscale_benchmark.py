"""benchmarks/scaling/autoscale.py's arithmetic: the oracle, the figures read from a run, and the simulated
replicas' rate."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.scaling.autoscale_figures import (
    adjustments,
    best_fixed_count,
    busy_fraction,
    fixed_count_busy,
    needed_count,
    replica_seconds,
    split_and_lost,
)
from benchmarks.scaling.autoscale_sim import FixedRate
from benchmarks.scaling.autoscale_trainer import Phase, Step

# The benchmark's default shape: one replica makes 1 group/s, the fast trainer eats 2.7 replicas' worth.
FAST = 4 / 2.7
PHASES = [Phase(180, FAST), Phase(150, 3 * FAST), Phase(180, FAST)]


def test_the_oracle_is_the_fewest_replicas_that_keep_the_trainer_busy_over_the_whole_run():
    oracle = best_fixed_count(PHASES, groups_per_step=4, groups_per_replica_s=1.0, low=1, high=4, goal=0.9)
    # 2 replicas feed 2 / 2.7 of the fast phases and all of the slow one: (360 x 0.741 + 150) / 510 = 0.817
    assert oracle["busy_by_count"]["2"] == pytest.approx(0.817, abs=1e-3)
    assert oracle["count"] == 3 and oracle["busy"] == 1.0
    assert oracle["replica_seconds"] == 3 * 510
    assert fixed_count_busy(1, PHASES, 4, 1.0) == pytest.approx((360 / 2.7 + 150 * 1.0) / 510, abs=1e-9)
    # none reaches the goal: the highest count, with the share it gets
    assert best_fixed_count(PHASES, 4, 0.25, 1, 4, 0.9)["count"] == 4


def test_each_phase_needs_the_fewest_replicas_that_keep_it_busy():
    assert [needed_count(p, 4, 1.0, 0.9, 4) for p in PHASES] == [3, 1, 3]
    assert needed_count(Phase(10, 0.1), 4, 1.0, 0.9, 4) == 4  # more than the bound allows: the bound


def test_replica_seconds_count_from_the_ask_to_the_stop_within_the_run():
    lives = [(-10.0, None), (20.0, 50.0), (90.0, 130.0)]  # up before the run, one gone, one past its end
    assert replica_seconds(lives, 0.0, 100.0) == 100 + 30 + 10


def test_busy_fraction_counts_the_compute_inside_the_span():
    steps = [Step(0, 1, 3, 4), Step(3, 5, 7, 4), Step(7, 9, 11, 4)]
    assert busy_fraction(steps, 0, 10) == pytest.approx(0.5)  # 2 + 2 + 1 of 10 s
    assert busy_fraction(steps, 5, 5) is None


def test_adjust_s_is_the_time_until_the_count_a_phase_settled_on_serves():
    samples = [(float(t), 3 if t < 20 else 2 if t < 60 else 1) for t in range(0, 100)]
    samples += [(float(t), 1 if t < 130 else 2 if t < 160 else 3) for t in range(100, 200)]
    changes = adjustments(samples, starts=[10.0, 100.0], ends=[100.0, 200.0], needed=[1, 3])
    assert [c["adjust_s"] for c in changes] == [50.0, 60.0]
    assert [c["to_needed_s"] for c in changes] == [50.0, 60.0]
    assert [(c["before"], c["settled"]) for c in changes] == [(3, 1), (1, 3)]
    short = adjustments(samples, starts=[10.0], ends=[50.0], needed=[1])  # settled on 2 within it; 1 never served
    assert short[0]["settled"] == 2 and short[0]["adjust_s"] == 10.0 and short[0]["to_needed_s"] is None
    still = adjustments([(float(t), 2) for t in range(50)], starts=[10.0], ends=[50.0], needed=[2])
    assert still[0]["adjust_s"] == 0.0  # it had the count it needs already
    stuck = adjustments([(float(t), 2) for t in range(50)], starts=[10.0], ends=[50.0], needed=[1])
    assert stuck[0]["adjust_s"] is None  # it needed fewer and never moved
    away = adjustments([(float(t), 3 if t < 15 else 2) for t in range(50)], starts=[10.0], ends=[50.0], needed=[3])
    assert away[0]["adjust_s"] is None and away[0]["to_needed_s"] == 0.0  # it had what it needs, and went lower


def test_split_and_lost_groups():
    a, b, c, d, e = (1,), (2,), (3,), (4,), (5,)
    written = [(a, {"r0"}), (b, {"r0", "r1"}), (c, {"r1"}), (d, {"r1"})]
    served = {a: [("r0", 1.0)], b: [("r0", 1.0), ("r1", 1.0)], c: [("r0", 1.0), ("r1", 2.0)], d: [("r1", 1.0)]}
    served |= {e: [("r0", 3.0)]}  # served, never written
    cut = {d: [("r0", 0.5)], (6,): [("r2", 99.0)]}  # d begun on r0, cut, done on r1; (6,) cut after the cutoff
    assert split_and_lost(written, served, cut, cutoff=10.0) == {"split": 3, "served_unwritten": 1, "cut_unwritten": 0}


def test_a_simulated_replica_decodes_at_its_fixed_rate_whatever_its_batch():
    async def timed(engine: FixedRate, n: int, tokens: int) -> float:
        t0 = time.monotonic()
        await engine.decode(n, tokens)
        return time.monotonic() - t0

    async def scenario() -> tuple[float, list[float]]:
        alone = await timed(FixedRate(2000), 1, 100)  # 100 tokens at 2000/s
        engine = FixedRate(2000)
        # 4 sequences of 100 tokens, and 1 more arriving 0.05 s later: 500 tokens in all, 0.25 s of decoding
        together = await asyncio.gather(timed(engine, 4, 100), _later(0.05, timed(engine, 1, 100)))
        return alone, together

    alone, (group, late) = asyncio.run(scenario())
    assert alone == pytest.approx(0.05, abs=0.02)
    # by 0.05 s each of the 4 has 25 tokens; then 5 share 2000/s: the 4 end at 0.05 + 75 / 400 = 0.2375 s, and the
    # late one, 75 tokens in by then, has its last 25 alone: it ends at 0.25 s, 0.2 s after it arrived
    assert group == pytest.approx(0.2375, abs=0.03)
    assert late == pytest.approx(0.20, abs=0.03)


async def _later(delay: float, work):
    await asyncio.sleep(delay)
    return await work
