"""What the proxy says about itself: /server_info, /health's reason, live metrics and routing snapshots.

Every answer here reads the parts `Proxy` (app.py) wires, and changes none of
them: the routing counters (router, forwarder), who receives traffic and who
is joining, ejected or draining (membership), the pool's runs, the
autoscaler's count. Kept apart from the wiring so that what a dashboard or
TRL reads can grow without crowding the one place that says who calls whom.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bucket import events as ev
from bucket.manifest import RunManifest
from bucket.store import Store
from proxy.config import ProxyConfig
from proxy.event_writer import EventWriter
from proxy.pool.service import Pool
from proxy.replicas.membership import Membership
from proxy.scaling.autoscaler import Autoscaler
from proxy.serving.forwarding import Forwarder
from proxy.serving.passthrough import Passthrough
from proxy.state import ProxyState


class ProxyStatus:
    """The proxy's reports on itself, from its parts (`pool` None: the proxy serves one run)."""

    def __init__(
        self,
        state: ProxyState,
        forwarder: Forwarder,
        passthrough: Passthrough,
        membership: Membership,
        autoscaler: Autoscaler,
        events: EventWriter,
        pool: Pool | None,
    ) -> None:
        self.state = state
        self.forwarder = forwarder
        self.passthrough = passthrough
        self.membership = membership
        self.autoscaler = autoscaler
        self.events = events
        self.pool = pool

    @property
    def config(self) -> ProxyConfig:
        return self.state.config

    @property
    def store(self) -> Store:
        return self.state.store

    @property
    def manifest(self) -> RunManifest | None:
        return self.state.manifest

    def routing(self) -> dict[str, Any]:
        """The routing counters and what is in flight, waiting, retried and ejected now."""
        router = self.state.router
        return {
            "decisions": dict(router.decisions),
            "inflight_requests": router.inflight_all(),
            "inflight_tokens": {r: round(v) for r, v in router.load_all().items()},
            "waiting": self.forwarder.waiting,
            "retries": dict(self.forwarder.retries),
            "ejected": dict(self.membership.ejected),
            "expected_completion_tokens": round(router.completion_tokens, 1),
        }

    def info(self) -> dict[str, Any]:
        """The proxy's part of /server_info (`brigade_proxy`): its run or pool, replicas, adapters and routing."""
        cfg = self.config.model_dump()  # holds the keys' variable names, never the keys
        router, membership = self.state.router, self.membership
        return {
            "run_id": self.manifest.run_id if self.manifest else None,
            "pool": self.pool.status() if self.pool is not None else None,
            "bucket": self.store.url,
            "replicas": [
                {
                    "replica_id": i.replica_id,
                    "url": i.url,
                    "adapter_root": i.adapter_root,
                    "kv_block_size": i.block_size,
                    "inflight": router.inflight(i.replica_id),
                    "draining": i.replica_id in membership.draining,
                }
                for i in self.state.routable.values()
            ],
            "joining": sorted(membership.joining),
            "ejected": dict(membership.ejected),
            "loaded_adapters": {n: a.version.folder for n, a in self.state.loaded.items()},
            "paused": self.state.paused_query is not None,
            "routing": {
                **self.routing(),
                "known_blocks": router.known_blocks(),
                "known_groups": router.known_groups(),
                "shared_prefix_blocks": router.shared_prefix_blocks(),
            },
            "config": cfg,
        }

    async def server_info(self, query: str) -> dict[str, Any]:
        """A replica's own /server_info (vLLM serves it in dev mode only) plus the proxy's state.

        `vllm_config` describes the proxy as one server (what TRL reads): a data-parallel size of 1, since
        adapter loads reach every replica; LoRA limits the smallest of any replica's; synthesized from the run
        and the registry when the replicas do not serve it.
        """
        own = await self.passthrough.replica_server_info(query)
        config = own.get("vllm_config") if isinstance(own.get("vllm_config"), dict) else {}
        max_loras = [i.max_loras for i in self.state.routable.values() if i.max_loras > 0]
        lora = config.get("lora_config") if isinstance(config.get("lora_config"), dict) else {}
        rank = self.manifest.lora_rank if self.manifest else 1
        lora = {"max_lora_rank": rank, **lora, **({"max_loras": min(max_loras)} if max_loras else {})}
        lora.setdefault("max_loras", 1)
        parallel = config.get("parallel_config") if isinstance(config.get("parallel_config"), dict) else {}
        model = config.get("model_config") if isinstance(config.get("model_config"), dict) else {}
        config = {
            **config,
            "lora_config": lora,
            "parallel_config": {**parallel, "data_parallel_size": 1},
            "model_config": {"logprobs_mode": "processed_logprobs", **model},
            "weight_transfer_config": config.get("weight_transfer_config"),
        }
        return {**own, "vllm_config": config, "brigade_proxy": self.info()}

    def health(self) -> tuple[bool, str]:
        """Whether any replica receives traffic, and why not when none does."""
        routable, membership = self.state.routable, self.membership
        if routable:
            return True, f"{len(routable)} replicas receive traffic"
        joining = membership.joining
        if joining:
            return False, f"replicas {sorted(joining)} are joining (loading adapters); none receives traffic yet"
        if membership.ejected:
            return False, f"every replica is ejected: {membership.ejected}"
        source = (
            f"replica_urls {self.config.replica_urls}"
            if membership.static
            else f"the registry {self.store.url}/replicas (heartbeat within {self.config.replica_timeout_s:.0f}s)"
        )
        return False, f"no live replica in {source}"

    def live_metrics(self) -> dict[str, Any]:
        """The hot path's plain counters, read at each scrape (metrics.py turns them into families)."""
        f, m, router = self.forwarder, self.membership, self.state.router
        routable = self.state.routable
        return {
            "decisions": router.decisions,
            "inflight_requests": router.inflight_all(),
            "inflight_tokens": router.load_all(),
            "waiting": f.waiting,
            "retries": f.retries,
            "upstream_errors": f.upstream_errors,
            "retired_requests": f.retired_requests,
            "broken_answers": f.broken_answers,
            "ejections": m.ejections,
            "readmissions": m.readmissions,
            "ejected": len(m.ejected),
            "replicas": len(routable),
            "known": len(routable) + len(m.joining),
            "desired": self.autoscaler.desired,
            "runs": f.fair.snapshot(),  # per-run fair-share accounts (brigade_proxy_run_*{run})
        }

    async def snapshot_forever(self) -> None:
        """A routing snapshot into the bucket every snapshot_s while there is traffic, for dashboards."""
        last: dict[str, int] = {}
        while True:
            await asyncio.sleep(self.config.snapshot_s)
            status = self.routing()
            decisions = status["decisions"]
            delta = {k: v - last.get(k, 0) for k, v in decisions.items()}
            last = dict(decisions)
            if any(delta.values()) or any(status["inflight_requests"].values()):
                await self.events.emit(
                    ev.ROUTING_SNAPSHOT, interval_s=self.config.snapshot_s, decisions_delta=delta, **status
                )
