"""Error answers in vLLM's own JSON shape, so OpenAI-style clients surface the proxy's message."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    422: "UnprocessableEntityError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_dict(status: int, message: str, **extra: Any) -> dict[str, Any]:
    """An error in vLLM's own shape; `extra` adds top-level fields (per-replica details)."""
    body = {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "ProxyError"), "param": None, "code": status}
    }
    return {**body, **extra}


def error_body(status: int, message: str, **extra: Any) -> bytes:
    return json.dumps(error_dict(status, message, **extra)).encode()


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(error_dict(status, message, **extra), status_code=status)
