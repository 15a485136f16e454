"""The rollout worker on a shared pool (issue 20): attach, lease, push of the run's adapters, detach.

Against a small fake pool proxy served over real HTTP in this process (FakePool below), which implements the
run <-> pool contract of the shared-pool plan (docs/design/shared_pool.md: status codes, bodies, the token
rule). A fake because the real pool proxy is being built in parallel with this client; a test against it
comes once it lands. Everything else is real: the worker's own entry point, its bucket (a local folder), the
adapter versions committed with bucket/adapters.py, the events the run's summary reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from bucket import adapters, events
from bucket.manifest import RunSpec, init_or_check
from bucket.progress import TrainerDone, mark_done
from bucket.store import Store
from bucket.version import Version
from infra.summary import summarize
from rollout_worker.__main__ import main as worker_main
from rollout_worker.pool_client import PoolRefused, PoolSession, PoolUnavailable
from rollout_worker.pool_publisher import Publisher
from tests.helpers import REPO_ROOT, free_port

TOKEN = "run-token-for-the-test"
BASE = RunSpec().base_model
ADAPTER_FILES = frozenset(adapters.ADAPTER_FILES)


class FakePool:
    """The pool's side of the contract, with the state a test sets up and then checks."""

    def __init__(self, run_id: str, lease_s: float = 0.3) -> None:
        self.run_id, self.lease_s = run_id, lease_s
        self.tokens = {TOKEN: run_id, "other-run-token": "other-run"}
        self.refuse: tuple[int, str] | None = None  # the answer to every attach, when set
        self.admitted: set[str] = set()
        self.files: dict[tuple[str, int], dict[str, bytes]] = {}
        self.committed: dict[tuple[str, int], dict[str, Any]] = {}
        self.live: dict[str, set[int]] = {}
        self.requests: list[tuple[str, str, str, int]] = []  # method, path, Authorization, status answered
        self.bodies: dict[tuple[str, str], bytes] = {}  # (method, path) -> the last body received
        self.queries: dict[tuple[str, str], str] = {}  # (method, path) -> the last query string received
        self.generated_with: list[str] = []  # the model of each generation answered 200
        self.lock = threading.Lock()
        pool = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: pytest shows failures, not every request
                pass

            def _serve(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path, query = urlsplit(self.path).path, urlsplit(self.path).query
                with pool.lock:
                    status, answer = pool.answer(method, path, self.headers.get("Authorization", ""), body)
                    if status >= 400:  # errors in the proxy's shape (vLLM's: proxy/errors.py)
                        answer = {"error": {"message": answer["detail"], "type": "Error", "code": status}}
                    pool.requests.append((method, path, self.headers.get("Authorization", ""), status))
                    pool.bodies[(method, path)] = body
                    pool.queries[(method, path)] = query
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, method: str, path: str, auth: str, body: bytes) -> tuple[int, Any]:
        if path == "/health":
            return 200, {"status": "ok"}
        scheme, _, token = auth.partition(" ")
        caller = self.tokens.get(token) if scheme == "Bearer" else None
        if caller is None:
            return 401, {"detail": "no or unknown token"}
        parts = path.strip("/").split("/")
        if parts[:2] == ["pool", "runs"]:
            run = parts[2]
            if caller != run:
                return 403, {"detail": f"this token is run {caller}'s, not {run}'s"}
            return self.run_request(method, run, parts[3:], body)
        if path == "/live_adapters":
            live = sorted(self.live.get(caller, set()))
            return 200, {"run_id": caller, "newest": max(live, default=None), "versions": live}
        if path == "/tokenize":
            return 200, {"tokens": [1, 2, 3]}
        if path == "/v1/completions":
            req = json.loads(body)
            own = {Version(v).lora_name(caller) for v in self.live.get(caller, set())}
            if req["model"] != BASE and req["model"] not in own:
                return 403, {"detail": f"run {caller} may not use {req['model']}"}
            choice = {"text": "2", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}
            self.generated_with.append(req["model"])
            return 200, {"model": req["model"], "choices": [{**choice, "index": i} for i in range(req["n"])]}
        return 404, {"detail": f"no route {path}"}

    def run_request(self, method: str, run: str, rest: list[str], body: bytes) -> tuple[int, Any]:
        if not rest and method == "POST":
            if self.refuse is not None:
                return self.refuse[0], {"detail": self.refuse[1]}
            req = json.loads(body)
            if req["base_model"] != BASE:
                return 409, {"detail": f"run {run} uses {req['base_model']}; this pool serves {BASE}"}
            status = 200 if run in self.admitted else 201
            self.admitted.add(run)
            return status, {"run": {"run_id": run, **req}, "lease_s": self.lease_s}
        if not rest and method == "DELETE":
            self.admitted.discard(run)
            self.live.pop(run, None)
            return 200, {}
        if run not in self.admitted:
            return 404, {"detail": f"run {run} is not attached"}
        if rest == ["lease"] and method == "PUT":
            return 200, {"lease_until": time.time() + self.lease_s}
        if len(rest) == 3 and rest[0] == "adapters" and method == "PUT":
            version, name = int(rest[1][1:]), rest[2]
            if name not in ADAPTER_FILES:
                return 400, {"detail": f"{name} is not an adapter file"}
            if (run, version) in self.committed:
                held = self.files[(run, version)].get(name)
                return (200, {}) if held == body else (409, {"detail": f"v{version} is committed with other bytes"})
            self.files.setdefault((run, version), {})[name] = body
            return 200, {}
        if len(rest) == 3 and rest[0] == "adapters" and rest[2] == "commit" and method == "POST":
            version, marker = int(rest[1][1:]), json.loads(body)
            held = self.files.get((run, version), {})
            for name, info in marker["files"].items():
                if name not in held or hashlib.sha256(held[name]).hexdigest() != info["sha256"]:
                    return 422, {"detail": f"{name} missing or not as in the marker"}
            self.committed[(run, version)] = marker
            self.live.setdefault(run, set()).add(version)
            answer = {"lora_name": Version(version).lora_name(run), "version": version, "seconds": 0.01}
            return 200, {**answer, "replicas": 2, "replica_ids": ["r0", "r1"]}
        return 404, {"detail": "no route"}

    def seen(self, method: str, prefix: str = "") -> list[tuple[str, str, str, int]]:
        with self.lock:
            return [r for r in self.requests if r[0] == method and r[1].startswith(prefix)]


