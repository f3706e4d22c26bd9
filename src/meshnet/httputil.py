"""The HTTP face of the exception tree, shared by every Meshnet server (gateway, node, tracker).

One JSON error shape everywhere — OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` —
with the status from ``MeshnetError.status`` and ``Retry-After`` when the error carries one.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
import urllib.parse
from typing import Any

import httpx
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet.errors import InvalidRequest, MeshnetError, NotFound, PayloadTooLarge

__all__ = [
    "CLIENT_KEEP_ALIVE_S",
    "EXCEPTION_HANDLERS",
    "SERVER_KEEP_ALIVE_S",
    "check_declared_length",
    "error_body",
    "error_field",
    "error_message",
    "error_response",
    "is_wildcard",
    "read_body",
    "service_url",
    "tls_or_default",
]


# A server keeps an idle connection open longer than any Meshnet client keeps one for reuse. The
# other way round a client sends on a connection the server is closing ("Server disconnected
# without sending a response"): with uvicorn's 5 s default and nodes heartbeating every 5 s, a
# node lost a heartbeat every minute or two, and a gateway's tracker call failed a request.
SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEP_ALIVE_S = 60


@functools.cache
def _default_tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def tls_or_default(tls: ssl.SSLContext | None) -> ssl.SSLContext:
    """What a client checks its server with: ``tls`` (a swarm's member TLS), else the system's CAs
    in one context built once per process. httpx builds a fresh one for every client made without
    one (the CA bundle read and parsed: ~20 ms with the GIL held, a stall of every token the
    process is streaming)."""
    return tls if tls is not None else _default_tls()


def check_declared_length(request: Request, limit: int, who: str) -> None:
    """A 413 for a body whose ``Content-Length`` is past ``limit``, before any of it is read;
    ``who`` names the server in the message."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds {who}'s limit of {limit} bytes")


async def read_body(request: Request, limit: int, who: str) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes: first by its ``Content-Length``
    (before reading anything), then while it streams in, so a chunked upload that declares no
    length cannot fill the memory either. ``who`` names the server in the message."""
    check_declared_length(request, limit, who)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds {who}'s limit of {limit} bytes (streamed past it)")
        chunks.append(chunk)
    return b"".join(chunks)


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is ``0.0.0.0`` / ``::``: "every interface" to the one that binds it, no
    address a peer can dial (a DNS name never is)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def service_url(raw: str) -> str:
    """``raw`` as a service's base URL, ``http(s)://HOST:PORT`` and nothing else (hops append their
    paths), or ``ValueError`` saying what to fix: a host every peer can dial (never ``0.0.0.0`` or
    ``::``, which only mean "every interface" to the one that binds them), an explicit port, no
    credentials, path, query or fragment."""
    try:
        parsed = urllib.parse.urlsplit(raw.strip())
        port = parsed.port
    except ValueError as exc:
        raise ValueError(f"{raw!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{raw!r} must look like http://HOST:PORT")
    if port is None or port == 0:
        raise ValueError(f"{raw!r} needs an explicit port (http://HOST:PORT)")
    if parsed.username is not None or parsed.path.strip("/") or parsed.query or parsed.fragment:
        raise ValueError(f"{raw!r} must be only scheme, host and port (no user, path, query or fragment)")
    if is_wildcard(parsed.hostname):
        raise ValueError(
            f"{raw!r} names the wildcard address {parsed.hostname}, which no peer can dial: advertise this "
            "machine's reachable address instead"
        )
    return f"{parsed.scheme}://{parsed.netloc}"


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
