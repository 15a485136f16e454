"""`brigade proxy`: check the run (or the pool), then serve the proxy (its own HTTP server: serving/httpserver.py).

With `proxy.pool` (`--proxy.pool true`) the bucket is a shared pool's (pool.json, bucket/pool.py): there is no run
to check, and runs attach over HTTP (docs/pool.md). Without it, the bucket's run.json is the one run served.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from fastapi import FastAPI

from bucket import layout
from bucket.config import BucketConfig, ConfigError, open_bucket
from bucket.manifest import RunManifest, RunSpec, wait_and_check
from bucket.pool import POOL_MANIFEST, PoolManifest, read_pool
from proxy.app import Proxy, create_app
from proxy.config import ProxyConfig
from proxy.serving.httpserver import serve

log = logging.getLogger("brigade.proxy")


def build_app(settings: ProxyConfig, spec: RunSpec, bucket: BucketConfig) -> FastAPI:
    """The proxy's ASGI app (opens the bucket and checks run.json, or pool.json with proxy.pool; starts nothing)."""
    store = open_bucket(bucket)
    pc = settings
    manifest: RunManifest | None = None
    pool: PoolManifest | None = None
    if pc.pool:
        pool = read_pool(store)  # a BucketError saying how to make one when pool.json is missing
        if store.exists(layout.RUN_MANIFEST):
            raise ConfigError(
                f"{store.url} holds both pool.json and run.json: a pool's bucket (or prefix) is its own, apart from "
                "every run's; give the pool a bucket of its own (`brigade pool init`)"
            )
    elif store.exists(POOL_MANIFEST) and not store.exists(layout.RUN_MANIFEST):
        raise ConfigError(
            f"{store.url} is a shared pool's bucket (it holds pool.json, no run.json): start the proxy with "
            "--proxy.pool true (proxy.pool = true in the config) to serve the pool, or name a run's bucket"
        )
    else:
        manifest = wait_and_check(store, spec, "proxy", bucket.manifest_wait_s)
    adapter_root = pc.adapter_root or store.local_path(layout.ADAPTERS)
    if pc.replica_urls and not adapter_root:
        raise ConfigError(
            f"static --proxy.replica-urls with the bucket {store.url}, which is not a local folder: tell the proxy "
            "where the replicas find adapter versions (--proxy.adapter-root), or let the replicas register in the "
            "bucket (leave --proxy.replica-urls empty)"
        )
    proxy = Proxy(pc, store, manifest, static_adapter_root=adapter_root if pc.replica_urls else None, pool=pool)
    if manifest is not None:
        log.info("run %s: base model %s, bucket %s", manifest.run_id, manifest.base_model, store.url)
    elif pool is not None:
        log.info("pool %s: base model %s, bucket %s", pool.pool_id, pool.base_model, store.url)
    return create_app(proxy)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(settings: ProxyConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    # httpx logs every request at INFO: with health probes and adapter calls that would bury the proxy's own log.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    host = settings.host
    if not (settings.admin_token_env and os.environ.get(settings.admin_token_env)) and not _is_loopback(host):
        log.warning(
            "no admin token in $%s: listening on 127.0.0.1 only instead of %s (load, unload, pause and resume "
            "would be open to anyone who reaches the proxy)",
            settings.admin_token_env or "(admin_token_env is empty)",
            host,
        )
        host = "127.0.0.1"
    app = build_app(settings, spec, bucket)
    return serve(app, app.state.proxy.forwarder, host, settings.port)
