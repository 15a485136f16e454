"""`brigade local` sizes its evaluations for an AVX2-only CPU, never overriding what the user set (issue 17).

Fast: no job is started. The host's CPU is stood in for (jobkit.cpu reads /proc/cpuinfo once), so each test
means the same on either kind of machine; the cap variables are read on every call, as on a real run.
"""

from __future__ import annotations

import json
import time

import pytest

import infra.local
from bucket.store import Store
from infra.cli import TOOLS, build_parser
from infra.config import load
from infra.local_sizing import AVX2_ROLLOUT, describe_sizing, size_for_cpu
from infra.local_summary import Ending, write_summary
from jobkit import cpu

AVX512 = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
DEFAULTS = {"eval_size": 200, "eval_max_tokens": 32, "eval_every_versions": 8}


@pytest.fixture
def fast_cpu(monkeypatch):
    """An AVX-512/AMX CPU, uncapped unless a test sets the cap."""
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: ("a fast CPU", AVX512))
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)


def _local_config(*flags: str, toml: str | None = None, tmp_path=None):
    """The config `brigade local` gets from these flags (and TOML file), parsed as the CLI parses it."""
    argv = ["local", *flags]
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(toml)
        argv += ["--config", str(path)]
    return load(build_parser().parse_args(argv), TOOLS["local"][1])


def _eval_fields(config) -> dict[str, int]:
    return {k: getattr(config.rollout, k) for k in DEFAULTS}


def test_the_defaults_match_what_sizing_replaces(fast_cpu):
    # if a default moves, the sizing (and the docs quoting both) must be looked at again
    assert _eval_fields(_local_config()) == DEFAULTS


@pytest.mark.parametrize(("var", "value"), [("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")])
def test_a_cpu_capped_at_avx2_gets_lighter_evaluations(fast_cpu, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    config, sizing = size_for_cpu(_local_config())
    assert _eval_fields(config) == AVX2_ROLLOUT
    assert sizing == {"cpu_class": "avx2", "rollout": AVX2_ROLLOUT}
    assert describe_sizing(sizing) == (
        "AVX2-only CPU: evaluations sized for it (eval_size 100, eval_max_tokens 16, eval_every_versions 16); "
        "set them (--rollout.<field>) to override"
    )


def test_an_avx2_only_cpu_is_sized_without_any_cap(monkeypatch):
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: ("a slow CPU", frozenset({"avx2", "fma"})))
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    config, sizing = size_for_cpu(_local_config())
    assert _eval_fields(config) == AVX2_ROLLOUT and sizing["cpu_class"] == "avx2"


def test_values_given_by_flag_or_toml_are_kept(fast_cpu, monkeypatch, tmp_path):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    # a flag, even one equal to the default, and a TOML value: both explicit
    given = _local_config("--rollout.eval-size", "200", toml="[rollout]\neval_every_versions = 4\n", tmp_path=tmp_path)
    config, sizing = size_for_cpu(given)
    assert _eval_fields(config) == {"eval_size": 200, "eval_max_tokens": 16, "eval_every_versions": 4}
    assert sizing["rollout"] == {"eval_max_tokens": 16}
    # every field given: nothing to change, nothing to say
    all_given = _local_config(*(f for k, v in DEFAULTS.items() for f in (f"--rollout.{k.replace('_', '-')}", str(v))))
    config, sizing = size_for_cpu(all_given)
    assert _eval_fields(config) == DEFAULTS and sizing == {} and describe_sizing(sizing) == ""


def test_an_uncapped_fast_cpu_keeps_the_defaults(fast_cpu):
    given = _local_config("--rollout.eval-size", "50")
    config, sizing = size_for_cpu(given)
    assert config is given and sizing == {}
    assert _eval_fields(config) == {**DEFAULTS, "eval_size": 50}


def test_brigade_local_runs_its_jobs_with_the_sized_config_and_says_so(fast_cpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    seen = {}

    def stand_in(config, store, run_dir, logs, sizing=None):  # the jobs themselves are not started
        seen.update(config=config, sizing=sizing)
        return 0

    monkeypatch.setattr(infra.local, "_run_in", stand_in)
    config = _local_config("--bucket", str(tmp_path / "bucket"), "--rollout.eval-max-tokens", "24")
    assert infra.local.run(config) == 0
    assert _eval_fields(seen["config"]) == {"eval_size": 100, "eval_max_tokens": 24, "eval_every_versions": 16}
    assert seen["sizing"]["rollout"] == {"eval_size": 100, "eval_every_versions": 16}
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU a fast CPU") and "capped at AVX2" in lines[0]
    assert lines[1].startswith("AVX2-only CPU: evaluations sized for it (eval_size 100, eval_every_versions 16)")


def test_the_summary_records_the_sizing(tmp_path, capsys):
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    sizing = {"cpu_class": "avx2", "rollout": dict(AVX2_ROLLOUT)}
    kwargs = {"started": time.monotonic(), "started_at": time.time(), "replica_startup_s": 0.0, "max_steps": 30}
    assert write_summary(store, str(tmp_path), Ending(), max_wall_s=60, sized_for_cpu=sizing, **kwargs)
    assert json.loads((tmp_path / "summary.json").read_text())["sized_for_cpu"] == sizing
    assert "sized for the CPU     eval_size 100, eval_max_tokens 16, eval_every_versions 16 (avx2)" in (
        capsys.readouterr().out
    )
    # not sized: an empty record, and no line
    assert write_summary(store, str(tmp_path), Ending(), max_wall_s=60, **kwargs)
    assert json.loads((tmp_path / "summary.json").read_text())["sized_for_cpu"] == {}
    assert "sized for the CPU" not in capsys.readouterr().out
