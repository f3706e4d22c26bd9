"""Who may reach the gateway through a browser: the ``Host`` and ``Origin`` checks (issue 28).

A gateway on loopback without keys trusts whoever can reach the port, and a web page can reach it
in two ways this module closes:

- **DNS rebinding**: a page at ``http://evil.example:8000`` whose name the attacker then points at
  127.0.0.1 talks to the gateway as its own origin, reading every answer. Its requests carry
  ``Host: evil.example:8000``. ``HostPolicy`` refuses (403) a request whose ``Host`` is not a name
  of this gateway: an IP literal (a browser that dialled an address names it; no DNS is involved,
  so nothing can rebind), ``localhost`` (and ``*.localhost``, which resolve to loopback by
  definition), or a name given with ``--allowed-host`` (a reverse proxy's public name).
- **Cross-origin requests**: a page on any other origin (another port of the same host included)
  may send a "simple" POST without a preflight, e.g. a chat completion in a ``text/plain`` body.
  Browsers name the sender in ``Origin``; a request whose ``Origin`` is not the gateway's own
  (``scheme://`` + its ``Host``; ``null`` included) is refused (403). Clients that are not browsers
  send no ``Origin`` and are not affected, nor is the dashboard (same origin).

Both answers are OpenAI-shaped 403s (``permission_error``) naming the header at fault.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from meshnet.errors import Forbidden
from meshnet.httputil import error_response

__all__ = ["HostPolicy", "OriginGuard", "host_name"]


def host_name(host: str) -> str:
    """The name or address of a ``Host`` header value, lower case, without its port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """The names this gateway answers to besides IP literals and ``localhost`` (``--allowed-host``)."""

    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: Iterable[str]) -> HostPolicy:
        return cls(frozenset(host_name(n) for n in names if n.strip()))

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return _is_ip(name) or name == "localhost" or name.endswith(".localhost") or name in self.names


class OriginGuard:
    """Refuses a request whose ``Host`` the policy does not allow (``hosts`` None: any ``Host``, for
    apps embedded in tests), or whose ``Origin`` is not the gateway's own."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(headers.get("host", ""), headers.get("origin"))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no such endpoint on a gateway; refuse before any accept
            await send({"type": "websocket.close", "code": 1008})
            return
        await error_response(refusal)(scope, receive, send)

    def _refusal(self, host: str, origin: str | None) -> Forbidden | None:
        if self.hosts is not None and host and not self.hosts.allows(host):
            return Forbidden(
                f"Host {host[:100]!r} is not a name of this gateway (an IP address, localhost, or one given with "
                "--allowed-host): refused, as a DNS-rebinding page would be",
                param="Host",
            )
        if origin is None:
            return None
        parsed = urllib.parse.urlsplit(origin.strip())
        if origin.strip().lower() == "null" or not parsed.netloc or parsed.netloc.lower() != host.strip().lower():
            return Forbidden(
                f"a request from the web page at {origin[:100]!r} is refused: only this gateway's own pages may "
                "call it from a browser",
                param="Origin",
            )
        return None
