"""Adapter loads and unloads, fanned out to every replica that receives traffic.

Loads are all-or-nothing: a version is loaded on every routable replica or on
none. If one replica fails, the ones this load reached unload it again, so a
rollout never lands on a replica that lacks the adapter it names. (A replica
that joins later gets every loaded adapter first: see replicas/membership.py.)

A version counts as loaded on a replica once the served-policy probe admitted
it (probe.py): the replica's own shift from the base on the canary must
be the trainer's, at the configured confidence, and its logprobs within
`canary_tolerance` of the trainer's. A replica that fails is given the version
again (unload, load), probed again, and ejected if it still fails; one whose
probe stays inconclusive fails the whole load (nobody is ejected). Either is an
`adapter_probe_failed` event, a metric and part of the load's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from bucket import adapters, events, layout
from bucket.canary import read_canary
from bucket.replicas import ReplicaInfo
from proxy.adapters import adapter_import
from proxy.adapters.probe import CanaryProbe, ProbeVerdict
from proxy.errors import error_response
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef, BadAdapterPath, NotAVersionFolder, version_of
from proxy.replicas.upstream import ReplicaResult, Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

_held = 0  # fan-outs under way that hold the cycle collector back (a pool's runs load side by side)
HOLD_MAX_S = 2.0  # a fan-out waiting on a lagging mirror (up to load_retry_s) lets the collector run after this


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """No cycle-collector pass while a version is loaded everywhere: the collection waits for the fan-out's end
    (or HOLD_MAX_S, whichever comes first).

    With hundreds of replicas the proxy's full passes take 110-130 ms (every ~2.5 s at 256 simulated replicas and
    ~1,500 requests/s: its routing tables and connections are many objects to walk), and one that fell inside a
    fan-out held every replica's load back by that much: a third of the syncs took twice as long
    (benchmarks/scaling/sync_simulated.py). Deferred by a fan-out's ~0.1 s, the pass costs forwarding what it
    did before and the sync nothing."""
    global _held
    if _held == 0 and not gc.isenabled():  # someone else turned it off: theirs to turn back on
        yield
        return
    _held += 1
    gc.disable()
    release = asyncio.get_running_loop().call_later(HOLD_MAX_S, gc.enable)
    try:
        yield
    finally:
        release.cancel()
        _held -= 1
        if _held == 0:
            gc.enable()


class AdapterFanout:
    """Loads and unloads one adapter on all routable replicas at once, keeping `state.loaded` true.

    `loaded_changed()` is called after `state.loaded` changed (the live versions are written for the mirrors);
    `on_probe_failed(replica_id, reason)` when a replica serves other weights under a version's name (membership
    ejects it); `on_load_failed(reason)` after a failed client load (the forwarder ends a pause: a client that
    paused before loading may never resume).
    """

    def __init__(
        self,
        state: ProxyState,
        upstream: Upstream,
        events: EventWriter,
        prober: CanaryProbe,
        *,
        loaded_changed: Callable[[], None],
        on_probe_failed: Callable[[str, str], None],
        on_load_failed: Callable[[str], None],
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.events = events
        self.prober = prober
        self.loaded_changed = loaded_changed
        self.on_probe_failed = on_probe_failed
        self.on_load_failed = on_load_failed
        self.imported: dict[str, adapter_import.Imported] = {}  # client adapter folders made versions, by name

    async def _checked_request(self, body: Any) -> AdapterRef | Response:
        """The committed bucket version a load request names, or the error answer."""
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object with lora_name and lora_path")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            return error_response(400, "lora_name must be a non-empty string")
        if body.get("load_inplace"):
            return error_response(
                400,
                "load_inplace is refused: vLLM keys its prefix cache by adapter name, so an "
                "in-place reload would serve KV computed under the old weights. Load each "
                "version under a new name.",
            )
        try:
            version = version_of(self.state.store, path)
        except NotAVersionFolder as exc:
            return await self._import(name, exc.folder)
        except BadAdapterPath as exc:
            return error_response(400, str(exc))
        try:
            marker = await asyncio.to_thread(adapters.commit_marker, self.state.store, version)
        except adapters.AdapterCorrupt as exc:  # a marker that is no marker: nothing of that version is loaded
            return error_response(409, str(exc))
        if marker is None:
            return error_response(
                409,
                f"adapter {version.key} is not committed (no "
                f"{layout.COMMIT_MARKER}): it is still being written, or its "
                "writer died; load a committed version",
            )
        return AdapterRef(name, version, read_canary(marker))

    async def _import(self, name: str, folder: str) -> AdapterRef | Response:
        """A client's adapter folder inside the bucket as a committed version (adapter_import.py says when)."""
        store = self.state.store
        try:
            files, digest = await asyncio.to_thread(adapter_import.read_folder, store, folder)
        except adapter_import.ImportRefused as exc:
            return error_response(exc.status, str(exc))
        known = self.imported.get(name)
        if known is not None and known.digest == digest:  # the same request again: the same version
            return AdapterRef(name, known.version)
        prefix = adapter_import.new_run_prefix(name)
        if (known is not None or name in self.state.loaded) and prefix is None:
            return error_response(
                409,
                f"lora_name {name!r} is already loaded with other weights: vLLM keys its prefix cache by "
                "adapter name and would serve KV computed under the old ones. Load each version under a new "
                "name (a new run may reuse the names from its first version, ...-v1, on)",
            )
        if prefix is not None:  # a new run: the old run's versions of these names go first
            for old in [n for n in list(self.state.loaded) if adapter_import.of_run(n, prefix)]:
                resp = await self.unload_adapter({"lora_name": old})
                if resp.status_code != 200:
                    return resp
            self.imported = {n: i for n, i in self.imported.items() if not adapter_import.of_run(n, prefix)}
        imported = await asyncio.to_thread(adapter_import.publish_import, store, folder, name, files, digest)
        self.imported[name] = imported
        log.info("imported %s from %s as %s", name, folder, imported.version.folder)
        return AdapterRef(name, imported.version)

    async def load_adapter(self, body: Any) -> Response:
        resp = await self._load_adapter(body)
        if resp.status_code != 200:
            # A client that paused before loading may never resume after a failure (TRL does not): resume here.
            self.on_load_failed(f"an adapter load failed ({resp.status_code})")
        return resp

    async def _load_adapter(self, body: Any) -> Response:
        received, started_at = time.monotonic(), time.time()  # the wall clock goes into the events
        ad = await self._checked_request(body)
        if isinstance(ad, Response):
            return ad
        return await self.load_ref(ad, received, started_at)

    async def load_ref(self, ad: AdapterRef, received: float, started_at: float) -> Response:
        """Load a committed version on every routable replica, all or nothing (the lifecycle's loads come here
        directly; a client's come through `load_adapter`). `received`: monotonic, `started_at`: wall clock."""
        state = self.state
        async with state.adapter_locks.run(ad.pool_run):  # a pool's runs load side by side
            known = state.loaded.get(ad.lora_name)
            if known is not None and known.version != ad.version:
                return error_response(
                    409,
                    f"lora_name {ad.lora_name!r} is already loaded from {known.version.folder}; "
                    "each version needs its own name",
                )
            targets = list(state.routable.values())
            if not targets:
                return error_response(503, "no replica is available to load the adapter on")
            deadline = time.monotonic() + state.config.load_retry_s

            async def load_and_probe(info: ReplicaInfo) -> tuple[ReplicaResult, float, ProbeVerdict | None]:
                # Each replica is probed as soon as it answers its load, while the others still load: the fan-out
                # takes the slowest load + probe, not the slowest load plus the slowest probe.
                res = await self.upstream.load_on(info, ad, deadline)
                answered = res.done_at  # the load itself, before any probe
                if not res.ok or ad.canary is None:
                    return res, answered, None
                verdict = await self.prober.probe_and_repair(info, ad)
                if verdict.ok:
                    res.done_at = time.monotonic()  # a version counts as loaded once its probe passed
                return res, answered, verdict

            with collector_held():
                outcomes = await asyncio.gather(*(load_and_probe(r) for r in targets))
            results = [res for res, _, _ in outcomes]
            failed = [r for r in results if not r.ok]
            answered = {res.replica: at for res, at, _ in outcomes}
            rolled_back: list[ReplicaResult] = []
            probe_failed: dict[str, str] = {}
            if not failed and ad.canary is not None:
                verdicts = {res.replica: v for res, _, v in outcomes if v is not None}
                probe_failed = {rid: v.reason for rid, v in verdicts.items() if not v.ok}
                undecided = {rid for rid, v in verdicts.items() if v.result == "inconclusive"}
                now = time.monotonic()
                if undecided or len(probe_failed) == len(targets):
                    # Inconclusive is never a pass, and not the replica's fault either (the version is too close
                    # to the base for its noise): the version is refused everywhere and nobody is ejected.
                    failed = [
                        ReplicaResult(rid, False, status=502, reason=f"canary probe: {why}", done_at=now)
                        for rid, why in probe_failed.items()
                    ]
                else:
                    for rid, why in probe_failed.items():
                        self.on_probe_failed(rid, why)  # ejected: it gets no traffic until it serves every version
                    results = [r for r in results if r.replica not in probe_failed]
            if failed:
                # Only where this call loaded it: a replica that had it before keeps it.
                by_id = {r.replica_id: r for r in targets}
                rolled_back = list(
                    await asyncio.gather(
                        *(
                            self.upstream.unload_on(by_id[r.replica], ad.lora_name)
                            for r in results
                            if r.ok and r.newly and r.replica in by_id
                        )
                    )
                )
            else:
                state.loaded[ad.lora_name] = ad
                state.used_at[ad.lora_name] = time.monotonic()  # whoever loaded it gets unload_idle_s to use it
                self.loaded_changed()
        seconds = time.monotonic() - received
        if failed:
            return await self._load_failed(ad, results, failed, rolled_back, seconds, started_at)
        return await self._load_succeeded(ad, results, received, seconds, started_at, probe_failed, answered)

    async def _load_succeeded(
        self,
        ad: AdapterRef,
        results: list[ReplicaResult],
        received: float,
        seconds: float,
        started_at: float,
        probe_failed: dict[str, str] | None = None,
        answered: dict[str, float] | None = None,
    ) -> Response:
        self.state.metrics.load_seconds.observe(seconds)
        answered = answered or {}
        # Stamped when each replica's load (and probe) ended, not when the event is written: the version is live
        # before its records reach the bucket, and on a slow or faulty store that write takes seconds; stamped at
        # the write, a record came after groups generated with the version (a chaos run's audit counted one such
        # group as mixed).
        wall = time.time() - time.monotonic()
        batch: list[tuple[events.EventKind, dict[str, Any]]] = []
        for r in results:
            self.state.metrics.replica_load_seconds.labels(r.replica).observe(max(0.0, r.done_at - received))
            loaded = {
                "version": ad.version,
                "lora_name": ad.lora_name,
                "replica": r.replica,
                "seconds": round(r.done_at - received, 4),
                # where the time went: the replica's answer to the load, then the canary probe
                "load_s": round(answered.get(r.replica, r.done_at) - received, 4),
                "attempts": r.attempts,
                "already_loaded": not r.newly,
                "ts": wall + r.done_at,
            }
            batch.append((events.LOADED, loaded))
        loaded_all = {
            "version": ad.version,
            "lora_name": ad.lora_name,
            "seconds": round(seconds, 4),
            "started_at": started_at,
            "replicas": len(results),
            "probed": ad.canary is not None,
            "ejected_by_probe": sorted(probe_failed or {}),
            "ts": wall + received + seconds,  # when it went live on every replica
        }
        await self.events.emit_all([*batch, (events.LOADED_ALL, loaded_all)])
        log.info(
            "loaded %s (%s) on %d replicas in %.2fs: %s",
            ad.lora_name,
            ad.version.folder,
            len(results),
            seconds,
            ", ".join(
                f"{r.replica} {r.done_at - received:.2f}s"
                + (f" after {r.attempts} tries" if r.attempts > 1 else "")
                + ("" if r.newly else " (already loaded)")
                for r in results
            ),
        )
        if probe_failed:
            return JSONResponse(
                {
                    "message": f"Success: LoRA adapter '{ad.lora_name}' added successfully on {len(results)} replicas; "
                    f"ejected {len(probe_failed)} that serve other weights under its name",
                    "probe_failed": probe_failed,
                }
            )
        return PlainTextResponse(
            f"Success: LoRA adapter '{ad.lora_name}' added successfully on {len(results)} replicas."
        )

    async def _load_failed(
        self,
        ad: AdapterRef,
        results: list[ReplicaResult],
        failed: list[ReplicaResult],
        rolled_back: list[ReplicaResult],
        seconds: float,
        started_at: float,
    ) -> Response:
        for r in failed:
            self.state.metrics.load_failures.labels(r.replica).inc()
        stuck = [r.replica for r in rolled_back if not r.ok]
        await self.events.emit(
            events.LOAD_FAILED,
            version=ad.version,
            lora_name=ad.lora_name,
            seconds=round(seconds, 4),
            started_at=started_at,
            failed={r.replica: r.reason for r in failed},
            rolled_back=[r.replica for r in rolled_back if r.ok],
            rollback_failed=stuck,
        )
        log.warning(
            "loading %s (%s) failed on %s after %.2fs; rolled back on %d replicas%s",
            ad.lora_name,
            ad.version.folder,
            ", ".join(f"{r.replica} ({r.status}: {r.reason})" for r in failed),
            seconds,
            len(rolled_back) - len(stuck),
            f", rollback FAILED on {stuck}" if stuck else "",
        )
        # The first failure's own status (e.g. vLLM's 404) tells the client most; no answer at all is a 502.
        first = failed[0]
        status = first.status if first.status is not None and first.status >= 400 else 502
        undone = len(rolled_back) - len(stuck)
        message = (
            f"loading {ad.lora_name} from {ad.version.key} failed on "
            f"{len(failed)} of {len(results)} replicas"
            + (f" (unloaded again from {undone} that had loaded it)" if undone else "")
            + (f" (unloading it again FAILED on {stuck})" if stuck else "")
            + ": "
            + "; ".join(f"{r.replica}: {r.reason}" for r in failed)
        )
        return error_response(
            status,
            message,
            replicas=[r.describe() for r in results],
            rolled_back=[r.replica for r in rolled_back if r.ok],
            rollback_failed=stuck,
        )

    async def unload_adapter(self, body: Any) -> Response:
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return error_response(400, "lora_name must be a non-empty string")
        return await self.unload(name)

    async def unload(self, name: str) -> Response:
        """Unload `name` from every routable replica and forget it (joiners do not get it again)."""
        known = self.state.loaded.get(name)
        # A name not loaded (yet) may be mid-load under any run's lock: such a rare unload waits for them all.
        locks = self.state.adapter_locks
        async with locks.run(known.pool_run) if known is not None else locks.every():
            targets = list(self.state.routable.values())
            results = list(await asyncio.gather(*(self.upstream.unload_on(r, name) for r in targets)))
            # Forgotten even if a replica did not answer: joiners must not get it again, and a retried
            # unload counts that replica's 404 as success.
            ad = self.state.loaded.pop(name, None)
            if ad is not None:
                self.loaded_changed()
                self.state.router.forget_model(name)
        failed = [r for r in results if not r.ok]
        await self.events.emit(
            events.UNLOADED,
            version=ad.version if ad else None,
            lora_name=name,
            replicas=len(results),
            failed={r.replica: r.reason for r in failed},
        )
        if failed:
            log.warning("unloading %s failed on %s", name, ", ".join(f"{r.replica} ({r.reason})" for r in failed))
            return error_response(
                502,
                f"unloading {name} failed on " + "; ".join(f"{r.replica}: {r.reason}" for r in failed),
                replicas=[r.describe() for r in results],
            )
        log.info("unloaded %s from %d replicas", name, len(results))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully from {len(results)} replicas.")
