"""`brigade eval` against the session's real vLLM replicas, through a real proxy: the base model and an adapter
version on the fixed held-out set, results in the bucket as events, read back by the summary. Then `brigade eval
--pool`: the same replicas behind a real pool proxy, a run's versions evaluated there with the run's token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from bucket import adapters, events, pool
from bucket.manifest import RunSpec, init_or_check
from bucket.store import Store
from infra.summary import render, summarize
from tests.helpers import REPO_ROOT, free_port, host_timeout, make_adapter_files, stop, wait_http

EVAL_SIZE = 24
POOL_EVAL_SIZE = 8
ENV_EVAL_SIZE = 6
POOL_ADMIN = "pool-admin-token-for-the-eval-test"


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


def _eval(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "eval", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=host_timeout(600),
    )


def test_eval_on_a_pool_with_the_runs_token(vllm_replicas, model_dir, tmp_path):
    """A run whose training is over (not attached to the pool, its version never pushed there): `brigade eval
    --pool` attaches it, pushes the version, evaluates the base model and the version through the pool's proxy
    with the run's token (from a file), and leaves the pool as it found it. The session's replicas, named by URL
    as in tests/e2e/test_shared_pool.py (they registered in the session's own bucket); 2 x 8 short answers."""
    _, infos, session = vllm_replicas
    pool_store = Store(str(tmp_path / "pool"))
    pool_store.check_reachable(create=True)
    pool.init_pool(pool_store, "eval-pool", session.base_model)
    run_store = Store(str(tmp_path / "run"))
    run_store.check_reachable(create=True)
    manifest = init_or_check(run_store, RunSpec(), "test")
    version = adapters.next_version(run_store)
    adapters.publish(run_store, version, make_adapter_files(model_dir, str(tmp_path / "adapter")))
    token = pool.new_token(pool_store, manifest.run_id)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--bucket", pool_store.url, "--proxy.pool", "true", "--proxy.port", str(port)]
        + ["--proxy.replica-urls", ",".join(i.url for i in infos)]
        + ["--proxy.adapter-root", str(tmp_path / "pool" / "adapters"), "--proxy.pool-max-loras", "6"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "BRIGADE_PROXY_ADMIN_TOKEN": POOL_ADMIN},
    )
    env = {k: v for k, v in os.environ.items() if k != "BRIGADE_POOL_TOKEN"}
    common = ["--bucket", run_store.url, "--pool", url, "--rollout.eval-size", str(POOL_EVAL_SIZE)]
    common += ["--rollout.eval-max-tokens", "24"]
    try:
        wait_http(f"{url}/health", 60, proxy)
        # A token the pool does not know: refused before anything is generated, saying where the token came from.
        wrong = _eval([*common, "--versions", "0"], {**env, "BRIGADE_POOL_TOKEN": "not-this-runs-token"})
        assert wrong.returncode == 2, wrong.stdout[-2000:] + wrong.stderr[-4000:]
        assert "does not know the token in $BRIGADE_POOL_TOKEN" in wrong.stderr, wrong.stderr[-2000:]
        assert "not-this-runs-token" not in wrong.stdout + wrong.stderr  # never logged
        done = _eval([*common, "--pool-token-file", str(token_file), "--versions", f"0,{version}"], env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert token not in done.stdout + done.stderr
        admin = {"Authorization": f"Bearer {POOL_ADMIN}"}
        left = httpx.get(f"{url}/live_adapters", headers=admin, timeout=30).json()
    finally:
        stop(proxy)
    printed = {r["version"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(printed) == {0, version}

    # The results are the run's: in its own bucket, under its own version names.
    evals = {e["version"]: e for e in events.read_all(run_store) if e["kind"] == events.EVAL}
    base, tuned = evals[0], evals[version]
    assert base["model"] == session.base_model and tuned["model"] == f"{manifest.run_id}-{version.folder}"
    for e in (base, tuned):
        assert e["total"] == POOL_EVAL_SIZE and e["accuracy"] == printed[e["version"]]["accuracy"]
    assert base["eval_set"] == tuned["eval_set"]
    # the version really was served by the pool's replicas: a random adapter changes what the model answers
    assert [x["completion"] for x in base["examples"]] != [x["completion"] for x in tuned["examples"]]

    # The pool's record: the run admitted for the evaluation, its version pushed into the run's folder, and the
    # run detached again with its adapter unloaded (nothing of it left live).
    kinds = [(e["kind"], e.get("run")) for e in events.read_all(pool_store)]
    rid = manifest.run_id
    assert (events.RUN_ADMITTED, rid) in kinds and (events.ADAPTER_PUSHED, rid) in kinds
    assert adapters.committed_versions(pool_store, root=pool.adapters_folder(rid)) == [version]
    detached = [e for e in events.read_all(pool_store) if e["kind"] == events.RUN_DETACHED and e["run"] == rid]
    assert [(e["reason"], e["unloaded"]) for e in detached] == [("left", [tuned["model"]])]
    assert left == {"runs": {}} and not pool_store.exists(pool.run_key(rid))


def test_eval_of_an_environment_run_runs_its_episodes(vllm_replicas, tmp_path):
    """`brigade eval --rollout.environment ...`: the held-out sums as greedy episodes of the built-in retry game
    (a wrong answer is told so and tried again), judged by the game's reward (1 at the first try, 0.5 at the
    second); the run's own bucket, its proxy in front of the session's replicas by URL."""
    _, infos, session = vllm_replicas
    run_store = Store(str(tmp_path / "run"))
    run_store.check_reachable(create=True)
    init_or_check(run_store, RunSpec(), "test")
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--bucket", run_store.url, "--proxy.port", str(port)]
        + ["--proxy.replica-urls", ",".join(i.url for i in infos)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    flags = ["--bucket", run_store.url, "--rollout.proxy-url", f"http://127.0.0.1:{port}", "--versions", "0"]
    flags += ["--rollout.eval-size", str(ENV_EVAL_SIZE), "--rollout.max-completion-length", "12"]
    flags += ["--rollout.environment", "rollout_worker.environments.retry_sums:RetrySums", "--rollout.max-turns", "2"]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        done = _eval(flags, dict(os.environ))
    finally:
        stop(proxy)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (printed,) = json.loads(done.stdout.strip().splitlines()[-1])
    (e,) = [e for e in events.read_all(run_store) if e["kind"] == events.EVAL]
    assert e["environment"] == "rollout_worker.environments.retry_sums:RetrySums" and e["judge"] == "episode reward"
    assert (e["model"], e["max_turns"], e["max_tokens"], e["success_threshold"]) == (session.base_model, 2, 12, 1.0)
    assert e["partial"] is False and e["env_errors"] == 0 and e["total"] == ENV_EVAL_SIZE, e
    # the episodes' rewards are the game's, and a success is a right first answer (the full reward)
    assert {x["reward"] for x in e["examples"]} <= {0.0, 0.5, 1.0}, e["examples"]
    for x in e["examples"]:  # a wrong first answer was told so and answered again
        assert (x["reward"] < 1.0) == ("[user] That is not right." in x["completion"]), x
    assert e["accuracy"] == e["correct"] / ENV_EVAL_SIZE and 0.0 <= e["mean_reward"] <= 1.0
    assert e["mean_reward"] >= e["accuracy"]  # successes score 1, the rest 0 or 0.5
    assert (printed["accuracy"], printed["mean_reward"], printed["env_errors"]) == (e["accuracy"], e["mean_reward"], 0)
