"""What the proxy's parts (membership, fan-out, forwarding) share, in one place instead of hidden attributes."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from bucket.manifest import RunManifest
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from proxy.adapter_locks import AdapterLocks
from proxy.config import ProxyConfig
from proxy.lora_paths import AdapterRef
from proxy.metrics import ProxyMetrics
from proxy.routing.router import PrefixRouter


@dataclass
class ProxyState:
    """The replica set, the adapters loaded on all of it, and the pause state.

    Invariant: every adapter in `loaded` is loaded on every replica in
    `routable`. Loads, unloads and joins change one or the other, so they hold
    `adapter_locks` (a load or unload its run's lock, a join all of them:
    adapter_locks.py).
    """

    config: ProxyConfig
    store: Store
    manifest: RunManifest | None
    router: PrefixRouter
    metrics: ProxyMetrics
    routable: dict[str, ReplicaInfo] = field(default_factory=dict)
    loaded: dict[str, AdapterRef] = field(default_factory=dict)  # lora_name -> version: on every routable replica
    # replica -> when it last answered a generation (the passive health signal: a replica that answers is alive,
    # however slow its /health is while it is busy)
    answered_at: dict[str, float] = field(default_factory=dict)
    # replica -> smoothed seconds from sending a generation to its answer: a replica whose requests take long
    # (long completions, a full batch) answers rarely, and is busy, not dead, between two answers
    answer_s: dict[str, float] = field(default_factory=dict)
    # model name -> requests through the proxy naming it, queued or running; and when the last one ended. The
    # lifecycle unloads a version only once nothing has used it for a while (adapters/lifecycle.py).
    using: dict[str, int] = field(default_factory=dict)
    used_at: dict[str, float] = field(default_factory=dict)
    episode_at: dict[str, float] = field(default_factory=dict)  # model -> when an episode's turn last ended
    paused_query: str | None = None  # set while paused, so joiners are paused too
    adapter_locks: AdapterLocks = field(default_factory=AdapterLocks)
    # Set while generations may be dispatched; cleared by /pause (the proxy pauses itself, whether or not the
    # replicas run in vLLM's dev mode), set again by /resume, a failed load, or the pause lease running out.
    dispatching: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.dispatching.set()

    def answered(self, replica_id: str, sent_at: float) -> None:
        now = time.monotonic()
        self.answered_at[replica_id] = now
        prev = self.answer_s.get(replica_id)
        self.answer_s[replica_id] = now - sent_at if prev is None else 0.8 * prev + 0.2 * (now - sent_at)

    def hold(self, model: str, session: str | None = None) -> None:
        """A request naming `model` entered the proxy (it counts until `drop`, waiting included)."""
        self.using[model] = self.using.get(model, 0) + 1

    def drop(self, model: str, session: str | None = None) -> None:
        """It ended. A turn of an episode (`session`) keeps its model in use for `session_idle_s` more: the
        episode's next turn, after the environment's step, generates with the same version."""
        left = self.using.get(model, 0) - 1
        if left > 0:
            self.using[model] = left
        else:
            self.using.pop(model, None)
        now = time.monotonic()
        self.used_at[model] = now
        if session is not None:
            self.episode_at[model] = now

    def idle_for(self, model: str) -> float:
        """Seconds since a request last named `model` (0 while one does, or while an episode's turn named it
        less than session_idle_s ago; infinite if none ever did)."""
        if self.using.get(model):
            return 0.0
        now = time.monotonic()
        if now - self.episode_at.get(model, -math.inf) < self.config.session_idle_s:
            return 0.0
        return now - self.used_at.get(model, -math.inf)
