"""TRL's AsyncGRPOTrainer trains through the proxy as its `vllm_server_base_url`, against the session's two real
vLLM replicas, unmodified (its CPU shims are in trl_through_proxy.py, each with its reason).

The proxy presents the two replicas as one server: TRL's pause, adapter loads (its own folders inside the
bucket, imported under its names), unloads and rollouts all go through it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bucket import adapters, events
from tests.helpers import REPO_ROOT, free_port, host_timeout, stop, wait_http


def test_trls_async_grpo_trainer_trains_through_the_proxy(vllm_replicas, model_dir, tmp_path):
    pytest.importorskip("trl")
    store, infos, manifest = vllm_replicas
    before = set(adapters.committed_versions(store))
    port = free_port()
    proxy_log = tmp_path / "proxy.log"
    with open(proxy_log, "wb") as out:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--bucket", store.url, "--proxy.port", str(port)],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    output_dir = os.path.join(store.root, "trl-run")  # inside the bucket: so are TRL's adapter folders
    try:
        wait_http(url + "/health", 60, proxy)
        env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
        # Two steps make three syncs through the proxy: the untrained adapter, one per step, and the third
        # unloads the first (TRL keeps max_staleness + 1 loaded)
        steps = 2
        run = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO_ROOT, "tests", "e2e", "trl_through_proxy.py"),
                url,
                model_dir,
                output_dir,
                str(steps),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=host_timeout(300),  # TRL training on the CPU: about 4x longer on an AVX2-only host
        )
    finally:
        stop(proxy)
    log = proxy_log.read_text()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:] + log[-2000:]
    assert re.search(rf"TRAINED {steps}\b", run.stdout), run.stdout[-2000:]
    # every step logged its reward: completions came back through the proxy and were scored
    assert len(re.findall(r"'rewards/answer_reward': '", run.stdout)) >= steps, run.stdout[-2000:]
    # every sync TRL made became a committed version imported from its folder, loaded on both replicas
    imported = {}
    for v in set(adapters.committed_versions(store)) - before:
        marker = adapters.commit_marker(store, v)
        assert marker is not None and "imported" in marker, marker
        imported[marker["imported"]["lora_name"]] = v
        assert marker["imported"]["from"].startswith("trl-run/.vllm_lora/")
    assert {f"trl-policy-v{i}" for i in range(1, steps + 1)} <= set(imported), imported  # a trained one among them
    loaded = [e for e in events.read_all(store) if e["kind"] == events.LOADED_ALL and e["version"] in imported.values()]
    assert {e["lora_name"] for e in loaded} == set(imported) and all(e["replicas"] == len(infos) for e in loaded)
