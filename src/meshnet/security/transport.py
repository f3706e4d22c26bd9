"""The TLS peer of each request, for ASGI apps served by uvicorn: the ASGI "tls" scope extension.

The ASGI spec's TLS extension (``scope["extensions"]["tls"]``, with ``client_cert_chain`` as PEM
strings) is how an app learns who is on the other end of a TLS connection. The uvicorn this
project pins does not fill it in, so :func:`peer_protocols` gives uvicorn protocol classes that do:
each connection's app is wrapped, once the handshake is done (``connection_made``), so that every
request and WebSocket on that connection carries the certificate its client presented. The
certificate comes from the connection's own ``ssl_object``; nothing a client sends in a header or
body can set it (``proxy_headers`` stays off on these servers for the same reason).

``RequireMember`` (``security.membership``) turns that certificate into a ``Member``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["TLS_EXTENSION", "ASGIApp", "over_tls", "peer_certificate_pem", "peer_protocols", "tls_extension"]

TLS_EXTENSION = "tls"
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def tls_extension(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> dict[str, Any]:
    """The ASGI "tls" extension of a finished handshake: the client's certificate (PEM) if it sent one."""
    der = ssl_object.getpeercert(binary_form=True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": None,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
    }


def peer_certificate_pem(scope: Scope) -> bytes | None:
    """The client certificate of the connection a request came on (PEM), ``None`` if the client sent
    none or the request did not come over TLS at all."""
    extension = (scope.get("extensions") or {}).get(TLS_EXTENSION)
    chain = extension.get("client_cert_chain") if isinstance(extension, dict) else None
    if not chain or not isinstance(chain[0], str):
        return None
    return chain[0].encode("ascii")


def over_tls(scope: Scope) -> bool:
    """Whether the request came over a TLS connection these protocols saw the handshake of."""
    return isinstance((scope.get("extensions") or {}).get(TLS_EXTENSION), dict)


def _with_peer(app: ASGIApp, transport: asyncio.BaseTransport) -> ASGIApp:
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return app
    extension = tls_extension(ssl_object)

    async def with_peer(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["extensions"] = {**(scope.get("extensions") or {}), TLS_EXTENSION: extension}
        await app(scope, receive, send)

    return with_peer


def _peer_aware(base: type[Any]) -> type[asyncio.Protocol]:
    class PeerAware(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.BaseTransport, *args: Any) -> None:
            super().connection_made(transport, *args)
            self.app: ASGIApp = _with_peer(self.app, transport)

    PeerAware.__name__ = PeerAware.__qualname__ = f"PeerAware{base.__name__}"
    return PeerAware


def peer_protocols(ws: type[Any]) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) and the WebSocket protocol ``ws``
    (a subclass of uvicorn's sans-I/O one), each filling in the "tls" extension: pass them as
    ``Config(http=..., ws=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return _peer_aware(AutoHTTPProtocol), _peer_aware(ws)
