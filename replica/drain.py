"""A stopped replica's drain: finish the proxy's work here, then go.

The sidecar registers as draining; the proxy then sends no new group here,
only the siblings of groups already here. When the drain ends is the proxy's
word (bucket/replicas.py, DrainRelease): vLLM's running/waiting gauges read
0 between two siblings of a group sent as n = 1 requests, so they cannot
tell that more is coming; the proxy can. Once the proxy says `released`
(nothing of its traffic in flight or expected here, and it routes nothing
more here) and vLLM has nothing running or waiting, the drain ends.

When no proxy says anything within `drain_s` + NO_PROXY_AFTER_S (no proxy
reads this registry, or it was stopped first, as `brigade local` does at
the end), or the proxy's word stops being rewritten for PROXY_SILENT_S (it
rewrites it at each registry read; one that died mid-drain does not), vLLM's
gauges are all there is: the drain ends once they read idle for
DRAIN_IDLE_S. At most `drain_timeout_s` in any case, and a second signal
ends it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from bucket import replicas
from bucket.replicas import DrainRelease, ReplicaInfo
from bucket.store import Store
from replica.vllm_server import VllmServer

log = logging.getLogger("brigade.replica")

DRAIN_POLL_S = 0.25  # how often a draining replica reads the proxy's word and vLLM's running and waiting requests
# Without a proxy's word, idle for this long before the drain ends: a request the proxy held for a free slot
# here is sent the moment one frees, so a single read of 0 between two requests proves nothing.
DRAIN_IDLE_S = 1.0
NO_PROXY_AFTER_S = 2.0  # no word from a proxy this long after it had drain_s to notice: none is watching
PROXY_SILENT_S = 10.0  # a proxy's word not rewritten for this long (it does at every registry read): it is gone


@dataclass
class DrainResult:
    outcome: str  # released (the proxy's word), idle (no proxy: vLLM's gauges), timeout, stopped, vllm_exited
    seconds: float

    @property
    def drained(self) -> bool:
        return self.outcome in ("released", "idle")

    def fields(self) -> dict[str, object]:
        """For the replica_stopped event."""
        return {"drained": self.drained, "drain": self.outcome, "drain_s": self.seconds}


def wait_drained(
    server: VllmServer,
    store: Store,
    info: ReplicaInfo,
    *,
    drain_s: float,
    drain_timeout_s: float,
    stop: threading.Event,
) -> DrainResult:
    """Block until the work here is done (see the module's docstring), `drain_timeout_s` passed or `stop` set."""
    t0 = time.monotonic()
    deadline, unwatched_at = t0 + drain_timeout_s, t0 + drain_s + NO_PROXY_AFTER_S
    word: DrainRelease | None = None
    word_changed_at = t0  # on this clock: the proxy's `at` is on its own
    idle_since: float | None = None
    outcome = "timeout"
    while not stop.is_set():
        if not server.alive():
            outcome = "vllm_exited"
            break
        if word is None or not word.released:
            try:
                read = replicas.read_drain(store, info)
            except Exception as exc:  # a bucket hiccup: read again at the next poll
                log.warning("could not read the proxy's drain entry: %s", exc)
                read = None
            if read is not None and (word is None or read.at != word.at):
                word, word_changed_at = read, time.monotonic()
        now = time.monotonic()
        busy = server.requests(timeout_s=2.0)
        idle_since = (idle_since or now) if busy == 0 else None
        if word is not None and word.released and busy == 0:
            outcome = "released"
            break
        unwatched = now >= unwatched_at if word is None else now - word_changed_at >= PROXY_SILENT_S
        if unwatched and idle_since is not None and now - idle_since >= DRAIN_IDLE_S:
            outcome = "idle"
            break
        if now >= deadline:
            break
        stop.wait(DRAIN_POLL_S)
    else:
        outcome = "stopped"  # a second signal
    result = DrainResult(outcome, round(time.monotonic() - t0, 1))
    if outcome == "released":
        log.info("drained in %.1fs: the proxy has nothing more here and vLLM nothing running", result.seconds)
    elif outcome == "idle":
        log.info("drained in %.1fs: no proxy said anything; vLLM has nothing running or waiting", result.seconds)
    elif outcome == "stopped" and server.alive() and server.requests(timeout_s=2.0) == 0:
        # `brigade local` ending: the proxy and the workers stopped first, then a second signal
        log.info("stopped after %.1fs of drain (a second signal); vLLM had nothing running", result.seconds)
    else:
        log.warning("drain ended after %.1fs (%s); requests still running are cut", result.seconds, outcome)
    return result
