"""Proxy settings (the `[proxy]` table). Imports neither torch nor vLLM."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ProxyConfig(BaseModel):
    model_config = {"extra": "forbid"}

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8100, ge=1, le=65535, description="Port to listen on.")
    replica_urls: list[str] = Field(
        default_factory=list, description="Static replica URLs; empty = learn them from the bucket's replica registry."
    )
    block_size: int = Field(16, ge=1, description="Tokens per routing block (hash chain granularity).")
    spill_threshold: int = Field(
        8,
        ge=1,
        description="Send to the least-loaded replica when the preferred one has this many more requests in flight.",
    )
    max_inflight: int = Field(384, ge=1, description="Requests in flight across all replicas; more wait.")
    load_retry_s: float = Field(
        60.0, ge=0, description="How long to retry 'No adapter found' on a replica (a mount or mirror catching up)."
    )
    replica_timeout_s: float = Field(
        15.0, gt=0, description="A registered replica whose heartbeat has not changed for this long is dropped."
    )
    refresh_s: float = Field(1.0, gt=0, description="How often to re-read the replica registry.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of a forwarded request.")
    adapter_root: str = Field(
        "",
        description="With static replica_urls: where the replicas find adapter version folders "
        "on their disks; empty = the bucket's adapters/ folder (bucket must be local). "
        "Registered replicas announce their own.",
    )
    max_routing_blocks: int = Field(
        1_000_000, ge=1, description="Prompt blocks the router remembers (least recently used are forgotten first)."
    )
    api_key_env: str = Field(
        "BRIGADE_REPLICA_API_KEY",
        description="Environment variable holding a bearer token for the replicas (never logged).",
    )
