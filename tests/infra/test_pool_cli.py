"""`brigade pool init|token|status`: a pool's bucket made, a run's token given once, the pool shown."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

from bucket import adapters, pool, replicas
from bucket.pool import AttachedRun
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from infra import pool_cli
from tests.helpers import REPO_ROOT

BASE = "SmolLM2-135M-Instruct"


def brigade_pool(capsys, *args: str) -> tuple[int, str, str]:
    rc = pool_cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_init_writes_pool_json_once_and_refuses_another_base_model(tmp_path, capsys):
    url = str(tmp_path / "pools" / "main")
    rc, out, _ = brigade_pool(capsys, "init", "--pool", url, "--base-model", BASE)
    assert rc == 0 and f"wrote {url}/pool.json" in out and '"pool_id": "main"' in out
    written = pool.read_pool(Store(url))
    assert (written.pool_id, written.base_model) == ("main", BASE)
    rc, out, _ = brigade_pool(capsys, "init", "--pool", url, "--base-model", BASE, "--pool-id", "other")
    assert rc == 0 and "nothing written" in out
    assert pool.read_pool(Store(url)) == written  # the same pool, untouched
    rc, out, err = brigade_pool(capsys, "init", "--pool", url, "--base-model", "Qwen2.5-1.5B-Instruct")
    assert rc == 2 and out == ""
    assert f"'{BASE}'" in err and "'Qwen2.5-1.5B-Instruct'" in err and "another bucket or prefix" in err
    assert pool.read_pool(Store(url)) == written


def test_a_token_is_printed_once_and_only_its_hash_is_stored(tmp_path, capsys, caplog):
    url = str(tmp_path / "pool")
    brigade_pool(capsys, "init", "--pool", url, "--base-model", BASE)
    caplog.set_level(logging.DEBUG)
    rc, out, err = brigade_pool(capsys, "token", "--pool", url, "--run", "run-a")
    assert rc == 0 and out.startswith("export BRIGADE_POOL_TOKEN=") and out.count("\n") == 1
    token = out.strip().split("=", 1)[1]
    assert len(token) >= 32 and token not in err and token not in caplog.text
    assert "BRIGADE_POOL_TOKEN" in err and "once" in err
    stored = pool.read_token(Store(url), "run-a")
    assert stored is not None and stored.sha256 == pool.token_sha256(token) and pool.token_matches(stored, token)
    for folder, _, files in os.walk(url):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert token.encode() not in f.read(), f"the token is written in {name}"
    # A new token replaces the old one: the first stops matching.
    _, again, _ = brigade_pool(capsys, "token", "--pool", url, "--run", "run-a")
    assert not pool.token_matches(pool.read_token(Store(url), "run-a"), token)
    assert pool.token_matches(pool.read_token(Store(url), "run-a"), again.strip().split("=", 1)[1])


def test_a_token_needs_a_pool_and_a_run_id_that_can_name_a_folder(tmp_path, capsys):
    url = str(tmp_path / "not-a-pool")
    os.makedirs(url)
    rc, out, err = brigade_pool(capsys, "token", "--pool", url, "--run", "a")
    assert rc == 2 and out == "" and "pool.json is missing" in err and "brigade pool init" in err
    brigade_pool(capsys, "init", "--pool", url, "--base-model", BASE)
    rc, out, err = brigade_pool(capsys, "token", "--pool", url, "--run", "../escape")
    assert rc == 2 and out == "" and "cannot join a pool" in err
    assert not os.path.exists(os.path.join(url, "tokens"))


def test_status_shows_runs_replicas_and_adapter_slots(tmp_path, capsys):
    url = str(tmp_path / "shared")
    brigade_pool(capsys, "init", "--pool", url, "--base-model", BASE)
    store = Store(url)
    now = time.time()
    for run_id, staleness, weight, lease in (("a", 4, 1.0, 42), ("b", 1, 2.0, -5)):
        pool.write_run(
            store,
            AttachedRun(
                run_id=run_id,
                base_model=BASE,
                max_staleness=staleness,
                weight=weight,
                admitted_at=now - 100,
                lease_until=now + lease,
            ),
        )
        pool.new_token(store, run_id)
    pool.new_token(store, "idle")
    adapters.publish(store, 7, {"adapter_config.json": b"{}"}, root=pool.adapters_folder("a"))
    for rid, max_loras in (("r0", 16), ("r1", 12)):
        replicas.register(
            store,
            ReplicaInfo(
                replica_id=rid,
                url=f"http://{rid}:8200",
                adapter_root="/cache",
                base_model=BASE,
                block_size=16,
                max_loras=max_loras,
                started_at=now,
                mirrored_runs={"a": [7]} if rid == "r0" else None,
            ),
        )
    rc, out, _ = brigade_pool(capsys, "status", "--pool", url)
    assert rc == 0
    assert f"pool shared at {url}: base model {BASE}" in out
    assert "a: weight 1, window 6 (max_staleness 4), lease 4" in out and "newest adapter v000007" in out
    assert "b: weight 2, window 3 (max_staleness 1), lease lapsed 5s ago, newest adapter none yet" in out
    assert "r0 (http://r0:8200): max_loras 16" in out and "mirrors 1 run(s)" in out
    assert "r1 (http://r1:8200): max_loras 12" in out
    assert "adapter slots: 9 used of 12 (the smallest max_loras), 3 free" in out
    assert "tokens issued: 3 (not admitted now: idle)" in out
    rc, out, _ = brigade_pool(capsys, "status", "--pool", url, "--json")
    shown = json.loads(out)
    assert shown["slots"] == {"total": 12, "used": 9, "free": 3}
    assert shown["runs"]["a"]["newest"] == 7 and shown["runs"]["b"]["window"] == 3
    assert shown["replicas"]["r0"]["mirrored_runs"] == {"a": 1}


def test_status_of_a_pool_without_replicas_and_the_brigade_command(tmp_path):
    url = str(tmp_path / "pool")
    os.makedirs(url)
    pool.init_pool(Store(url), "p", BASE)
    out = subprocess.run(
        [sys.executable, "-m", "infra.cli", "pool", "status", "--pool", url],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "runs admitted: 0" in out.stdout and "no replica registered yet" in out.stdout
