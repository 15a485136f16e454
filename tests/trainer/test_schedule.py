"""The learning-rate schedule (trainer/schedule.py): transformers' shapes, as a function of the step."""

import math

import pytest
from pydantic import ValidationError

from trainer.config import TrainerConfig
from trainer.schedule import lr_at


def test_the_shapes_by_hand():
    assert [lr_at(s, 4, 1.0, "constant") for s in range(4)] == [1.0] * 4
    assert [lr_at(s, 4, 1.0, "linear") for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    cos = [lr_at(s, 4, 1.0, "cosine") for s in range(4)]
    assert cos == pytest.approx([1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 + 0.5 * math.cos(3 * math.pi / 4)])


def test_warmup_rises_from_zero_then_the_shape_runs_over_the_rest():
    # ceil(0.1 x 20) = 2 warm-up steps: 0, 0.5, then linear over the 18 left
    lrs = [lr_at(s, 20, 2e-3, "linear", warmup_ratio=0.1) for s in range(20)]
    assert lrs[:3] == pytest.approx([0.0, 1e-3, 2e-3])
    assert lrs[3] == pytest.approx(2e-3 * (1 - 1 / 18)) and lrs[-1] == pytest.approx(2e-3 / 18)
    # past max_steps (a run extended on restart) it stays at the end of its shape
    assert lr_at(25, 20, 1.0, "cosine") == pytest.approx(0.0)


def test_a_bad_setting_is_refused_with_its_name():
    # pydantic names the field; the CLI prints it as a config error (bucket/config.py)
    with pytest.raises(ValidationError, match="lr_scheduler_type"):
        TrainerConfig(lr_scheduler_type="exponential")
    with pytest.raises(ValidationError, match="warmup_ratio"):
        TrainerConfig(warmup_ratio=1.0)
