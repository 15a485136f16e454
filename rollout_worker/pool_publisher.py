"""Pushes the run's committed adapter versions to its pool (issue 20; pool_client.py attaches the run).

The pool never reads this run's bucket, so the worker (which reads it anyway) carries each version over:
it watches adapters/LATEST.json every `poll_s` and pushes every committed version the pool does not have
live yet, oldest first, or only the newest when it fell more than max_staleness behind (rollouts of the
older ones would be dropped by the trainer anyway). A push reads the version's files checked against their
COMMITTED.json (`adapters.read_verified`), PUTs each file, then POSTs that same marker as the commit: the
pool checks the files against it, commits the version under adapters/<run_id>/ and loads it on every
replica, answering once it is live. A folder the trainer claimed but never committed is never pushed.

Where the run starts (or attaches again after its lease lapsed), the pool is asked first what it has live
(GET /live_adapters), so a restarted worker does not push again what is already there.

Once the commit is answered, two events go to the run's own bucket, with the fields the proxy's own events
have in a run with its own proxy, so `brigade summary`, the timeline and the dashboards show a pool run's
sync latency unchanged: adapter_detected (the worker saw LATEST.json name the version) and
adapter_loaded_all (live on every replica of the pool: `started_at` when the commit was sent, `seconds` the
pool's load, `commit_to_live_s` from the trainer's committed_at).

Failures: no answer, a 5xx, or a load the pool could not complete are retried with back-off (what is due is
worked out again each time, so a newer version supersedes a stuck one). A version the pool holds other
bytes for (409: versions are immutable), a token refused, or a file the pool will not take is a hard error:
it ends the worker with what to do rather than retrying forever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import httpx

from bucket import adapters, events
from bucket.events import EventLog
from bucket.version import Version
from rollout_worker.pool_client import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    RETRY_STATUSES,
    PoolRefused,
    PoolSession,
    answer_text,
)

log = logging.getLogger("brigade.rollout")

PUSH_TIMEOUT_S = 300.0  # a commit is answered once the version is loaded on every replica of the pool
MAX_MISMATCHES = 3  # commits refused with 422 (the pool's files differ from the marker) before giving up


class PushFailed(Exception):
    """A push that may succeed later (the pool unreachable, restarting, or its load failed): retried."""


class Publisher:
    def __init__(self, session: PoolSession, ev: EventLog) -> None:
        self.session, self.ev = session, ev
        self.store, self.manifest, self.run_id = session.store, session.manifest, session.run_id
        self.pushed = Version(0)  # the newest version live in the pool, as far as this worker knows
        self.baseline_of = 0  # the admission the pool was last asked about (session.attachments)
        self.skipped: set[Version] = set()  # versions whose files do not match their marker in the run's bucket
        self.detected: set[Version] = set()
        self.mismatches: collections.Counter[Version] = collections.Counter()

    async def run(self) -> None:
        """Push what is due every `poll_s`, forever (cancelled when the worker ends)."""
        delay = RETRY_FIRST_S
        while True:
            try:
                await self.step()
            except PushFailed as exc:
                log.warning("pushing adapters to the pool: %s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            delay = RETRY_FIRST_S
            await asyncio.sleep(self.session.poll_s)

    async def step(self) -> list[Version]:
        """Push every version due now, oldest first; the versions pushed."""
        if self.baseline_of != self.session.attachments:
            await self._baseline()
        try:
            due = await asyncio.to_thread(self.due)
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: read again at the next poll
            raise PushFailed(f"reading this run's adapters/LATEST.json failed ({type(exc).__name__}: {exc})") from exc
        pushed = []
        for version, marker in due:
            if await self.push(version, marker):
                self.pushed = version
                pushed.append(version)
        return pushed

    async def _baseline(self) -> None:
        """What the pool already has live for this run: nothing at or below it is pushed again."""
        attachments = self.session.attachments
        live = await self.session.live()
        if live is None:
            raise PushFailed("the pool did not say which of this run's versions it has live (GET /live_adapters)")
        if isinstance(live.get("runs"), dict):  # the admin token's answer: every run's
            live = live["runs"].get(self.run_id) or {}
        versions = [v for v in live.get("versions") or [] if isinstance(v, int)]
        newest = live.get("newest")
        self.pushed = Version(max([*versions, newest if isinstance(newest, int) else 0, 0]))
        self.baseline_of = attachments
        if self.pushed:
            log.info("the pool has %s of run %s live: pushing only newer versions", self.pushed.folder, self.run_id)

    def due(self) -> list[tuple[Version, dict[str, Any]]]:
        """(version, commit marker) of the committed versions to push, oldest first (reads the run's bucket)."""
        latest = adapters.latest_version(self.store)
        if latest is None or latest <= self.pushed:
            return []
        if latest - self.pushed > self.manifest.max_staleness:
            candidates = [latest]  # the older ones would be dropped anyway: do not delay the newest with them
        else:
            candidates = [Version(v) for v in range(self.pushed + 1, latest + 1)]
        out = []
        for v in candidates:
            marker = adapters.commit_marker(self.store, v) if v not in self.skipped else None
            if marker is not None:  # None: claimed but never committed (a trainer died mid-upload), or skipped
                out.append((v, marker))
        return out

    async def push(self, version: Version, marker: dict[str, Any]) -> bool:
        """Files, then the commit; True once the pool answers that the version is live."""
        lora_name = version.lora_name(self.run_id)
        if version not in self.detected:
            self.detected.add(version)
            self.ev.emit(events.DETECTED, version=int(version), lora_name=lora_name, pool=True)
        upload_started = time.time()
        try:
            files = await asyncio.to_thread(adapters.read_verified, self.store, version)
        except adapters.AdapterCorrupt as exc:
            log.error("not pushing %s to the pool: %s", version.folder, exc)
            self.skipped.add(version)
            return False
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup
            raise PushFailed(f"reading {version.folder} from this run's bucket failed ({exc})") from exc
        folder = f"{self.session.path}/adapters/{version.folder}"
        for name, data in files.items():
            await self._send("PUT", f"{folder}/{name}", version, content=data)
        started_at = time.time()
        resp = await self._send("POST", f"{folder}/commit", version, json=marker)
        live_at = time.time()
        try:
            answer = resp.json()
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        self.mismatches.pop(version, None)
        seconds = answer.get("seconds")
        committed_at = marker.get("committed_at")
        fields: dict[str, Any] = {
            "version": int(version),
            "lora_name": str(answer.get("lora_name") or lora_name),
            # the pool's own measure of its load, else the commit's round trip (this worker's clock)
            "seconds": round(float(seconds) if isinstance(seconds, int | float) else live_at - started_at, 4),
            "started_at": started_at,
            "upload_s": round(started_at - upload_started, 4),
            "pool": True,
        }
        if isinstance(answer.get("replicas"), int):
            fields["replicas"] = answer["replicas"]
        if isinstance(answer.get("replica_ids"), list):
            fields["replica_ids"] = [str(r) for r in answer["replica_ids"]]
        if isinstance(committed_at, int | float):
            fields["committed_at"] = committed_at
            fields["commit_to_live_s"] = round(live_at - committed_at, 4)  # trainer's clock -> this worker's
        self.ev.emit(events.LOADED_ALL, ts=live_at, **fields)
        log.info(
            "%s is live in the pool (upload %.2fs, load %.2fs%s)",
            lora_name,
            fields["upload_s"],
            fields["seconds"],
            f", {fields['commit_to_live_s']:.2f}s after its commit" if "commit_to_live_s" in fields else "",
        )
        return True

    async def _send(self, method: str, path: str, version: Version, **body: Any) -> httpx.Response:
        """One request of a push: its 200 answer, PushFailed when it may pass, PoolRefused when it cannot."""
        commit = path.endswith("/commit")
        try:
            resp = await self.session.client.request(method, path, timeout=PUSH_TIMEOUT_S, **body)
        except httpx.TransportError as exc:
            raise PushFailed(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        code, said = resp.status_code, answer_text(resp)
        if code == 200:
            return resp
        if code == 404:  # the pool does not hold the run (its lease lapsed, the pool restarted): admission again
            await self.session.attach()
            raise PushFailed(f"the pool no longer held run {self.run_id} ({said}); attached again")
        if code == 409:
            raise PoolRefused(
                f"the pool at {self.session.url} already holds {self.run_id}'s {version.folder} with other bytes "
                f"(HTTP 409 on {method} {path}: {said}). Versions are immutable, so this run cannot push it: does "
                f"another run use the run id {self.run_id!r} (a copied bucket)? Start this run in a new bucket "
                "(a new run id), or have the pool's operator remove the run's folder from the pool"
            )
        if code in (401, 403):
            raise PoolRefused(self.session.refusal(resp, f"refused a push ({method} {path}) of"))
        if commit and code == 422:  # a file the pool holds differs from the marker: put the files again
            self.mismatches[version] += 1
            if self.mismatches[version] >= MAX_MISMATCHES:
                raise PoolRefused(
                    f"the pool refused the commit of {version.folder} {MAX_MISMATCHES} times (HTTP 422: {said}): "
                    "the files it received do not match their marker; check that nothing between this worker "
                    "and the pool alters request bodies"
                )
            raise PushFailed(f"the pool refused the commit of {version.folder} (HTTP 422: {said}); putting it again")
        if commit or code in RETRY_STATUSES:  # a commit's other errors are its load failing: it may load later
            raise PushFailed(f"{method} {path}: HTTP {code}: {said}")
        raise PoolRefused(f"the pool at {self.session.url} refused {method} {path} (HTTP {code}: {said})")