def commit_versions(store: Store, *seeds: int) -> dict[int, dict[str, bytes]]:
    """Commit one version per seed as the trainer does (claim, files, COMMITTED, LATEST); its files, by version."""
    out = {}
    for seed in seeds:
        files = {"adapter_model.safetensors": bytes([seed]) * 64, "adapter_config.json": b'{"r": 1, "s": %d}' % seed}
        version = adapters.claim_version(store, owner="test-trainer")
        adapters.publish(store, version, files)
        out[int(version)] = files
    return out


@pytest.fixture
def run_bucket(tmp_path):
    store = Store(str(tmp_path / "run-bucket"))
    store.check_reachable(create=True)
    return store, init_or_check(store, RunSpec(num_generations=2), "test")


@pytest.fixture
def pool(run_bucket):
    fake = FakePool(run_bucket[1].run_id)
    yield fake
    fake.close()


def worker_argv(store: Store, pool: FakePool, *flags: str) -> list[str]:
    common = ["--bucket", store.url, "--bucket.manifest-wait-s", "5", "--run.num-generations", "2"]
    rollout = {"pool-url": pool.url, "max-inflight-groups": "1", "eval-size": "0", "metrics": "false"}
    rollout |= {"poll-s": "0.05", "max-unconsumed-groups": "0", "worker-id": "w-pool"}
    return [*common, *(a for k, v in rollout.items() for a in (f"--rollout.{k}", v)), *flags]


