"""Who a pool request comes from, and what it may name: run tokens, the admin token, the generation gate.

A run attaches with a token of its own (`brigade pool token`, bucket/pool.py); the pool's bucket holds
only its SHA-256, in tokens/<run_id>.json. The proxy keeps every token's hash in one dict (hash -> run id,
the admin token's hash -> ADMIN), so the generation hot path pays for one SHA-256 of a short string and
one dict lookup. A token not in the dict makes the proxy read tokens/ again, at most every
`pool_token_refresh_s` (a run given its token after the proxy started), and the whole dict is read again
every TOKENS_REREAD_S in the background, so a replaced token stops working within that.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from typing import Any, NamedTuple

from fastapi.responses import JSONResponse

from bucket import pool
from bucket.store import Store
from proxy.errors import error_response

log = logging.getLogger("brigade.proxy")

ADMIN = "\0admin"  # the caller of the pool's admin token (no run id can spell it: bucket.pool.RUN_ID)
TOKENS_REREAD_S = 30.0  # a replaced or removed token stops working within this
LORA_DIGITS = 6  # <run_id>-v000007


class Denied(NamedTuple):
    """A refusal: the HTTP status and what was wrong (a tuple, so the forwarder tells it from a run id
    without importing this module)."""

    status: int
    message: str

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message)


def bearer(authorization: bytes | str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None without one."""
    if not authorization:
        return None
    text = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
    scheme, _, token = text.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def owns(run_id: str, model: str) -> bool:
    """Whether `model` is one of `run_id`'s LoRA names (`<run_id>-v000007`): a prefix and six ASCII digits."""
    n = len(run_id)
    digits = model[n + 2 :]
    return (
        len(model) == n + 2 + LORA_DIGITS
        and model.startswith(run_id)
        and model[n : n + 2] == "-v"
        and digits.isascii()
        and digits.isdigit()
    )


def run_of(model: str) -> str:
    """The run a LoRA name `<run_id>-v000007` belongs to, "" for anything else (the base model)."""
    run_id, sep, digits = model.rpartition("-v")
    if sep and len(digits) == LORA_DIGITS and digits.isascii() and digits.isdigit() and run_id:
        return run_id
    return ""


