"""Error answers in vLLM's own JSON shape, so OpenAI-style clients surface the proxy's message."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    """An error in vLLM's own shape; `extra` adds top-level fields (per-replica details)."""
    body = {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "ProxyError"), "param": None, "code": status}
    }
    return JSONResponse({**body, **extra}, status_code=status)
