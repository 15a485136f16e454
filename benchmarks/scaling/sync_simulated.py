"""Adapter sync with many replicas: the real proxy in front of N simulated vLLM servers, saturated.

    python -m benchmarks.scaling.sync_latency --simulated-replicas 2,16,64 --json [--versions 20] [--max-num-seqs 8]

What grows with the replica count is the proxy's part of a sync, not vLLM's, so N replicas are simulated in
this process (one asyncio loop, a loopback port each, registered and heartbeating like a `brigade replica`):
vLLM 0.32 with `--scheduling-policy priority`, i.e. max_num_seqs + control_seqs running sequences, the rest
waiting by (priority, arrival), never preempted; T tokens hold a sequence T x step_s; a LoRA load takes 40 ms;
each canary probe prompt takes one step and gets the version's canary logprobs (from its commit marker), so the
probe passes. The real proxy (`python -m proxy`, a fresh bucket folder per count) loads each committed version
by itself while a load generator keeps 2 x max_num_seqs requests per replica in flight through it with the
newest live version. Per count: p50_s/p95_s (committed -> loaded on every replica: the fan-out's end, as its
adapter_loaded_all event records it; event_written_p95_s: to that event's write), where it goes (detect, fanout
with its slowest replica's load and probe, events written after the fan-out, live = seen in /live_adapters),
the proxy's CPU per version (/proc/<pid>/stat; `sync`: less the forwarding's CPU per request measured just
before), false ejections, request rate, and this process's loop lag (a lagging bench would answer late). The
measurement itself, and who else had the cores meanwhile, is benchmarks/scaling/sync_simulated_run.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from typing import Any

import httptools
import httpx
import orjson

from benchmarks.proxy.overhead import free_port
from bucket import adapters, appendlog, events, layout, replicas
from bucket.canary import Canary, canary_meta, read_canary
from bucket.manifest import RunSpec, init_or_check
from bucket.replicas import ReplicaInfo
from bucket.store import Store

CONTROL_SEQS = 16  # = the replicas' default control_seqs: a probe's prompts run at once beside full generation
LOAD_S = 0.04  # vLLM's answer to /v1/load_lora_adapter for a rank-1 adapter already on disk
GAP_S = 1.0  # between a version's adapter_loaded_all and the next commit: the load moves to the new one
TEMPLATE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2683, 359, 1978, 314, 2, 198, 1, 4093, 198, 57]
_HEAD = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
_canaries: dict[str, Canary | None] = {}  # lora_path -> canary: every simulated replica reads the same marker


def synthetic_canary(seed: int) -> Canary:
    """A canary like the trainer's (52 tokens), ~0.05/token from the base: the probe decides it in one pass."""
    rng = random.Random(seed)
    base = [-rng.uniform(0.05, 4.0) for _ in range(52)]
    adapter = [min(-1e-3, b + rng.gauss(0, 0.06)) for b in base]
    ids = [rng.randrange(300, 40000) for _ in range(24 + 52)]
    return Canary(prompt_ids=ids[:24], completion_ids=ids[24:], adapter_logprobs=adapter, base_logprobs=base)