def test_worker_attaches_pushes_committed_versions_in_order_generates_with_its_token_and_detaches(
    run_bucket, pool, monkeypatch
):
    store, manifest = run_bucket
    files = commit_versions(store, 1, 2)
    for v, marker in ((v, adapters.commit_marker(store, Version(v))) for v in files):  # what the trainer records
        events.EventLog(store, "trainer", writer="trainer").emit(
            events.PUBLISHED,
            version=v,
            step=v,
            lora_name=manifest.lora_name(Version(v)),
            committed_at=marker["committed_at"],
        )
    monkeypatch.setenv("BRIGADE_POOL_TOKEN", TOKEN)

    def trainer_done_once_both_are_live_and_used() -> None:
        # the trainer ends once the worker generated with v2 and renewed its lease at least twice (on a loaded
        # CPU the worker can take a while to switch: wait for it, not for a fixed time)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            used = manifest.lora_name(Version(2)) in pool.generated_with
            renewed = pool.seen("PUT", f"/pool/runs/{manifest.run_id}/lease")
            if pool.live.get(manifest.run_id) == {1, 2} and used and len(renewed) >= 2:
                break
            time.sleep(0.05)
        mark_done(store, TrainerDone(step=2, version=2))

    threading.Thread(target=trainer_done_once_both_are_live_and_used, daemon=True).start()
    assert worker_main(worker_argv(store, pool)) == 0

    run_path = f"/pool/runs/{manifest.run_id}"
    control = [(m, p) for m, p, _, _ in pool.requests if p.startswith(run_path) and not p.endswith("/lease")]
    # attach, then each version's files (in any order) before its commit, oldest version first; detach last
    control = [(m, p.rsplit("/", 1)[0] if m == "PUT" else p) for m, p in control]
    assert control == [
        ("POST", run_path),
        *[("PUT", f"{run_path}/adapters/v000001")] * 2,
        ("POST", f"{run_path}/adapters/v000001/commit"),
        *[("PUT", f"{run_path}/adapters/v000002")] * 2,
        ("POST", f"{run_path}/adapters/v000002/commit"),
        ("DELETE", run_path),
    ]
    attached = {"base_model": BASE, "max_staleness": 4, "weight": 1.0, "worker": "w-pool"}
    assert json.loads(pool.bodies[("POST", run_path)]) == attached
    # the worker names itself on its lease and its detach too: a run's other workers keep it attached
    assert pool.queries[("PUT", f"{run_path}/lease")] == pool.queries[("DELETE", run_path)] == "worker=w-pool"
    for v in (1, 2):  # the bytes and the marker of the run's own bucket
        assert pool.files[(manifest.run_id, v)] == files[v]
        assert pool.committed[(manifest.run_id, v)] == adapters.commit_marker(store, Version(v))
    assert len(pool.seen("PUT", f"{run_path}/lease")) >= 2
    # every request to the pool, generation, tokenising and the live versions included, carries the run's token
    assert {auth for m, p, auth, _ in pool.requests if p != "/health"} == {f"Bearer {TOKEN}"}
    generated = [json.loads(pool.bodies[("POST", "/v1/completions")])["model"]]
    assert generated == [manifest.lora_name(Version(2))] and pool.seen("GET", "/live_adapters")
    assert all(status == 200 for _, p, _, status in pool.seen("POST", "/v1/completions"))
    # the run's own bucket says when each version went live in the pool, and its summary shows the sync latency
    loaded = {e["version"]: e for e in events.read_all(store) if e["kind"] == events.LOADED_ALL}
    assert sorted(loaded) == [1, 2] and all(e["pool"] and e["commit_to_live_s"] >= 0 for e in loaded.values())
    summary = summarize(store)
    assert [v["commit_to_all_loaded_s"] is not None for v in summary["versions"]] == [True, True]
    assert [v["replicas_loaded"] for v in summary["versions"]] == [["r0", "r1"], ["r0", "r1"]]
    assert summary["sync_p50_s"] is not None


def test_sigterm_detaches_the_run(run_bucket, pool):
    store, manifest = run_bucket
    commit_versions(store, 1)
    argv = [sys.executable, "-m", "rollout_worker", *worker_argv(store, pool)]
    env = {**os.environ, "BRIGADE_POOL_TOKEN": TOKEN}
    worker = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not [r for r in pool.seen("POST", "/v1/completions") if r[3] == 200]:
            assert worker.poll() is None and time.monotonic() < deadline, worker.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        assert manifest.run_id in pool.admitted
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert pool.seen("DELETE", f"/pool/runs/{manifest.run_id}") and manifest.run_id not in pool.admitted


def test_a_refused_attach_exits_at_once_with_the_pools_message(run_bucket, pool, monkeypatch, capsys):
    store, manifest = run_bucket
    pool.refuse = (409, "3 runs hold 12 of 16 adapter slots; this run needs 6")
    monkeypatch.setenv("BRIGADE_POOL_TOKEN", TOKEN)
    assert worker_main(worker_argv(store, pool)) == 2
    err = capsys.readouterr().err
    assert "3 runs hold 12 of 16 adapter slots; this run needs 6" in err and "Nothing was retried" in err
    assert len(pool.seen("POST", "/pool/runs/")) == 1  # no retry loop on a refusal
    assert not pool.seen("POST", "/v1/") and not pool.seen("DELETE")


def test_another_runs_token_is_refused_with_what_to_do(run_bucket, pool, monkeypatch, capsys):
    store, manifest = run_bucket
    monkeypatch.setenv("MY_POOL_TOKEN", "other-run-token")
    assert worker_main(worker_argv(store, pool, "--rollout.pool-token-env", "MY_POOL_TOKEN")) == 2
    err = capsys.readouterr().err
    assert "HTTP 403" in err and f"not run {manifest.run_id}'s" in err and "MY_POOL_TOKEN" in err
    assert "other-run-token" not in err  # the token itself is never printed


def test_a_missing_token_fails_before_anything_starts(run_bucket, pool, monkeypatch, capsys):
    store, _ = run_bucket
    monkeypatch.delenv("BRIGADE_POOL_TOKEN", raising=False)
    assert worker_main(worker_argv(store, pool)) == 2
    err = capsys.readouterr().err
    assert "BRIGADE_POOL_TOKEN" in err and "brigade pool token" in err and pool.url in err
    assert pool.requests == []


def session(store: Store, manifest, pool: FakePool, **kw: Any) -> PoolSession:
    return PoolSession(pool.url, TOKEN, "BRIGADE_POOL_TOKEN", manifest, store, poll_s=0.05, **kw)


