"""`brigade eval --pool URL`: a run's versions evaluated on a shared pool (docs/pool.md), with the run's token.

The pool never reads the run's bucket and loads only what a run pushed it, so the evaluation does, for the
versions it names, what the run's rollout worker does (rollout_worker/pool_client.py, pool_publisher.py):

* it holds the run's admission while it evaluates, as one more worker of the run (`eval-<host>-<id>`): it
  renews the lease the run's workers hold (the run's settings unchanged), or attaches the run when none does
  (after training, say), and renews every lease_s / 3;
* a version the pool does not have live is pushed from the run's bucket (its files checked against their
  COMMITTED.json, then the marker as the commit: the pool commits it if it is new and loads it on every
  replica); evaluated, it is unloaded again unless it became the run's newest live version (its workers
  generate with that one);
* at the end it leaves as that worker: the run stays attached while one of its own workers holds it, and is
  detached (its adapters unloaded) when the evaluation attached it.

The token comes from `$<rollout.pool_token_env>` (BRIGADE_POOL_TOKEN) or a file (`--pool-token-file`), never
from the command line (a process list shows it) and is never logged. Generations go out as evaluations
(priority 10, behind the pool's training traffic), with the run's token, so they count against its share.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx

from bucket import adapters, events
from bucket.config import ConfigError
from bucket.manifest import RunManifest
from bucket.store import Store
from bucket.version import Version
from rollout_worker.pool_client import PoolRefused, PoolSession, answer_text, pool_token

log = logging.getLogger("brigade.eval")

PUSH_TIMEOUT_S = 300.0  # a commit is answered once the version is live on every replica of the pool


def read_token(env: str, url: str, token_file: str | None) -> tuple[str, str]:
    """(the run's pool token, where it came from, for messages): from `token_file` when given, else `$env`."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--pool-token-file {token_file}: cannot read it ({exc.strerror})") from None
        if not token:
            raise ConfigError(
                f"--pool-token-file {token_file} is empty: put the run's pool token there "
                "(`brigade pool token --pool POOL_BUCKET --run RUN_ID` prints one)"
            )
        return token, f"the file {token_file}"
    return pool_token(env, url), f"${env}"


class PoolEvaluation:
    """The run held on the pool for one `brigade eval`: `prepare` each version, evaluate, `release` it."""

    def __init__(self, session: PoolSession, store: Store, manifest: RunManifest) -> None:
        self.session, self.store, self.manifest = session, store, manifest
        self.run_id = session.run_id
        self.attached_here = False  # no worker of the run held it: this evaluation attached it
        self._lease: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        """Join the run's lease (200: attached, its settings as its workers set them) or attach it (404)."""
        resp = await self.session.renew()
        if resp.status_code == 404:
            await self.session.attach()
            self.attached_here = True
        elif resp.status_code != 200:
            raise PoolRefused(self.session.refusal(resp, "refused the lease of"))
        else:
            log.info("run %s is attached to the pool at %s: evaluating beside it", self.run_id, self.session.url)
        self._lease = asyncio.create_task(self.session.keep_lease(), name="eval-lease")

    async def close(self) -> None:
        """Stop renewing and leave as this evaluation's worker (the run's own workers keep it attached)."""
        if self._lease is not None:
            self._lease.cancel()
            await asyncio.gather(self._lease, return_exceptions=True)
        await self.session.detach()
        await self.session.client.aclose()

    async def live(self) -> tuple[set[int], int | None]:
        """The run's versions live on the pool now, and its newest."""
        data = await self.session.live() or {}
        versions = {v for v in data.get("versions") or [] if isinstance(v, int)}
        newest = data.get("newest")
        return versions, newest if isinstance(newest, int) else None

    async def prepare(self, version: Version) -> bool:
        """Make `version` live on the pool; True when this evaluation made it live (and so `release`s it)."""
        live, _ = await self.live()
        if int(version) in live:
            return False
        try:
            files, marker = await asyncio.to_thread(self._read, version)
        except adapters.AdapterCorrupt as exc:
            raise ConfigError(f"version {int(version)} cannot be evaluated on the pool: {exc}") from None
        folder = f"{self.session.path}/adapters/{version.folder}"
        for name, data in files.items():
            self._check(await self._send("PUT", f"{folder}/{name}", content=data), version)
        self._check(await self._send("POST", f"{folder}/commit", json=marker), version)
        log.info("%s is live on the pool for the evaluation", version.lora_name(self.run_id))
        return True

    def _read(self, version: Version) -> tuple[dict[str, bytes], dict[str, Any] | None]:
        """The version's files, checked against its marker, and the marker (blocking: the run's bucket)."""
        return adapters.read_verified(self.store, version), adapters.commit_marker(self.store, version)

    async def release(self, version: Version) -> None:
        """Unload a version this evaluation made live, unless it is the run's newest now (its workers' one)."""
        _, newest = await self.live()
        if newest == int(version):
            return
        name = version.lora_name(self.run_id)
        resp = await self.session.client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        if resp.status_code != 200:
            log.warning("could not unload %s from the pool (HTTP %d: %s)", name, resp.status_code, answer_text(resp))

    async def _send(self, method: str, path: str, **body: Any) -> httpx.Response:
        try:
            return await self.session.client.request(method, path, timeout=PUSH_TIMEOUT_S, **body)
        except httpx.TransportError as exc:
            raise ConfigError(f"the pool at {self.session.url} did not answer {method} {path} ({exc})") from None

    def _check(self, resp: httpx.Response, version: Version) -> None:
        if resp.status_code == 200:
            return
        if resp.status_code in (401, 403):
            raise PoolRefused(self.session.refusal(resp, f"refused the push of {version.folder} of"))
        raise ConfigError(
            f"the pool at {self.session.url} could not make {version.lora_name(self.run_id)} live "
            f"(HTTP {resp.status_code}: {answer_text(resp)}): nothing was evaluated with it"
        )


def open_pool(
    url: str, token: str, source: str, env: str, store: Store, manifest: RunManifest, weight: float
) -> PoolEvaluation:
    """The evaluation's session with the pool, under its own worker name (never the run's workers')."""
    worker = events.default_writer("eval")
    session = PoolSession(url, token, env, manifest, store, weight=weight, worker=worker)
    session.token_source = source
    return PoolEvaluation(session, store, manifest)
