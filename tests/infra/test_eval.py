"""`brigade eval` against the session's real vLLM replicas, through a real proxy: the base model and an adapter
version on the fixed held-out set, results in the bucket as events, read back by the summary."""

from __future__ import annotations

import json
import subprocess
import sys

from bucket import adapters, events
from infra.summary import render, summarize
from tests.helpers import REPO_ROOT, free_port, host_timeout, make_adapter_files, stop, wait_http

EVAL_SIZE = 24


def test_eval_of_the_base_and_a_version_through_the_proxy(vllm_replicas, model_dir, tmp_path):
    store, _, manifest = vllm_replicas
    version = adapters.next_version(store)
    adapters.publish(store, version, make_adapter_files(model_dir, str(tmp_path / "adapter")))
    port = free_port()
    common = ["--bucket", store.url]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", *common, "--proxy.port", str(port), "--proxy.refresh-s", "0.5"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        flags = ["--rollout.proxy-url", f"http://127.0.0.1:{port}", "--rollout.eval-size", str(EVAL_SIZE)]
        flags += ["--rollout.eval-max-tokens", "24", "--versions", f"0,{version}"]
        done = subprocess.run(
            [sys.executable, "-m", "infra.cli", "eval", *common, *flags],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=host_timeout(600),  # generating 2 x 24 answers on the replicas
        )
    finally:
        stop(proxy)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    printed = {r["version"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(printed) == {0, version}

    evals = {e["version"]: e for e in events.read_all(store) if e["kind"] == events.EVAL}
    base, tuned = evals[0], evals[version]
    for e in (base, tuned):
        assert e["total"] == EVAL_SIZE and 0 <= e["correct"] <= EVAL_SIZE
        assert e["accuracy"] == printed[e["version"]]["accuracy"] == e["correct"] / EVAL_SIZE
        assert e["judge"] == "rollout_worker.rewards:exact_match"
    assert base["eval_set"] == tuned["eval_set"]  # one fixed set for both
    assert base["model"] == manifest.base_model and tuned["model"] == manifest.lora_name(version)
    assert base["accuracy"] > 0  # the base model gets some of these sums right
    # the version really was served: a random adapter changes what the model answers
    assert [x["completion"] for x in base["examples"]] != [x["completion"] for x in tuned["examples"]]
    # what `brigade eval` loaded, it unloaded again
    unloaded = [e for e in events.read_all(store) if e["kind"] == events.UNLOADED]
    assert any(e.get("lora_name") == manifest.lora_name(version) for e in unloaded)

    s = summarize(store)
    assert s["base_accuracy"] == base["accuracy"] and s["final_accuracy"] == tuned["accuracy"]
    assert "held-out accuracy" in render(s)
