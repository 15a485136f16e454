"""A run's config written as TOML (jobkit/settings.py `to_toml`: brigade local's config.toml, `brigade plan`'s
file) reads back as the same config, unset (None) settings included: TOML has no null, and a `null` written
there made every job of `brigade local` refuse its config file."""

from __future__ import annotations

import tomllib

from infra.config import load, to_toml


def test_the_default_config_and_a_set_optional_round_trip(tmp_path):
    for overrides in ({}, {"rollout.switch_after": 2}):
        config = load(overrides={"bucket.url": str(tmp_path / "b"), **overrides})
        text = to_toml(config)
        tomllib.loads(text)  # valid TOML
        path = tmp_path / "config.toml"
        path.write_text(text)
        assert load(path=str(path)) == config, overrides
    assert "# switch_after unset" in to_toml(load(overrides={"bucket.url": str(tmp_path / "b")}))


def test_an_unset_optional_flag_says_its_type_and_unset():
    import argparse

    from infra.config import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, ["rollout"])
    help_text = parser.format_help()
    assert "--rollout.switch-after INT" in help_text and "NONETYPE" not in help_text
    assert "(default: unset)" in help_text and "(default: null)" not in help_text
