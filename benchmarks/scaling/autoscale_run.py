"""The run of benchmarks/scaling/autoscale.py: its settings, its processes (the real proxy and rollout worker), the
simulated replicas and trainer in this process, from the first replica to the last one stopped."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.proxy.overhead import free_port
from benchmarks.scaling.autoscale_fleet import Actuator, Fleet
from benchmarks.scaling.autoscale_trainer import Phase, SimTrainer
from benchmarks.scaling.sync_simulated import _prctl
from bucket.manifest import RunSpec, init_or_check
from bucket.rollouts import read_shards
from bucket.store import Store
from jobkit.processes import stop_process

WORKER = "bench-worker"


@dataclass(frozen=True)
class Settings:
    startup_s: float
    phases_s: tuple[float, float, float]
    tokens_per_s: float
    fast_demand: float  # replicas' worth of generation the fast phase's trainer consumes
    groups_per_step: int
    completion_tokens: int
    min_replicas: int
    max_replicas: int
    scale_interval_s: float
    scale_window_s: float
    scale_cooldown_s: float
    sync_every: int
    max_inflight_groups: int
    max_unconsumed_groups: int
    generation_shape: str
    max_num_seqs: int
    num_generations: int = RunSpec().num_generations

    @property
    def groups_per_replica_s(self) -> float:
        return self.tokens_per_s / (self.num_generations * self.completion_tokens)

    def phases(self) -> list[Phase]:
        fast = self.groups_per_step / (self.fast_demand * self.groups_per_replica_s)
        return [Phase(self.phases_s[0], fast), Phase(self.phases_s[1], 3 * fast), Phase(self.phases_s[2], fast)]


def _spawn(argv: list[str], log_path: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "BRIGADE_REPLICA_API_KEY"}  # the replicas ask none
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: _prctl(1, signal.SIGKILL))  # fmt: skip


def _wait_or_stop(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(proc)


async def _serving(url: str) -> int:
    """brigade_proxy_replicas from the proxy's /metrics (-1 when it does not answer yet)."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return -1
    m = re.search(r"^brigade_proxy_replicas (\S+)$", text, re.M)
    return int(float(m[1])) if m else -1


class Bench:
    def __init__(self, s: Settings, tmp: str) -> None:
        self.s, self.tmp = s, tmp
        self.store = Store(os.path.join(tmp, "bucket"))
        self.store.check_reachable(create=True)
        self.manifest = init_or_check(self.store, RunSpec(), "bench")
        self.fleet = Fleet(self.store, self.manifest.base_model, s.tokens_per_s, s.startup_s, s.max_num_seqs)
        self.trainer = SimTrainer(self.store, s.phases(), s.groups_per_step, s.sync_every)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proxy: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.actuator: Actuator | None = None

    def _proxy_argv(self) -> list[str]:
        s = self.s
        flags = {"port": self.port, "min-replicas": s.min_replicas, "max-replicas": s.max_replicas,
                 "scale-interval-s": s.scale_interval_s, "scale-window-s": s.scale_window_s,
                 "scale-cooldown-s": s.scale_cooldown_s}  # fmt: skip
        return [sys.executable, "-m", "proxy", "--bucket", self.store.url] + [
            x for k, v in flags.items() for x in (f"--proxy.{k}", str(v))
        ]

    def _worker_argv(self) -> list[str]:
        s = self.s
        flags = {"proxy-url": self.url, "worker-id": WORKER, "eval-size": 0, "curriculum": "false",
                 "max-inflight-groups": s.max_inflight_groups, "max-unconsumed-groups": s.max_unconsumed_groups,
                 "max-completion-length": s.completion_tokens, "generation-shape": s.generation_shape,
                 "metrics-port": free_port()}  # fmt: skip
        return [sys.executable, "-m", "rollout_worker", "--bucket", self.store.url] + [
            x for k, v in flags.items() for x in (f"--rollout.{k}", str(v))
        ]

    async def run(self) -> float:
        """The whole run; returns when the trainer stopped (its wall clock)."""
        for _ in range(self.s.min_replicas):
            self.fleet.start(delay=False)
        self.proxy = _spawn(self._proxy_argv(), os.path.join(self.tmp, "proxy.log"))
        await self._until(lambda: _serving(self.url), self.s.min_replicas, 120, "the proxy to admit the replicas")
        self.worker = _spawn(self._worker_argv(), os.path.join(self.tmp, "rollout.log"))
        # The trainer starts once the worker wrote a first shard: the run's clock measures scaling, not imports.
        await self._until(self._written_groups, 1, 120, "the rollout worker's first shard")
        self.trainer.begin()
        self.actuator = Actuator(self.store, self.fleet, self.s.min_replicas, self.s.max_replicas,
                                 since=self.trainer.t0 - 60)  # fmt: skip
        actuating = asyncio.create_task(self.actuator.run())
        try:
            while self.trainer.is_alive():
                for proc, name in ((self.proxy, "proxy"), (self.worker, "rollout worker")):
                    if proc.poll() is not None:
                        raise RuntimeError(f"the {name} exited with {proc.returncode}; see {self.tmp}")
                await asyncio.sleep(0.5)
        finally:
            actuating.cancel()
            await asyncio.gather(actuating, return_exceptions=True)
            self.trainer.halt.set()
        if self.trainer.error is not None:
            raise RuntimeError(f"the simulated trainer failed: {self.trainer.error!r}")
        return time.time()

    async def _written_groups(self) -> int:
        return len(await asyncio.to_thread(read_shards, self.store, {}))

    async def _until(self, probe: Any, at_least: int, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while await probe() < at_least:
            if time.monotonic() > deadline or any(
                p is not None and p.poll() is not None for p in (self.proxy, self.worker)
            ):
                raise RuntimeError(f"no sign of {what} within {timeout_s:.0f}s; see {self.tmp}")
            await asyncio.sleep(0.5)

    async def finish(self) -> None:
        """The worker (on the trainer's done marker), then the proxy, then the replicas."""
        self.trainer.halt.set()
        await self.worker_done()
        await asyncio.to_thread(stop_process, self.proxy)
        await self.fleet.close()

    async def worker_done(self) -> None:
        """The worker stops on the trainer's done marker, once it wrote what it scored (stopped after 60 s)."""
        if self.worker is not None:
            await asyncio.to_thread(_wait_or_stop, self.worker, 60)
