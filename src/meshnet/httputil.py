"""The HTTP face of the exception tree, shared by every Meshnet server (gateway, node, tracker).

One JSON error shape everywhere — OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` —
with the status from ``MeshnetError.status`` and ``Retry-After`` when the error carries one.
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet.errors import InvalidRequest, MeshnetError, NotFound

__all__ = ["EXCEPTION_HANDLERS", "error_body", "error_field", "error_message", "error_response"]


def error_body(error: MeshnetError) -> dict[str, Any]:
    body: dict[str, Any] = {
        "message": error.message,
        "type": error.error_type,
        "param": error.param,
        "code": error.code,
    }
    if error.failed_hop is not None:
        body["failed_hop"] = error.failed_hop
    return {"error": body}


def error_field(response: httpx.Response, key: str) -> Any:
    """One field of a Meshnet error answer (``code``, ``failed_hop`` ...), or ``None``."""
    try:
        return response.json()["error"].get(key)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def error_response(error: MeshnetError, headers: dict[str, str] | None = None) -> JSONResponse:
    retry = getattr(error, "retry_after_s", None)
    extra = {"Retry-After": str(retry)} if retry is not None else {}
    return JSONResponse(error_body(error), status_code=error.status, headers={**extra, **(headers or {})})


def error_message(response: httpx.Response) -> str:
    """The message of an error answer from any Meshnet server (or its raw text if it is not one)."""
    message = error_field(response, "message")
    return str(message) if message is not None else f"HTTP {response.status_code}: {response.text[:200]}"


async def _meshnet_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, MeshnetError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error: MeshnetError = NotFound(f"no route {request.method} {request.url.path}")
    else:
        error = InvalidRequest(f"{request.method} {request.url.path}: {exc.detail}")
        error.status = exc.status_code
    return error_response(error)


EXCEPTION_HANDLERS: dict[Any, Any] = {MeshnetError: _meshnet_error, HTTPException: _http_error}
