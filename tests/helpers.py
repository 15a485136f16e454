"""Helpers the tests of several folders share: ports, waits, processes, buckets, adapters, the proxy.

Plain functions, imported as `from tests.helpers import ...`; the fixtures built on them are in
tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from bucket import Store, adapters
from bucket.manifest import RunSpec
from jobkit.cpu import cpu_class
from jobkit.processes import stop_process

if TYPE_CHECKING:
    from proxy.app import Proxy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Machines of this kind come with an AVX-512 CPU or an AVX2-only one about 4x slower for vLLM and the trainer
# (issue 17); ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 make jobkit.cpu report the slow kind here too.
SLOW = 4.0 if cpu_class() == "avx2" else 1.0
# The session's replica sidecars by replica id (tests/conftest.py's vllm_replicas): the drain test stops one.
SESSION_SIDECARS: dict[str, subprocess.Popen] = {}
T = TypeVar("T")


def host_timeout(seconds: float) -> float:
    """A bound on real work (vLLM start-up, generation, training) tuned on the fast CPU, stretched by SLOW.

    For bounds close to what the work takes on the fast CPU; a bound that only catches a hang stays as it is.
    """
    return seconds * SLOW


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process serving {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s}s")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.1) -> T:
    """`condition()`'s first truthy value, looked at every `poll_s`; AssertionError naming `what` after
    `timeout_s` (a bound that catches a hang, not the time the work takes)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(poll_s)
    return value


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    stop_process(proc, timeout_s)


def new_s3_bucket(endpoint: str) -> str:
    """A fresh bucket on the S3 server at `endpoint` (the `s3_endpoint` fixture); returns its run's URL."""
    name = f"brigade-test-{uuid.uuid4().hex[:10]}"
    Store(f"s3://{name}").fs.mkdir(name)
    return f"s3://{name}/run"


# -- real vLLM replicas and real runs ---------------------------------------------------------------


def start_replica(
    bucket_url: str,
    model_dir: str,
    port: int,
    replica_id: str,
    cpu_threads: str,
    log_dir: str,
    *extra: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`brigade replica` as its own process (the code path a deployment uses); returns it and its log path."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"sidecar-{replica_id}.log")
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "replica",
        "--bucket",
        bucket_url,
        "--replica.model-path",
        model_dir,
        "--replica.port",
        str(port),
        "--replica.replica-id",
        replica_id,
        "--replica.cpu-threads",
        cpu_threads,
        "--replica.log-dir",
        log_dir,
        "--replica.heartbeat-s",
        "1",
        "--replica.kv-cache-gib",
        "1",
        *extra,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return proc, log_path


LOCAL_RUN_STEPS, LOCAL_RUN_SYNC, LOCAL_RUN_STALENESS = 6, 2, 2  # the shared `local_run` (tests/conftest.py)


def brigade_local(bucket: str, model_dir: str, *flags: str) -> list[str]:
    """The command line of `brigade local` on `bucket`, every job on the test model, then `flags`."""
    head = [sys.executable, "-m", "infra.cli", "local", "--bucket", str(bucket)]
    return [*head, "--trainer.model-path", model_dir, "--replica.model-path", model_dir, *flags]


def run_local_on_free_ports(bucket: str, model_dir: str, *flags: str, wall_s: float) -> subprocess.CompletedProcess:
    """`brigade local` on `bucket` with one replica, every port it listens on free (its proxy's, its replicas',
    its jobs' /metrics), cut at `wall_s` (scaled for this host), then `flags`; asserts it exited 0."""
    from infra.s3server import listen_ports

    proxy_port = free_port()
    cmd = brigade_local(
        bucket,
        model_dir,
        *("--local.num-replicas", "1", "--proxy.port", str(proxy_port)),
        *("--rollout.proxy-url", f"http://127.0.0.1:{proxy_port}", "--local.base-port", str(listen_ports(2))),
        *("--trainer.metrics-port", str(free_port()), "--rollout.metrics-port", str(free_port())),
        *("--local.max-wall-s", str(host_timeout(wall_s))),
        *flags,
    )
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=host_timeout(wall_s + 300))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def make_adapter_files(model_dir: str, out_dir: str, seed: int = 0) -> dict[str, bytes]:
    """A real rank-1 peft adapter on the model, with B non-zero so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.families import peft_targets

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    spec = RunSpec()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=spec.lora_rank,
            lora_alpha=spec.lora_alpha,
            target_modules=peft_targets(spec.lora_target_modules),
            lora_dropout=0.0,
        ),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out_dir)
    return {name: open(os.path.join(out_dir, name), "rb").read() for name in adapters.ADAPTER_FILES}


@asynccontextmanager
async def proxied(
    store: Store, manifest: Any, watch_adapters: bool = False
) -> AsyncIterator[tuple[Proxy, httpx.AsyncClient]]:
    """A proxy in this process in front of the two replicas of `vllm_replicas`, once both have joined;
    yields (the Proxy, a client of its app). Its own adapter lifecycle is off unless `watch_adapters`: the
    tests load and unload by hand, and the session's bucket holds versions other tests published."""
    from proxy.app import Proxy
    from proxy.config import ProxyConfig
    from tests.proxy.seams import asgi_app

    proxy = Proxy(ProxyConfig(refresh_s=0.5, load_retry_s=30, watch_adapters=watch_adapters), store, manifest)
    app = asgi_app(proxy)  # generations over the pooled sockets to the real replicas, reached through ASGI
    async with app.router.lifespan_context(app):
        for _ in range(60):  # both registered replicas join (they heartbeat every second)
            if len(proxy.routable) == 2:
                break
            await asyncio.sleep(0.5)
        assert len(proxy.routable) == 2, proxy.health()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=300
        ) as client:
            yield proxy, client