def test_a_claimed_but_uncommitted_version_is_never_pushed(run_bucket, pool):
    store, manifest = run_bucket
    adapters.claim(store, Version(1), owner="a trainer that died mid-upload")
    store.put_bytes(f"{adapters.version_key(Version(1))}/adapter_model.safetensors", b"half")
    adapters.publish(store, Version(2), {"adapter_model.safetensors": b"w2", "adapter_config.json": b"{}"})

    async def body() -> list[Version]:
        s = session(store, manifest, pool)
        await s.attach()
        pushed = await Publisher(s, events.EventLog(store, "rollout")).step()
        await s.client.aclose()
        return pushed

    assert asyncio.run(body()) == [2]
    assert not pool.seen("PUT", f"/pool/runs/{manifest.run_id}/adapters/v000001")
    assert sorted(pool.live[manifest.run_id]) == [2]


def test_a_restart_attaches_again_and_pushes_only_what_the_pool_lacks(run_bucket, pool):
    store, manifest = run_bucket
    files = commit_versions(store, 1, 2, 3)
    run = manifest.run_id
    pool.admitted.add(run)  # the worker before the restart attached and pushed v1 and v2
    for v in (1, 2):
        pool.files[(run, v)] = files[v]
        pool.committed[(run, v)] = adapters.commit_marker(store, Version(v))
    pool.live[run] = {1, 2}

    async def body() -> list[Version]:
        s = session(store, manifest, pool)
        await s.attach()
        pushed = await Publisher(s, events.EventLog(store, "rollout")).step()
        await s.client.aclose()
        return pushed

    assert asyncio.run(body()) == [3]
    assert [r[3] for r in pool.seen("POST", f"/pool/runs/{run}")][0] == 200  # admitted already: re-attached
    assert {r[1].split("/")[5] for r in pool.seen("PUT", f"/pool/runs/{run}/adapters/")} == {"v000003"}


def test_a_worker_far_behind_pushes_only_the_newest_version(run_bucket, pool):
    store, manifest = run_bucket  # max_staleness 4: v1..v6 committed, none live: v1 would be dropped anyway
    commit_versions(store, 1, 2, 3, 4, 5, 6)

    async def body() -> list[Version]:
        s = session(store, manifest, pool)
        await s.attach()
        pushed = await Publisher(s, events.EventLog(store, "rollout")).step()
        await s.client.aclose()
        return pushed

    assert asyncio.run(body()) == [6]


def test_a_version_the_pool_holds_with_other_bytes_is_a_hard_error_not_a_loop(run_bucket, pool):
    store, manifest = run_bucket
    commit_versions(store, 1)
    run = manifest.run_id
    pool.files[(run, 1)] = {"adapter_model.safetensors": b"other weights", "adapter_config.json": b"{}"}
    pool.committed[(run, 1)] = {"version": 1}

    async def body() -> None:
        s = session(store, manifest, pool)
        await s.attach()
        try:
            await asyncio.wait_for(Publisher(s, events.EventLog(store, "rollout")).run(), 10)
        finally:
            await s.client.aclose()

    with pytest.raises(PoolRefused, match="other bytes") as refused:
        asyncio.run(body())
    assert "new bucket" in str(refused.value)
    assert len(pool.seen("PUT", f"/pool/runs/{run}/adapters/")) == 1 and not pool.seen("POST", f"/pool/runs/{run}/a")


def test_a_lapsed_lease_attaches_again(run_bucket, pool):
    store, manifest = run_bucket

    async def body() -> None:
        s = session(store, manifest, pool)
        await s.attach()
        pool.admitted.clear()  # the pool let the lease lapse
        lease = asyncio.create_task(s.keep_lease())
        await asyncio.sleep(0.5)  # lease_s 0.3: a renewal every 0.1 s
        lease.cancel()
        await s.client.aclose()

    asyncio.run(body())
    attaches = [r[3] for r in pool.seen("POST", f"/pool/runs/{manifest.run_id}")]
    assert attaches[:2] == [201, 201] and manifest.run_id in pool.admitted
    assert 404 in [r[3] for r in pool.seen("PUT", f"/pool/runs/{manifest.run_id}/lease")]


def test_an_unreachable_pool_is_retried_for_a_bounded_time(run_bucket):
    store, manifest = run_bucket

    async def body() -> None:
        s = PoolSession(f"http://127.0.0.1:{free_port()}", TOKEN, "T", manifest, store, attach_retry_s=1.0)
        try:
            await s.attach()
        finally:
            await s.client.aclose()

    t0 = time.monotonic()
    with pytest.raises(PoolUnavailable, match="did not admit run"):
        asyncio.run(body())
    assert time.monotonic() - t0 < 5