def simulated_adapter_files() -> dict[str, bytes]:
    """A version's files: a real (tiny, finite) safetensors file, since the proxy reads the weights before any
    load (proxy/adapters/weights_check.py); the simulated replicas never look inside it."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    weights = struct.pack("<Q", len(header)) + header + struct.pack("<f", 0.5)
    return {"adapter_model.safetensors": weights, "adapter_config.json": json.dumps({"r": 1}).encode()}


def _error(status: int, message: str) -> tuple[int, bytes]:
    return status, orjson.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}})


class SimReplica:
    """One simulated vLLM server: its sequences, its waiting queue, its LoRAs."""

    def __init__(self, rid: str, base_model: str, max_num_seqs: int, step_s: float) -> None:
        self.rid, self.base_model, self.step_s = rid, base_model, step_s
        self.free = max_num_seqs + CONTROL_SEQS  # vLLM's --max-num-seqs as `brigade replica` starts it
        self.waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self.order = itertools.count()
        self.loras: dict[str, str] = {}  # name -> lora_path
        self.bad_requests: list[str] = []

    async def run_sequence(self, priority: int, seconds: float) -> None:
        """Hold one sequence for `seconds`: at once if free, else in (priority, arrival) order (never preempting)."""
        if self.free > 0 and not self.waiting:
            self.free -= 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self.waiting, (priority, next(self.order), future))
            await future  # handed over by the sequence that ended: `free` does not change
        try:
            await asyncio.sleep(seconds)
        finally:
            self._release()

    async def run_sequences(self, n: int, priority: int, seconds: float) -> None:
        """One request's `n` prompts, each a sequence of `seconds`. When all n get a slot at once (a generation
        with a free slot; a probe in the control slots) they start and end together: one timer for them all,
        rather than a task per prompt, so the simulated replicas' own CPU (they share the proxy's cores) does
        not grow with the probe's prompts. Otherwise each waits for its own slot, as `run_sequence` says."""
        if n > self.free or self.waiting:
            await asyncio.gather(*(self.run_sequence(priority, seconds) for _ in range(n)))
            return
        self.free -= n
        try:
            await asyncio.sleep(seconds)
        finally:
            for _ in range(n):
                self._release()

    def _release(self) -> None:
        """A sequence ended: its slot goes to the first waiting one by (priority, arrival), else it is free."""
        while self.waiting:
            _, _, nxt = heapq.heappop(self.waiting)
            if not nxt.done():
                nxt.set_result(None)
                return
        self.free += 1

    async def handle(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        if path == b"/health":
            return 200, b""
        if path == b"/v1/models":
            cards = [{"id": self.base_model, "object": "model", "root": self.base_model, "parent": None}]
            cards += [{"id": n, "object": "model", "root": p, "parent": self.base_model} for n, p in self.loras.items()]
            return 200, orjson.dumps({"object": "list", "data": cards})
        req = orjson.loads(body) if body else {}
        if path == b"/v1/completions":
            return await self.complete(req)
        name = req.get("lora_name")
        if path == b"/v1/load_lora_adapter":
            if name in self.loras:  # vLLM's words, which the proxy counts as success (proxy/lora_paths.py)
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            await asyncio.sleep(LOAD_S)
            lora_path = req["lora_path"]
            if lora_path not in _canaries:
                try:
                    with open(os.path.join(lora_path, layout.COMMIT_MARKER), "rb") as f:
                        _canaries[lora_path] = read_canary(orjson.loads(f.read()))
                except FileNotFoundError:
                    return _error(404, f"Loading lora {name} failed: No adapter found for {lora_path}")
            self.loras[name] = lora_path
            return 200, orjson.dumps(f"Success: LoRA adapter '{name}' added successfully.")
        if path == b"/v1/unload_lora_adapter":
            if self.loras.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.")
            return 200, orjson.dumps(f"Success: LoRA adapter '{name}' removed successfully.")
        return _error(404, "Not Found")

    async def complete(self, req: dict[str, Any]) -> tuple[int, bytes]:
        model, prompts, tokens = req.get("model"), req["prompt"], int(req.get("max_tokens", 16))
        if model != self.base_model and model not in self.loras:
            return _error(404, f"The model `{model}` does not exist.")
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        # Each prompt is a sequence of its own; the probe's (max_tokens 1) take one step each.
        await self.run_sequences(len(prompts), int(req.get("priority", 0)), tokens * self.step_s)
        canary, choices = _canaries.get(self.loras.get(model, "")), []
        for i, p in enumerate(prompts):
            logprobs = None
            if "logprobs" in req:  # the probe: the logprob of the canary's own next token after this prompt
                top, j = {}, len(p) - len(canary.prompt_ids) if canary else -1
                if canary and 0 <= j < len(canary.completion_ids):
                    top[f"token_id:{canary.completion_ids[j]}"] = canary.adapter_logprobs[j]
                logprobs = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": [top], "text_offset": [0]}
            choices.append({"index": i, "text": "x" * tokens, "logprobs": logprobs, "finish_reason": "length"})
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": tokens * len(prompts)}
        return 200, orjson.dumps({"object": "text_completion", "model": model, "choices": choices, "usage": usage})


class _ServerConn(asyncio.Protocol):
    """HTTP/1.1 keep-alive on raw asyncio + httptools: cheap, as N servers share this process with the load."""

    def __init__(self, sim: SimReplica) -> None:
        self.sim, self.parser = sim, httptools.HttpRequestParser(self)
        self.url, self.body = b"", b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.sim.bad_requests.append(repr(exc))  # reported: a connection closed here is a proxy's ReadError
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:  # the proxy's pools send the next request after this answer
        asyncio.ensure_future(self._answer(self.sim.handle(self.url.split(b"?")[0], self.body)))
        self.url, self.body = b"", b""

    async def _answer(self, work: Any) -> None:
        try:
            status, out = await work
        except Exception as exc:  # noqa: BLE001 - a bug here shows as a 500 in the proxy's log, not a hang
            status, out = _error(500, f"{type(exc).__name__}: {exc}")
        if not self.transport.is_closing():
            self.transport.write(_HEAD % (status, len(out)) + out)


# Called in the proxy's child: SIGKILL when the benchmark dies, however (a timeout, a kill). Looked up here, as
# the child of a fork only calls it. 1 = PR_SET_PDEATHSIG.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


async def _field(client: httpx.AsyncClient, path: str, key: str) -> str:
    """One field of the proxy's JSON answer to a GET; "" when it has none (yet)."""
    try:
        return (await client.get(path)).json().get(key) or ""
    except (httpx.HTTPError, ValueError):
        return ""


class Bench:
    """One replica count: a fresh bucket, N simulated replicas, the real proxy, the load generator."""

    def __init__(
        self, tmp: str, n: int, max_num_seqs: int, tokens: int, step_s: float, proxy_cpus: set[int] | None = None
    ) -> None:
        self.tmp, self.n, self.max_num_seqs, self.tokens, self.step_s = tmp, n, max_num_seqs, tokens, step_s
        self.proxy_cpus = proxy_cpus  # the proxy's own cores (this process keeps off them), or None: anywhere
        self.store = Store(os.path.join(tmp, "bucket"))
        self.store.check_reachable(create=True)
        self.manifest = init_or_check(self.store, RunSpec(), "bench")
        self.sims = [SimReplica(f"sim-{i}", self.manifest.base_model, max_num_seqs, step_s) for i in range(n)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = self.manifest.base_model  # what the load generates with: the newest live version
        self.live_at: dict[str, float] = {}  # lora name -> when /live_adapters first named it the newest
        self.counts = {"ok": 0, "errors": 0}
        self.cursors: dict[str, int] = {}  # the events read so far, per writer (appendlog.read_after)
        self.proc: subprocess.Popen | None = None

    async def start(self, servers: list[Any]) -> None:
        loop, root = asyncio.get_running_loop(), self.store.local_path(layout.ADAPTERS)
        infos = []
        for sim in self.sims:
            server = await loop.create_server(lambda s=sim: _ServerConn(s), "127.0.0.1", 0, backlog=1024)
            servers.append(server)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            infos.append(ReplicaInfo(replica_id=sim.rid, url=url, adapter_root=root, base_model=sim.base_model,
                                     block_size=16, max_loras=8, started_at=time.time(), priority_scheduling=True,
                                     max_num_seqs=self.max_num_seqs, control_seqs=CONTROL_SEQS))  # fmt: skip
        await asyncio.to_thread(lambda: [replicas.register(self.store, i) for i in infos])
        servers.append(asyncio.create_task(self._heartbeat(infos)))
        argv = [sys.executable, "-m", "proxy", "--bucket", self.store.url, "--proxy.port", str(self.port)]
        env = {k: v for k, v in os.environ.items() if k != "BRIGADE_REPLICA_API_KEY"}  # the replicas ask none
        log = open(os.path.join(self.tmp, "proxy.log"), "ab")
        self.proc = subprocess.Popen(argv + ["--proxy.refresh-s", "0.5"], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=self._in_proxy)  # fmt: skip
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while f"{self.n} replicas receive traffic" not in await _field(client, "/health", "reason"):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"the proxy did not admit {self.n} replicas; see {self.tmp}/proxy.log")
                await asyncio.sleep(0.3)

    def _in_proxy(self) -> None:
        """Run in the proxy's child before it starts: die with this process, and keep to the proxy's cores."""
        _prctl(1, signal.SIGKILL)
        if self.proxy_cpus:
            os.sched_setaffinity(0, self.proxy_cpus)

    async def _heartbeat(self, infos: list[ReplicaInfo]) -> None:
        while True:
            await asyncio.sleep(2.0)  # the proxy drops a replica whose beat is still after replica_timeout_s (15 s)
            await asyncio.to_thread(lambda: [replicas.heartbeat(self.store, i) for i in infos])

    async def watch_live(self) -> None:
        """What a rollout worker does: read /live_adapters every 50 ms and generate with the newest."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while True:
                name = await _field(client, "/live_adapters", "lora_name")
                if name and name != self.model:
                    self.model = name
                    self.live_at.setdefault(name, time.time())
                await asyncio.sleep(0.05)

    async def generate(self, k: int) -> None:
        """One of the load's clients: a distinct prompt each time (a group of one), `tokens` long answers. Raw
        asyncio streams: httpx would cost ~1 ms of this process's CPU per request, at ~800 requests/s."""
        width, stream = 2 * self.max_num_seqs * self.n, None
        while True:
            prompt = TEMPLATE + [300 + (k * 7919 + j) % 39000 for j in range(12)]
            body = orjson.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.tokens})
            try:
                stream = stream or await asyncio.open_connection("127.0.0.1", self.port)
                stream[1].write(b"POST /v1/completions HTTP/1.1\r\nhost: b\r\ncontent-length: %d\r\n\r\n" % len(body))
                stream[1].write(body)
                head = await stream[0].readuntil(b"\r\n\r\n")
                await stream[0].readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head)[1]))  # type: ignore[index]
                ok = head.startswith(b"HTTP/1.1 200")
            except (OSError, asyncio.IncompleteReadError, TypeError):  # TypeError: no length (chunked): not ours
                ok, stream = False, None
                await asyncio.sleep(0.1)
            self.counts["ok" if ok else "errors"] += 1
            k += width

    async def publish_and_wait(self, seed: int, timeout_s: float = 120) -> dict[str, Any]:
        """Commit one version; its adapter_loaded_all event (and when it went live) once the proxy wrote it."""
        files = simulated_adapter_files()
        version = await asyncio.to_thread(adapters.claim_version, self.store, "bench")
        meta = canary_meta(synthetic_canary(seed))
        marker = await asyncio.to_thread(adapters.publish, self.store, version, files, meta)
        deadline, name = time.monotonic() + timeout_s, version.lora_name(self.manifest.run_id)
        while True:  # live first (cheap to watch), then the events: the proxy writes them after the load
            if name in self.live_at:
                records = await asyncio.to_thread(appendlog.read_after, self.store, layout.EVENTS, self.cursors)
                for r in records:
                    self.cursors[r.writer] = r.seq
                    if r.body["kind"] == events.LOADED_ALL and r.body.get("version") == version:
                        return {"committed": marker["committed_at"], "loaded_all": r.body, "live": self.live_at[name]}
            if time.monotonic() > deadline:
                raise RuntimeError(f"{version.folder} was not loaded on every replica within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
