"""The run's side of a shared pool (issue 20; docs/design/shared_pool.md): attach, lease, detach.

With `rollout.pool_url` set, the worker generates on a pool (one proxy and its replicas serving several runs)
instead of its run's own proxy. The pool never reads this run's bucket, so the worker does what the run's own
proxy would: it asks the pool to admit the run (POST /pool/runs/{run}), keeps the admission alive
(PUT .../lease every lease_s / 3), pushes every adapter version the trainer commits (pool_publisher.py), and
detaches when it ends (DELETE /pool/runs/{run}). Each renewal carries the run's pace (bucket.pool.RunPace: its
trainer's waiting share and unread backlog, read from this run's bucket as a run's own proxy reads them,
bucket/pace.py) over the window the pool's admission answer names (`pace_window_s`; 0 or absent: none sent),
for the pool's autoscaler (docs/autoscaling.md). Each of these names the worker (`worker`): a run with several
workers stays attached until the last of them leaves. Every request to the pool, generation included, carries the
run's token (`Authorization: Bearer ...`, read from `rollout.pool_token_env`, never logged).

A refusal (the pool serves another base model, its adapter slots are full, the token is unknown or another
run's) ends the worker at once with the pool's words and what to do: retrying would only be refused again.
A pool that does not answer is retried, with back-off, for a bounded time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bucket import pool as pool_contract
from bucket.config import ConfigError
from bucket.manifest import RunManifest
from bucket.pace import RunSignals
from bucket.pool import RunPace
from bucket.store import Store

log = logging.getLogger("brigade.rollout")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})  # a pool restarting or overloaded: try again
ATTACH_RETRY_S = 120.0  # how long an unreachable pool is retried at start before the worker gives up
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0
DEFAULT_LEASE_S = 60.0  # the pool's pool_run_timeout_s default, when its answer names no lease
CONTROL_TIMEOUT_S = 30.0  # attach, lease, detach: small requests
DETACH_TIMEOUT_S = 5.0  # at the end (or on SIGTERM) the worker must not hang on a pool that is gone


class PoolRefused(ConfigError):
    """The pool said no (admission, token, a version it holds other bytes for): retrying cannot help."""


class PoolUnavailable(ConfigError):
    """The pool did not answer within the bounded retries."""


def pool_token(env: str, url: str) -> str:
    """The run's pool token from the environment variable `env`; ConfigError saying what to do when it is empty."""
    token = os.environ.get(env, "").strip() if env else ""
    if not token:
        raise ConfigError(
            f"rollout.pool_url is set ({url}) but the environment variable {env or '(rollout.pool_token_env empty)'} "
            "holds no token: put this run's pool token there (`brigade pool token --pool POOL_BUCKET --run RUN_ID` "
            "prints one), or drop rollout.pool_url to generate on the run's own proxy (rollout.proxy_url)"
        )
    return token


def auth_headers(token: str) -> dict[str, str]:
    """Headers of every request to the pool (none without a token: the run's own proxy needs none)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def answer_text(resp: httpx.Response) -> str:
    """The pool's own words from an error answer: vLLM's shape {"error": {"message": ...}} (the proxy's,
    proxy/errors.py), a `detail`/`message`, else the text."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        for key in ("detail", "message", "error"):
            if data.get(key):
                return str(data[key])[:500]
    return str(data)[:500]


def _held_by(resp: httpx.Response) -> list[str]:
    """The run's other workers still holding it, from a DELETE's answer (none: the run was detached)."""
    try:
        held = resp.json().get("held_by")
    except (ValueError, AttributeError):
        return []
    return [str(w) for w in held] if isinstance(held, list) else []


