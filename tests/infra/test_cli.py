"""The `brigade` CLI: help, config files and flags, and the errors a person sees on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bucket import Store
from bucket.manifest import RunSpec, init_or_check
from infra.config import ConfigError, load


def brigade(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_explains_each_option():
    out = brigade("trainer", "--help").stdout
    assert "--trainer.learning-rate" in out and "AdamW learning rate" in out
    assert "--run.max-staleness" in out and "(default: 4)" in out
    top = brigade("--help").stdout
    for cmd in ("local", "trainer", "rollout", "proxy", "replica", "prepare-model"):
        assert cmd in top


def test_toml_then_flags_then_validation(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nnum_generations = 4\n[trainer]\nlearning_rate = 1e-3\nmax_steps = 7\n")
    import argparse

    from infra.config import add_flags

    p = argparse.ArgumentParser()
    add_flags(p, ["run", "bucket", "trainer"])
    c = load(
        p.parse_args(["--config", str(cfg), "--trainer.max-steps", "9", "--bucket", "/x"]), ["run", "bucket", "trainer"]
    )
    assert (c.run.num_generations, c.trainer.learning_rate, c.trainer.max_steps, c.bucket.url) == (4, 1e-3, 9, "/x")
    with pytest.raises(ConfigError, match=r"trainer.max_steps"):
        load(p.parse_args(["--trainer.max-steps", "-1"]), ["trainer"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainr]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown tables"):
        load(path=str(bad))


def test_missing_bucket_flag():
    r = brigade("trainer")
    assert r.returncode == 2 and "no bucket given" in r.stderr


def test_unreachable_bucket_is_reported(tmp_path):
    r = brigade("rollout", "--bucket", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = brigade(
        "proxy",
        "--bucket",
        "s3://brigade-nope/run",
        env={
            "BRIGADE_S3_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
            "AWS_MAX_ATTEMPTS": "1",
            "AWS_RETRY_MODE": "standard",
        },
    )
    assert r.returncode == 2 and "unreachable" in r.stderr, r.stderr[-2000:]


def test_missing_and_mismatched_run_manifest(tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    r = brigade("rollout", "--bucket", str(bucket), "--bucket.manifest-wait-s", "0.5")
    assert r.returncode == 2 and "run.json is missing" in r.stderr
    init_or_check(Store(str(bucket)), RunSpec(num_generations=8), "test")
    r = brigade("proxy", "--bucket", str(bucket), "--run.num-generations", "4")
    assert r.returncode == 2
    assert "run.num_generations: run.json has 8, this proxy has 4" in r.stderr
    assert not list(bucket.glob("rollouts/*")), "a refused job must write nothing"


def test_cpu_jobs_do_not_need_torch():
    """The proxy and rollout worker run on small CPU machines: their imports and their install leave torch out."""
    code = (
        "import sys, infra.cli, infra.config, rollout_worker.main, rollout_worker.prompts, bucket.rollouts; "
        "import rollout_worker.rewards; rollout_worker.prompts.load_data('arithmetic', '', 8); "
        "rollout_worker.rewards.math_verify_reward(['1/2'], ['0.5']); "
        "bad = [m for m in ('torch', 'transformers', 'vllm', 'peft') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    light = project["dependencies"] + [
        d for extra in ("proxy", "rollout", "s3") for d in project["optional-dependencies"][extra]
    ]
    heavy = ("torch", "transformers", "vllm", "peft", "accelerate")
    assert not [d for d in light if d.split("[")[0].split(">")[0].split("=")[0].strip() in heavy], light


def test_example_config_is_valid():
    from pathlib import Path

    c = load(path=str(Path(__file__).parents[2] / "infra" / "example-run.toml"))
    assert c.trainer.max_steps == 40 and c.run.num_generations == 8 and c.local.num_replicas == 2


def test_init_records_the_trainers_tokenizer_in_run_json(tmp_path, model_dir):
    from bucket.manifest import read_manifest
    from bucket.tokenizer_id import fingerprint

    bucket = tmp_path / "bucket"
    out = brigade("init", "--bucket", str(bucket), "--trainer.model-path", model_dir)
    assert out.returncode == 0, out.stderr
    recorded = read_manifest(Store(str(bucket))).tokenizer
    assert recorded == fingerprint(model_dir) and {"sha256", "tokenizer.json"} <= set(recorded)
