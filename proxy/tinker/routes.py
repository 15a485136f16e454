"""The Tinker API's HTTP face: which `/api/v1/<name>` the SDK 0.38 calls maps to what (docs/tinker.md's table).

Every call is `POST` (a few `GET`) under /api/v1 with an `X-API-Key` header. Errors are JSON bodies with
`error` (and `detail`, which the SDK's exceptions print): an unknown route answers 404, a call brigade cannot
honour 400 naming what to change. The API is served only on a run whose run.json says `api: "tinker"`, and
not on a shared pool (one run per proxy: a pool's runs would each need their own models and samplers).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proxy.tinker import training
from proxy.tinker.service import TinkerService
from proxy.tinker.training import PROTOBUF, Refused
from proxy.tinker.wire import WireError, decode_forward_backward

PREFIX = "/api/v1/"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "detail": message}, status_code=status)


def authorized(api_key: str | None, token: str) -> bool:
    """With a token configured, the SDK's key must be it, with or without the `tml-` prefix the SDK insists on."""
    if not token:
        return True
    key = (api_key or "").strip()
    given = key.removeprefix("tml-")
    return hmac.compare_digest(given.encode(), token.encode()) or hmac.compare_digest(key.encode(), token.encode())


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise Refused(f"{request.url.path} takes a JSON body ({str(exc)[:200]})") from exc
    if not isinstance(body, dict):
        raise Refused(f"{request.url.path} takes a JSON object")
    return body


def _client_config() -> dict[str, Any]:
    # The SDK's transport and protocol switches: plain httpx (no pyqwest), no JWT exchange, uncompressed protobuf,
    # forward_backward chunks one after another, one retrieve_future per request, losses on the client.
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "parallel_fwdbwd_chunks": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


def tinker_endpoint(
    service: Callable[[], TinkerService | None], refusal: Callable[[], str | None], token: str
) -> Callable[[Request], Awaitable[Response]]:
    """The one endpoint under /api/v1/: auth, then the route's handler. `refusal()` says why this proxy serves
    no Tinker API (a GRPO run, a pool), or None."""

    async def endpoint(request: Request) -> Response:
        why = refusal()
        if why is not None:
            return error(404, why)
        if not authorized(request.headers.get("x-api-key"), token):
            return error(401, "the X-API-Key is not this proxy's token: pass api_key='tml-<token>' to the SDK")
        svc = service()
        assert svc is not None
        name = request.url.path.removeprefix(PREFIX).strip("/")
        try:
            return await _route(svc, request, name)
        except Refused as exc:
            return error(400, str(exc))
        except WireError as exc:
            return error(400, str(exc))

    return endpoint


async def _route(svc: TinkerService, request: Request, name: str) -> Response:
    method = request.method
    if method == "GET":
        if name == "healthz":
            return JSONResponse({"status": "ok"})
        if name == "get_server_capabilities":
            m = svc.manifest
            models = [{"model_name": m.base_model, "trainable": True, "sampleable": True}]
            return JSONResponse({"supported_models": models})
        if name.startswith("samplers/"):
            return svc.sampler_info(name.removeprefix("samplers/"))
        return error(404, f"GET /api/v1/{name} is not a Tinker API route brigade serves")
    if name == "forward_backward":
        return await _forward_backward(svc, request)
    if name.startswith("sessions/") and name.endswith("/finish"):
        await svc.finish(name.removeprefix("sessions/").removesuffix("/finish"))
        return JSONResponse({})
    handler = _JSON_ROUTES.get(name)
    if handler is None:
        return error(404, f"POST /api/v1/{name} is not a Tinker API route brigade serves")
    answer = await handler(svc, await _json(request))
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def _forward_backward(svc: TinkerService, request: Request) -> Response:
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise Refused(
            f"forward_backward takes a protobuf body ({PROTOBUF}), as the tinker SDK 0.38 sends it; JSON is refused"
        )
    body = await request.body()
    if request.headers.get("content-encoding", "") == "zstd":
        raise Refused("a zstd-compressed forward_backward: this server's client config turns compression off")
    model_id, seq, loss_fn, config, forward_only, data = decode_forward_backward(body)
    kind = "forward" if forward_only else "forward_backward"
    op = training.TinkerOp(
        model_id=model_id, seq_id=seq, kind=kind, data=data, loss_fn=loss_fn, loss_fn_config=config or None
    )
    return JSONResponse(await svc.submit(op))


Handler = Callable[[TinkerService, dict[str, Any]], Awaitable[Response | dict[str, Any]]]


async def _optim_step(svc: TinkerService, body: dict[str, Any]) -> dict[str, Any]:
    op, refused = training.optim_step_op(body)
    return await svc.submit(op, refused)


async def _load_weights(svc: TinkerService, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("model_id") is None:
        return await svc.create_model(body, from_state=True)
    return await svc.submit(training.load_op(body))


async def _retrieve(svc: TinkerService, body: dict[str, Any]) -> Response:
    request_id = body.get("request_id")
    if not isinstance(request_id, str):
        raise Refused("retrieve_future needs a request_id")
    return await svc.retrieve(request_id)


async def _heartbeat(svc: TinkerService, body: dict[str, Any]) -> Response:
    return svc.heartbeat(str(body.get("session_id")))


async def _get_info(svc: TinkerService, body: dict[str, Any]) -> Response:
    return await svc.get_info(str(body.get("model_id")))


async def _cancel(svc: TinkerService, body: dict[str, Any]) -> dict[str, Any]:
    ids = body.get("request_ids") or ([body["request_id"]] if "request_id" in body else [])
    svc.cancel([str(i) for i in ids])
    return {}


async def _constant(answer: dict[str, Any]) -> dict[str, Any]:
    return answer


_JSON_ROUTES: dict[str, Handler] = {
    "client/config": lambda svc, body: _constant(_client_config()),
    "client/dynamic_config": lambda svc, body: _constant({"sample_cancel_enabled": False}),
    "create_session": lambda svc, body: _constant(svc.create_session()),
    "session_heartbeat": _heartbeat,
    "telemetry": lambda svc, body: _constant({"status": "accepted"}),  # accepted and dropped
    "create_model": lambda svc, body: svc.create_model(body),
    "get_info": _get_info,
    "optim_step": _optim_step,
    "save_weights": lambda svc, body: svc.submit(training.save_op(body, "save_weights")),
    "save_weights_for_sampler": lambda svc, body: svc.submit(training.save_op(body, "save_weights_for_sampler")),
    "load_weights": _load_weights,
    "create_sampling_session": lambda svc, body: svc.create_sampler(body),
    "asample": lambda svc, body: svc.asample(body),
    "sample": lambda svc, body: svc.asample(body),
    "retrieve_future": _retrieve,
    "cancel_future": _cancel,
}
