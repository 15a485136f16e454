"""`brigade proxy`: check the run, then serve the proxy with uvicorn."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from bucket import layout
from bucket.manifest import RunSpec, wait_and_check
from bucket.settings import BucketConfig, ConfigError, open_bucket
from proxy.app import Proxy, create_app
from proxy.config import ProxyConfig

log = logging.getLogger("brigade.proxy")


def build_app(settings: ProxyConfig, spec: RunSpec, bucket: BucketConfig) -> FastAPI:
    """The proxy's ASGI app for a run config (opens the bucket and checks run.json; starts nothing)."""
    store = open_bucket(bucket)
    manifest = wait_and_check(store, spec, "proxy", bucket.manifest_wait_s)
    pc = settings
    adapter_root = pc.adapter_root or store.local_path(layout.ADAPTERS)
    if pc.replica_urls and not adapter_root:
        raise ConfigError(
            f"static --proxy.replica-urls with the bucket {store.url}, which is not a local folder: tell the proxy "
            "where the replicas find adapter versions (--proxy.adapter-root), or let the replicas register in the "
            "bucket (leave --proxy.replica-urls empty)"
        )
    proxy = Proxy(pc, store, manifest, static_adapter_root=adapter_root if pc.replica_urls else None)
    log.info("run %s: base model %s, bucket %s", manifest.run_id, manifest.base_model, store.url)
    return create_app(proxy)


def run(settings: ProxyConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    # httpx logs every request at INFO: with health probes and thousands of
    # generations that would bury the proxy's own log.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    app = build_app(settings, spec, bucket)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,  # keep the CLI's logging setup
            access_log=False,  # one line per generation request would drown the load fan-out logs
            timeout_keep_alive=30,
        )
    )
    server.run()
    return 0 if server.started else 1  # not started: the port was taken or startup failed (logged)