class PoolAccess:
    """Maps bearer tokens to the run they belong to (or the admin), and says what each may name."""

    def __init__(self, store: Store, base_model: str, admin_token: str, admin_token_env: str, refresh_s: float):
        self.store = store
        self.base_model = base_model
        self.admin_token_env = admin_token_env
        self.refresh_s = refresh_s
        self._admin = {pool.token_sha256(admin_token): ADMIN} if admin_token else {}
        self._by_hash: dict[str, str] = dict(self._admin)
        self._read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None
        self._run_read_at: dict[str, float] = {}  # when each run's own token file was last read on demand

    # -- tokens ---------------------------------------------------------------------------------
    def _tokens(self) -> dict[str, str]:
        """Every run's token hash in the bucket (read off the event loop)."""
        found: dict[str, str] = {}
        for key in self.store.list(pool.TOKENS):
            name = key.rsplit("/", 1)[-1]
            if not name.endswith(".json"):
                continue
            run_id = name[: -len(".json")]
            try:
                stored = pool.read_token(self.store, run_id)
            except pool.BadRunId:
                continue  # not a run's token file
            if stored is not None:
                found[stored.sha256] = run_id  # the file's name says whose it is (its key is what a run owns)
        return found

    async def reread(self, force: bool = False) -> None:
        """Read tokens/ again (callers at once share one read); without `force`, at most every refresh_s."""
        if self._reading is None or self._reading.done():
            if not force and time.monotonic() - self._read_at < self.refresh_s:
                return
            self._read_at = time.monotonic()
            self._reading = asyncio.get_running_loop().create_task(self._read())
        await asyncio.shield(self._reading)

    async def _read(self) -> None:
        try:
            found = await asyncio.to_thread(self._tokens)
        except Exception as exc:  # noqa: BLE001 - a bucket hiccup: the tokens known so far keep working
            log.warning("could not read the run tokens from %s/%s: %s", self.store.url, pool.TOKENS, exc)
            return
        self._by_hash = {**found, **self._admin}

    def known(self, authorization: bytes | str | None) -> str | Denied | None:
        """The caller (a run id or ADMIN) of a known token; Denied without a token; None for an unknown one."""
        token = bearer(authorization)
        if token is None:
            return Denied(
                401,
                "this pool needs a token: send 'Authorization: Bearer <token>' with the run's token (printed once "
                "by `brigade pool token --pool POOL --run RUN`) or the pool's admin token "
                f"(${self.admin_token_env})",
            )
        return self._by_hash.get(hashlib.sha256(token.encode()).hexdigest())

    async def caller(self, authorization: bytes | str | None) -> str | Denied:
        """The run id (or ADMIN) a request's token belongs to, reading tokens/ again for one not known yet."""
        who = self.known(authorization)
        if who is None:
            await self.reread()
            who = self.known(authorization)
            if who is None:
                return Denied(
                    401,
                    "the bearer token is not one of this pool's: no tokens/<run>.json holds its hash and it is not "
                    f"the admin token (${self.admin_token_env}); a token replaced by `brigade pool token` stops "
                    "working: use the newest",
                )
        return who

    async def _read_run(self, authorization: bytes | str | None, run_id: str) -> None:
        """Read `run_id`'s own token file when the token is not known yet: a run that attaches just after it was
        given its token must not wait for the next reading of all of tokens/ (rate-limited, and one read of
        one small object here, at most every refresh_s per run)."""
        token = bearer(authorization)
        if token is None or self.known(authorization) is not None:
            return
        now = time.monotonic()
        if now - self._run_read_at.get(run_id, -math.inf) < self.refresh_s:
            return
        if len(self._run_read_at) > 4096:  # bounded: names sent by clients
            self._run_read_at.clear()
        self._run_read_at[run_id] = now
        try:
            stored = await asyncio.to_thread(pool.read_token, self.store, run_id)
        except (pool.BadRunId, OSError) as exc:
            log.debug("no token file for run %r: %s", run_id, exc)
            return
        if pool.token_matches(stored, token):
            self._by_hash = {**self._by_hash, pool.token_sha256(token): run_id}

    async def for_run(self, authorization: bytes | str | None, run_id: str) -> str | Denied:
        """The caller when it may act on `run_id` (its own token, or the admin's), else why not."""
        await self._read_run(authorization, run_id)
        who = await self.caller(authorization)
        if isinstance(who, Denied) or who in (ADMIN, run_id):
            return who
        return Denied(
            403,
            f"this is run {who!r}'s token: it may act only on run {who!r} (/pool/runs/{who}/...), not on run "
            f"{run_id!r}",
        )

    # -- what a caller may name -------------------------------------------------------------------
    async def generation(self, authorization: bytes | None, model: Any) -> str | Denied:
        """The generation gate: the run a request is for (from its token; for the admin, from the model's
        name, "" for the base model), or why it is refused. Nothing is forwarded when refused."""
        who = self.known(authorization)
        if who is None:
            who = await self.caller(authorization)
        if isinstance(who, Denied):
            return who
        if not isinstance(model, str):
            model = ""  # parse_generation already refused a request without a model
        if who == ADMIN:
            return run_of(model)
        if model == self.base_model or owns(who, model):
            return who
        return Denied(403, self.not_yours(who, model, "generate with"))

    def not_yours(self, who: str, model: str, verb: str) -> str:
        other = run_of(model)
        named = f"{model!r} (an adapter of run {other!r})" if other else repr(model)
        base = f"the pool's base model {self.base_model!r} or " if verb == "generate with" else ""
        return (
            f"the token of run {who!r} may {verb} only {base}the run's own adapters ({who}-v000001, ...), "
            f"not {named}; nothing was sent to the replicas"
        )

    def may_name(self, who: str, lora_name: str) -> Denied | None:
        """Whether a caller may load or unload `lora_name` (its own run's names; the admin any)."""
        if who == ADMIN or owns(who, lora_name):
            return None
        return Denied(403, self.not_yours(who, lora_name, "load or unload"))
