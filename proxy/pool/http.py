"""The pool's own HTTP routes (/pool/runs/...), mounted by app.py's `create_app` when the proxy serves a pool.

Each checks the caller first (a run's token acts only on its own run; the admin's on any), then reads the
body: a push of another run's files is refused before a byte of it is held.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from bucket import pool
from bucket.pool import RunPace
from proxy.pool.access import Denied
from proxy.pool.push import MAX_FILE_BYTES, too_large
from proxy.pool.service import Pool

Endpoint = Callable[[Request], Awaitable[Response]]


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack ("[[[[...")
        return None


async def _pace(request: Request) -> tuple[RunPace | None, str | None]:
    """A lease renewal's body: the run's pace (none: an empty body), or why it was not taken. A body the pool
    cannot read never fails the renewal: a lapsed lease would unload the run's adapters over a signal."""
    raw = await request.body()
    if not raw.strip():
        return None, None
    try:
        return RunPace.model_validate_json(raw), None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        return None, f"the pace in the body was not taken ({problems}); the lease was renewed"


def pool_routes(p: Pool) -> list[tuple[str, str, Endpoint]]:
    """(path, method, endpoint) of every pool route, bound to `p`."""

    async def authorized(request: Request) -> str | Denied:
        run_id = request.path_params["run_id"]
        try:
            pool.check_run_id(run_id)
        except pool.BadRunId as exc:
            return Denied(400, str(exc))
        who = await p.access.for_run(request.headers.get("authorization"), run_id)
        return who if isinstance(who, Denied) else run_id

    async def attach(request: Request) -> Response:
        run_id = await authorized(request)
        if isinstance(run_id, Denied):
            return run_id.response()
        result = await p.runs.admit(run_id, await _json(request))
        if isinstance(result, Denied):
            return result.response()
        status, body = result
        return JSONResponse(body, status_code=status)

    async def lease(request: Request) -> Response:
        run_id = await authorized(request)
        if isinstance(run_id, Denied):
            return run_id.response()
        pace, refused = await _pace(request)
        until = await p.runs.renew(run_id, request.query_params.get("worker", "")[:200], pace)
        if until is None:
            return Denied(
                404,
                f"run {run_id} is not attached (its lease lapsed, it left, or the pool never admitted it): "
                f"attach again with POST /pool/runs/{run_id}",
            ).response()
        return JSONResponse({"lease_until": until, **({"pace_refused": refused} if refused else {})})

    async def detach(request: Request) -> Response:
        run_id = await authorized(request)
        if isinstance(run_id, Denied):
            return run_id.response()
        return JSONResponse(await p.runs.leave(run_id, request.query_params.get("worker", "")[:200]))

    async def put_file(request: Request) -> Response:
        run_id = await authorized(request)
        if isinstance(run_id, Denied):
            return run_id.response()
        version, file = request.path_params["version"], request.path_params["file"]
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_FILE_BYTES:  # refused before the body is held
            return too_large(int(length), file).response()
        return await p.push.put_file(run_id, version, file, await request.body())

    async def commit(request: Request) -> Response:
        run_id = await authorized(request)
        if isinstance(run_id, Denied):
            return run_id.response()
        return await p.push.commit(run_id, request.path_params["version"], await _json(request))

    base = "/pool/runs/{run_id}"
    return [
        (base, "POST", attach),
        (base, "DELETE", detach),
        (f"{base}/lease", "PUT", lease),
        (f"{base}/adapters/{{version}}/{{file}}", "PUT", put_file),
        (f"{base}/adapters/{{version}}/commit", "POST", commit),
    ]