class PoolSession:
    """One run attached to one pool: its control requests, its lease, and (while it runs) its publisher."""

    def __init__(
        self,
        url: str,
        token: str,
        token_env: str,
        manifest: RunManifest,
        store: Store,
        weight: float = 1.0,
        poll_s: float = 0.5,
        attach_retry_s: float = ATTACH_RETRY_S,
        worker: str = "",
        transport: httpx.AsyncBaseTransport | None = None,  # in-process tests: the pool's app itself
    ) -> None:
        try:
            self.run_id = pool_contract.check_run_id(manifest.run_id)
        except pool_contract.BadRunId as exc:
            raise ConfigError(str(exc)) from None
        self.url, self.token_env, self.manifest, self.store = url.rstrip("/"), token_env, manifest, store
        self.weight, self.poll_s, self.attach_retry_s = weight, poll_s, attach_retry_s
        # Its own client: a lease renewal must not wait behind generations for a connection.
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=auth_headers(token), timeout=CONTROL_TIMEOUT_S, transport=transport
        )
        self.lease_s = DEFAULT_LEASE_S
        self.attachments = 0  # admissions so far: the publisher asks the pool again what is live after each one
        self.path = f"/pool/runs/{self.run_id}"
        self.worker = worker  # this worker's id: the pool detaches the run when its last worker leaves
        self.params = {"worker": worker} if worker else {}
        self.token_source = f"${token_env}"  # where the token came from, for refusals (never the token itself)
        self.pace_window_s = 0.0  # the pool's: its autoscaler reads the run's pace over this window (0: none)
        self._pace: RunSignals | None = None
        self._pace_failing = False

    # -- admission -----------------------------------------------------------------------------------------
    async def attach(self) -> dict[str, Any]:
        """Admit the run (201) or find it admitted (200, after a restart): the pool's answer. PoolRefused on a
        refusal, at once; PoolUnavailable when the pool did not answer within `attach_retry_s`."""
        body = {"base_model": self.manifest.base_model, "max_staleness": self.manifest.max_staleness}
        body["weight"] = self.weight
        if self.worker:
            body["worker"] = self.worker
        deadline = time.monotonic() + self.attach_retry_s
        delay = RETRY_FIRST_S
        while True:
            try:
                resp = await self.client.post(self.path, json=body)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code in (200, 201):
                    return self._attached(resp)
                if resp.status_code not in RETRY_STATUSES:
                    raise PoolRefused(self.refusal(resp, "refused to admit"))
                problem = f"HTTP {resp.status_code}: {answer_text(resp)}"
            if time.monotonic() + delay > deadline:
                raise PoolUnavailable(
                    f"the pool at {self.url} did not admit run {self.run_id} within {self.attach_retry_s:.0f}s "
                    f"(last: {problem}): check rollout.pool_url and that the pool's proxy runs"
                )
            log.warning("attaching to the pool at %s failed (%s); retrying in %.1fs", self.url, problem, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def _attached(self, resp: httpx.Response) -> dict[str, Any]:
        try:
            data = resp.json()
        except ValueError:
            data = {}
        data = data if isinstance(data, dict) else {}
        lease = data.get("lease_s")
        self.lease_s = float(lease) if isinstance(lease, int | float) and lease > 0 else DEFAULT_LEASE_S
        window = data.get("pace_window_s")
        self.pace_window_s = float(window) if isinstance(window, int | float) and window > 0 else 0.0
        self.attachments += 1
        log.info(
            "run %s %s the pool at %s (weight %g, max_staleness %d; lease %.0fs)",
            self.run_id,
            "joined" if resp.status_code == 201 else "is attached again to",
            self.url,
            self.weight,
            self.manifest.max_staleness,
            self.lease_s,
        )
        return data

    def refusal(self, resp: httpx.Response, what: str) -> str:
        """A refusal's message: the pool's words, then what the user can do about it."""
        said = answer_text(resp) or "(no message)"
        head = f"the pool at {self.url} {what} run {self.run_id} (HTTP {resp.status_code}: {said})"
        if resp.status_code == 401:
            return (
                f"{head}: it does not know the token in {self.token_source}; create one with `brigade pool token "
                f"--pool POOL_BUCKET --run {self.run_id}` and put it in {self.token_source}"
            )
        if resp.status_code == 403:
            return f"{head}: the token in {self.token_source} is not run {self.run_id}'s; use the one made for it"
        if resp.status_code == 409:
            return (
                f"{head}. Nothing was retried: do what the pool says (a pool serving run.base_model "
                f"{self.manifest.base_model!r}, a lower run.max_staleness, more --max-loras on its replicas), "
                "point rollout.pool_url at another pool, or drop it to use the run's own proxy"
            )
        return f"{head}: check rollout.pool_url names a brigade pool proxy"

    # -- lease ---------------------------------------------------------------------------------------------
    def read_pace(self, now: float) -> RunPace | None:
        """The run's pace over the pool's window, from this run's bucket (blocking: a few small reads, only
        what is new since the last renewal); None when the pool asks for none."""
        if self.pace_window_s <= 0:
            return None
        if self._pace is None or self._pace.window_s != self.pace_window_s:
            self._pace = RunSignals(self.store, self.manifest.num_generations, self.pace_window_s)
        self._pace.poll(now)
        return self._pace.pace(now)

    async def _pace_body(self) -> dict[str, Any] | None:
        try:
            pace = await asyncio.to_thread(self.read_pace, time.time())
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: renew without it (the pool keeps the last one)
            if not self._pace_failing:
                log.warning("reading the run's pace for the pool failed (%s: %s)", type(exc).__name__, exc)
            self._pace_failing = True
            return None
        self._pace_failing = False
        return pace.model_dump() if pace is not None else None

    async def renew(self) -> httpx.Response:
        """One renewal of the lease, carrying the run's pace when the pool asks for it."""
        resp = await self.client.put(f"{self.path}/lease", params=self.params, json=await self._pace_body())
        if resp.status_code == 200:
            try:
                refused = resp.json().get("pace_refused")
            except (ValueError, AttributeError):
                refused = None
            if refused:
                log.warning("the pool renewed the lease but not the pace: %s", refused)
        return resp

    async def keep_lease(self) -> None:
        """Renew the lease every lease_s / 3, forever; attach again when the pool no longer holds the run."""
        failing = False
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                resp = await self.renew()
            except httpx.TransportError as exc:
                if not failing:  # once per outage: the renewal runs every few seconds
                    log.warning("renewing the pool lease failed (%s: %s); retrying", type(exc).__name__, exc)
                failing = True
                continue
            if resp.status_code == 404:
                log.warning(
                    "the pool at %s no longer holds run %s (lease lapsed?): attaching again", self.url, self.run_id
                )
                await self.attach()
            elif resp.status_code in (401, 403):
                raise PoolRefused(self.refusal(resp, "refused the lease of"))
            elif resp.status_code != 200:
                if not failing:
                    log.warning("renewing the pool lease: HTTP %d %s; retrying", resp.status_code, answer_text(resp))
                failing = True
                continue
            failing = False

    async def detach(self) -> None:
        """Leave the pool (its slots are freed at once); a pool that does not answer lets the lease lapse."""
        try:
            resp = await self.client.delete(self.path, params=self.params, timeout=DETACH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            log.warning(
                "could not detach from the pool (%s: %s): it detaches run %s once its lease lapses",
                type(exc).__name__,
                exc,
                self.run_id,
            )
            return
        held_by = _held_by(resp) if resp.status_code == 200 else []
        if held_by:
            log.info("run %s stays attached to the pool for its other workers (%s)", self.run_id, ", ".join(held_by))
        elif resp.status_code in (200, 404):
            log.info("run %s detached from the pool at %s", self.run_id, self.url)
        else:
            log.warning("detaching from the pool: HTTP %d %s", resp.status_code, answer_text(resp))

    async def live(self) -> dict[str, Any] | None:
        """The pool's GET /live_adapters for this run's token (None when it could not say)."""
        try:
            resp = await self.client.get("/live_adapters")
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    # -- the whole session ---------------------------------------------------------------------------------
    async def run(self, work: Callable[[], Awaitable[None]], publish: Callable[[], Awaitable[None]]) -> None:
        """Attach, then run `work` (the worker's loop) beside the lease and `publish` (pool_publisher.py);
        detach at the end, on a stop signal too. A refusal or a hard publishing error stops `work` (its
        `finally` still writes what it scored) and is raised."""
        try:
            await self.attach()
            helpers = [
                asyncio.create_task(self.keep_lease(), name="pool-lease"),
                asyncio.create_task(publish(), name="pool-publisher"),
            ]
            main = asyncio.create_task(work(), name="rollout-worker")
            try:
                done, _ = await asyncio.wait([main, *helpers], return_when=asyncio.FIRST_COMPLETED)
                if main not in done:  # the helpers run until cancelled: one that ended failed
                    failed = next(t for t in helpers if t in done)
                    main.cancel()
                    await asyncio.gather(main, return_exceptions=True)
                    failed.result()
                    raise RuntimeError(f"{failed.get_name()} stopped")
                main.result()
            finally:
                # On a stop signal too: the worker's own `finally` runs (it writes every scored group).
                for task in [main, *helpers]:
                    task.cancel()
                await asyncio.gather(main, *helpers, return_exceptions=True)
                await self.detach()
        finally:
            await self.client.aclose()
