"""The summary's phases on a run's records written out here: a fake only in that the events are typed in rather
than produced by a run (tests/e2e/test_e2e_local.py checks them on a real one); what is checked is which phase
a curriculum move and an evaluation belong to, which a short real run cannot be made to show for four phases."""

from __future__ import annotations

from infra.summary_phases import phase_figures


def _step(i: int, reward: float) -> dict:
    return {
        "step": i,
        "version": i,
        "reward": reward,
        "frac_reward_zero_std": 0.5,
        "entropy": 0.2,
        "ratio": 1.0,
        "clip_ratio/region_mean": 0.0,
        "grad_norm": 1.0,
        "learning_rate": 1e-3,
        "tokens": 40,
        "samples": 8,
    }


def test_eight_steps_in_four_phases_with_their_level_and_evaluations():
    steps = [_step(i, reward=i / 10) for i in range(1, 9)]
    moves = [{"level": 1, "version": 3}, {"level": 2, "version": 7}]
    evals = [{"version": v, "accuracy": a} for v, a in [(0, 0.25), (2, 0.3), (4, 0.5), (6, 0.45), (9, 0.4)]]
    evals.append({"version": 8, "accuracy": 0.0, "partial": True})  # cut short: not the version's accuracy
    phases = phase_figures(steps, moves, evals)["phases"]
    assert [p["steps"] for p in phases] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert [p["reward"] for p in phases] == [0.15, 0.35, 0.55, 0.75]
    assert [p["curriculum_level"] for p in phases] == [0, 1, 1, 2]
    assert [p["held_out"] for p in phases] == [[[0, 0.25], [2, 0.3]], [[4, 0.5]], [[6, 0.45]], [[9, 0.4]]]
    assert {p["completion_tokens_mean"] for p in phases} == {5.0}


def test_a_step_that_trained_nothing_is_left_out_of_the_token_means():
    idle = {**_step(2, 1.0), "tokens": 0, "samples": 0, "entropy": 0.0, "ratio": 1.0, "frac_reward_zero_std": 1.0}
    (phase,) = phase_figures([_step(1, 0.5), idle], [], [], n=1)["phases"]
    assert phase["entropy"] == 0.2 and phase["steps_trained"] == 1 and phase["frac_reward_zero_std"] == 0.75
    (phase,) = phase_figures([idle], [], [], n=1)["phases"]
    assert phase["entropy"] is None and phase["completion_tokens_mean"] is None


def test_a_run_shorter_than_four_steps_has_a_phase_a_step_and_no_run_has_none():
    assert [p["steps"] for p in phase_figures([_step(1, 0.0), _step(2, 1.0)], [], [])["phases"]] == [[1, 1], [2, 2]]
    assert phase_figures([], [], []) == {"phases": []}
