"""Client requests to replicas.

Generation requests (the hot path) are parsed once (generation_body.py),
routed (proxy/routing), admitted under a global and a per-replica in-flight
limit, and sent as the client's own bytes with the `send` the forwarder was
built with: in production a pooled keep-alive connection (pool.py,
`ReplicaConnections.send`); the answer is relayed as it arrives, streamed or
not. A replica that fails before the first byte of its answer reached the
client is reported (`on_failure`: membership ejects it) and the request goes
to another replica; a failure mid-answer ends the answer with a clear error.
Everything else (models, tokenize, pause/resume, ...) is passthrough.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from bucket import priority
from bucket.pool import ADAPTER_RETIRED
from bucket.replicas import ReplicaInfo
from proxy.errors import error_body
from proxy.replicas.upstream import Upstream
from proxy.replicas.wire import UpstreamError
from proxy.serving.generation_body import BadRequest, completion_tokens, parse_generation, prompt_of
from proxy.serving.slots import FairShare, PrioritySlots
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class ClientSink(Protocol):
    """The client's side of one generation answer."""

    def error(self, status: int, body: bytes) -> None: ...
    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None: ...
    def body(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def abort(self, message: str) -> None: ...


class ReplicaAnswer(Protocol):
    """A replica's answer to one generation, once its head arrived (replicas/wire.py's `Exchange` is one)."""

    status: int
    headers: list[tuple[bytes, bytes]]  # to relay: lower-case names, hop-by-hop headers removed
    length: int | None  # Content-Length; None = streamed
    tail: bytes | None  # the last body chunk relayed (where a non-streamed answer's usage is)

    def attach(self, sink: Any, on_done: Callable[[bool], None]) -> None: ...
    def cancel(self, why: str) -> None: ...


# Sends a generation's body to `path` on a replica; raises wire.UpstreamError when it fails before answering.
SendGeneration = Callable[[ReplicaInfo, str, bytes], Awaitable[ReplicaAnswer]]
# A pool's generation gate: (Authorization header, the body's model) -> the request's run, or (status, message).
Gate = Callable[[bytes | None, Any], Awaitable[str | tuple[int, str]]]


def without_priority(body: bytes, payload: dict[str, Any]) -> bytes:
    """The body for a replica without priority scheduling, which refuses any `priority` but 0: without it.
    Rewritten only when a client sent one (brigade's evaluations do); other bodies pass as they are."""
    if payload.get("priority") in (None, 0):
        return body
    return json.dumps({k: v for k, v in payload.items() if k != "priority"}).encode()


class Forwarder:
    """Sends generations to the routable replicas; never changes which replicas or adapters there are.

    `send` carries each generation to a replica (pool.py's `ReplicaConnections.send` in production).
    `on_failure(replica_id, reason)` is called when a replica failed a request before answering
    (membership ejects it: the passive half of the circuit breaker).
    `gate(authorization, model)`, in a pool, says whether a generation's bearer token may name its model: the
    request's run when it may, else (status, message) and nothing is forwarded (proxy/pool/access.py).
    `weights(run)` is each run's weight in the fair sharing of the replicas' slots (slots.py; 1.0 without it);
    `run_of(model)`, when set, names the run of a generation its caller did not name (slots.run_of_model
    in a pool); without either, every request is of run "" and the order is first come first served.
    """

    def __init__(
        self,
        state: ProxyState,
        upstream: Upstream,
        *,
        send: SendGeneration,
        on_failure: Callable[[str, str], None],
        weights: Callable[[str], float | None] | None = None,
        run_of: Callable[[str], str] | None = None,
        gate: Gate | None = None,
        retired: Callable[[str], str | None] | None = None,
    ) -> None:
        self.state = state
        self.upstream = upstream
        self.send = send
        self.on_failure = on_failure
        self._slots = asyncio.Semaphore(state.config.max_inflight)
        self._replica_slots: dict[str, PrioritySlots] = {}
        self.fair = FairShare(weights)  # the runs' virtual times, shared by every replica's slots
        self.run_of = run_of
        self.gate = gate
        # A pool's: why a generation naming a version is no longer sent (past its run's staleness window),
        # asked on arrival and again when a slot frees, since newer versions go live while it waits.
        self.retired = retired
        self.retired_requests: dict[str, int] = {}  # run -> generations refused as retired
        self.waiting = 0
        self.retries: dict[str, int] = {"connect": 0, "reset_before_answer": 0, "stale_connection": 0}
        self.upstream_errors: dict[str, int] = {}  # replica -> failures (passthrough.py counts its own here too)
        self.broken_answers = 0

    def _replica_slot(self, rid: str) -> PrioritySlots:
        slots = self._replica_slots.get(rid)
        if slots is None:
            capacity, info = self.state.config.replica_max_inflight, self.state.routable.get(rid)
            if info is not None and info.max_num_seqs:
                # its vLLM runs control_seqs more, kept for control requests (slots.py says why)
                capacity = min(capacity, info.max_num_seqs)
            slots = self._replica_slots[rid] = PrioritySlots(capacity, self.fair)
        return slots

    # -- generation ----------------------------------------------------------------------------
    def set_weights(self, weights: Callable[[str], float | None] | None) -> None:
        """The runs' weights from now on (the pool's admitted runs; None: every run 1.0)."""
        self.fair.weights = weights

    def _route(
        self,
        payload: dict[str, Any],
        tokens: list[int] | None,
        text: str | None,
        tried: set[str],
        n: int,
        max_tokens: int | None,
        session: str | None,
    ):
        router, model = self.state.router, payload["model"]
        if tokens is not None:
            return router.route_tokens(model, tokens, tried, n=n, max_tokens=max_tokens, session=session)
        return router.route_text(model, text or "", tried, n=n, max_tokens=max_tokens, session=session)

    async def generate(
        self,
        path: str,
        body: bytes,
        sink: ClientSink,
        run: str | None = None,
        authorization: bytes | None = None,
        session: str | None = None,
    ) -> None:
        """Route one completions/chat request and relay the answer to `sink`; never raises for replica failures.
        `run`: whose share of the slots it takes (a pool run's token names it; None: `run_of(model)`, or "").
        `authorization`: the request's Authorization header, for the `gate` (a pool's). `session`: the episode
        it is a turn of (its X-Session-ID header): kept on the episode's replica, its model held between turns."""
        try:
            payload = parse_generation(body)
            tokens, text = prompt_of(payload)
        except BadRequest as exc:
            sink.error(400, error_body(400, str(exc)))
            return
        if self.gate is not None:
            verdict = await self.gate(authorization, payload.get("model"))
            if type(verdict) is not str:
                status, message = verdict
                sink.error(status, error_body(status, message))
                return
            if run is None:
                run = verdict
        state = self.state
        if not state.dispatching.is_set():  # paused (/pause): new generations wait for /resume
            await state.dispatching.wait()
        if not state.routable:
            sink.error(503, error_body(503, "no replica is available"))
            return
        slots = self._slots
        # Counted from here to the end of its answer, waiting included: the lifecycle never unloads an adapter a
        # request in the proxy still names.
        model = payload["model"] if isinstance(payload.get("model"), str) else ""
        if run is None:
            run = self.run_of(model) if self.run_of is not None else ""
        if self.retired is not None and self._refused_as_retired(payload, run, sink):
            return
        state.hold(model, session)
        try:
            if slots.locked():
                self.waiting += 1
                try:
                    await slots.acquire()
                finally:
                    self.waiting -= 1
            else:
                await slots.acquire()
        except BaseException:
            state.drop(model, session)
            raise
        released = False

        def release_global() -> None:
            nonlocal released
            if not released:
                released = True
                slots.release()
                state.drop(model, session)

        try:
            await self._generate(path, body, payload, tokens, text, sink, release_global, run, session)
        except BaseException:
            release_global()
            raise

    async def _generate(
        self,
        path: str,
        body: bytes,
        payload: dict[str, Any],
        tokens: list[int] | None,
        text: str | None,
        sink: ClientSink,
        release_global: Callable[[], None],
        run: str,
        session: str | None = None,
    ) -> None:
        state, router = self.state, self.state.router
        tried: set[str] = set()
        stale_retried: set[str] = set()
        request_priority = payload.get("priority")
        request_priority = request_priority if type(request_priority) is int else 0
        n = payload.get("n")
        sequences = n if type(n) is int and n > 0 else 1  # completions asked: the sequences it runs
        max_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens")
        max_tokens = max_tokens if type(max_tokens) is int and max_tokens > 0 else None
        while True:
            decision = self._route(payload, tokens, text, tried, sequences, max_tokens, session)
            if decision is None:
                release_global()
                why = f" (no answer from {sorted(tried)})" if tried else ""
                sink.error(503, error_body(503, "no replica is available" + why))
                return
            rid = decision.replica
            router.start(decision)
            rslot = self._replica_slot(rid)
            # The run's fair-share charge: prompt + expected completion, the router's estimate (cost + the cached
            # part of the prompt); the completion part is corrected when the answer's usage comes back (done).
            expected = router.completion_tokens
            decode = sequences * (min(float(max_tokens), expected) if max_tokens else expected)
            served = decision.cost + decision.cached_tokens
            try:
                await rslot.acquire(request_priority, sequences, run, served)
            except BaseException:
                router.finish(decision)
                raise
            if self.retired is not None and self._refused_as_retired(payload, run, sink):
                self.fair.refund(run, served)
                rslot.release(sequences)
                router.finish(decision)
                release_global()
                return
            sent_at = time.monotonic()
            info = state.routable.get(rid)  # read after any wait: it may have left or been ejected meanwhile
            try:
                if info is None:
                    raise UpstreamError("the replica left", retryable=True, connect=True)
                ex = await self.send(info, path, body if info.priority_scheduling else without_priority(body, payload))
            except UpstreamError as exc:
                self.fair.refund(run, served)  # not served: charged again wherever it goes next
                rslot.release(sequences)
                router.finish(decision)
                self.upstream_errors[rid] = self.upstream_errors.get(rid, 0) + 1
                if exc.reused and rid not in stale_retried:
                    # A kept-alive connection the replica had closed: the same replica, on a fresh connection.
                    stale_retried.add(rid)
                    self.retries["stale_connection"] += 1
                    continue
                self.retries["connect" if exc.connect else "reset_before_answer"] += 1
                log.warning("replica %s failed before answering (%s); trying another replica", rid, exc)
                tried.add(rid)
                self.on_failure(rid, str(exc))
                continue
            except BaseException:
                self.fair.refund(run, served)
                rslot.release(sequences)
                router.finish(decision)
                raise
            break
        state.answered(rid, sent_at)  # it answered: alive, however slow its /health

        def done(ok: bool) -> None:
            rslot.release(sequences)
            release_global()
            completion = completion_tokens(ex.tail) if ok and ex.length is not None else None
            router.finish(decision, completion)
            if completion is not None:
                self.fair.correct(run, completion - decode)
            if not ok:
                self.broken_answers += 1
                self.upstream_errors[rid] = self.upstream_errors.get(rid, 0) + 1

        headers = ex.headers + [(b"x-brigade-replica", rid.encode()), (b"x-brigade-route", decision.kind.encode())]
        sink.start(ex.status, headers, ex.length)
        sink.exchange = ex  # the sink cancels it if the client leaves
        ex.attach(sink, done)

    def _refused_as_retired(self, payload: dict[str, Any], run: str, sink: ClientSink) -> bool:
        """Answer 409 (nothing sent) if a training generation's version is past its run's staleness window.
        Evaluations (a later priority) are of the version they name, however old: never refused."""
        model, request_priority = payload.get("model"), payload.get("priority", priority.GENERATION)
        if request_priority != priority.GENERATION or not isinstance(model, str) or self.retired is None:
            return False
        why = self.retired(model)
        if why is None:
            return False
        self.retired_requests[run] = self.retired_requests.get(run, 0) + 1
        sink.error(409, error_body(409, why, reason=ADAPTER_RETIRED))
        return True
