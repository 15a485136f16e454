"""Adapter loads and unloads, fanned out to every replica that receives traffic.

Loads are all-or-nothing: a version is loaded on every routable replica or on
none. If one replica fails, the ones this load reached unload it again, so a
rollout never lands on a replica that lacks the adapter it names. (A replica
that joins later gets every loaded adapter first: see membership.py.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi.responses import PlainTextResponse, Response

from bucket import adapters, events, layout
from proxy.errors import error_response
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef, BadAdapterPath, version_dir_of
from proxy.state import ProxyState
from proxy.upstream import ReplicaResult, Upstream

log = logging.getLogger("brigade.proxy")


class AdapterFanout:
    """Loads and unloads one adapter on all routable replicas at once, keeping `state.loaded` true."""

    def __init__(self, state: ProxyState, upstream: Upstream, events: EventWriter) -> None:
        self.state = state
        self.upstream = upstream
        self.events = events

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
            vdir = version_dir_of(self.state.store, path)
        except BadAdapterPath as exc:
            return error_response(400, str(exc))
        version = layout.parse_version_dir(vdir)
        assert version is not None
        if await asyncio.to_thread(adapters.commit_marker, self.state.store, version) is None:
            return error_response(
                409,
                f"adapter {layout.ADAPTERS}/{vdir} is not committed (no "
                f"{layout.COMMIT_MARKER}): it is still being written, or its "
                "writer died; load a committed version",
            )
        return AdapterRef(name, version, vdir)

    async def load_adapter(self, body: Any) -> Response:
        received = time.monotonic()
        ad = await self._checked_request(body)
        if isinstance(ad, Response):
            return ad
        state = self.state
        async with state.adapter_lock:
            known = state.loaded.get(ad.lora_name)
            if known is not None and known.version_dir != ad.version_dir:
                return error_response(
                    409,
                    f"lora_name {ad.lora_name!r} is already loaded from {known.version_dir}; "
                    "each version needs its own name",
                )
            targets = list(state.routable.values())
            if not targets:
                return error_response(503, "no replica is available to load the adapter on")
            deadline = time.monotonic() + state.config.load_retry_s
            results = await asyncio.gather(*(self.upstream.load_on(r, ad, deadline) for r in targets))
            failed = [r for r in results if not r.ok]
            rolled_back: list[ReplicaResult] = []
            if failed:
                # Only where this call loaded it: a replica that had it before keeps it.
                by_id = {r.replica_id: r for r in targets}
                rolled_back = list(
                    await asyncio.gather(
                        *(self.upstream.unload_on(by_id[r.replica], ad.lora_name) for r in results if r.ok and r.newly)
                    )
                )
            else:
                state.loaded[ad.lora_name] = ad
        seconds = time.monotonic() - received
        if failed:
            return await self._load_failed(ad, results, failed, rolled_back, seconds)
        return await self._load_succeeded(ad, results, received, seconds)

    async def _load_succeeded(
        self, ad: AdapterRef, results: list[ReplicaResult], received: float, seconds: float
    ) -> Response:
        self.state.metrics.load_seconds.observe(seconds)
        for r in results:
            await self.events.emit(
                events.LOADED,
                version=ad.version,
                lora_name=ad.lora_name,
                replica=r.replica,
                seconds=round(r.done_at - received, 4),
                attempts=r.attempts,
                already_loaded=not r.newly,
            )
        await self.events.emit(
            events.LOADED_ALL,
            version=ad.version,
            lora_name=ad.lora_name,
            seconds=round(seconds, 4),
            replicas=len(results),
        )
        log.info(
            "loaded %s (%s) on %d replicas in %.2fs: %s",
            ad.lora_name,
            ad.version_dir,
            len(results),
            seconds,
            ", ".join(
                f"{r.replica} {r.done_at - received:.2f}s"
                + (f" after {r.attempts} tries" if r.attempts > 1 else "")
                + ("" if r.newly else " (already loaded)")
                for r in results
            ),
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
    ) -> Response:
        for r in failed:
            self.state.metrics.load_failures.labels(r.replica).inc()
        stuck = [r.replica for r in rolled_back if not r.ok]
        await self.events.emit(
            events.LOAD_FAILED,
            version=ad.version,
            lora_name=ad.lora_name,
            seconds=round(seconds, 4),
            failed={r.replica: r.reason for r in failed},
            rolled_back=[r.replica for r in rolled_back if r.ok],
            rollback_failed=stuck,
        )
        log.warning(
            "loading %s (%s) failed on %s after %.2fs; rolled back on %d replicas%s",
            ad.lora_name,
            ad.version_dir,
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
            f"loading {ad.lora_name} from {layout.ADAPTERS}/{ad.version_dir} failed on "
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
        async with self.state.adapter_lock:
            targets = list(self.state.routable.values())
            results = list(await asyncio.gather(*(self.upstream.unload_on(r, name) for r in targets)))
            # Forgotten even if a replica did not answer: joiners must not get it again, and a retried
            # unload counts that replica's 404 as success.
            ad = self.state.loaded.pop(name, None)
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
