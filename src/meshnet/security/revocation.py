"""Revoked member certificates: the swarm's list, and the guard that refuses them.

``meshnet swarm revoke ID --dir DIR`` (:func:`revoke_member`) looks the member's current
certificate serial up in the registry (``members.json``) and adds it to ``revoked.json`` beside
it, atomically. The tracker re-reads that file when it changes (:class:`RevocationList`), so a
revocation takes effect on a running tracker at the member's next request: every endpoint
answers 401 ``certificate_revoked``, a join that reuses the id with the old key too, and a
revoked node leaves the routes at once. Nodes learn the serials from the tracker (in the answer
to each heartbeat registration, or ``GET /v1/swarm/revoked``) and refuse revoked peers with
:class:`RefuseRevoked`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from cryptography import x509

from meshnet.errors import InvalidRequest, Unauthorized
from meshnet.fsutil import write_atomic
from meshnet.httputil import error_response
from meshnet.security.transport import ASGIApp, Scope, peer_certificate_pem

__all__ = [
    "CODE_REVOKED",
    "REVOKED_FILE",
    "REVOKED_PATH",
    "RefuseRevoked",
    "RevocationList",
    "RevokedSerials",
    "revoke_member",
    "revoked_error",
]

REVOKED_FILE = "revoked.json"
REVOKED_PATH = "/v1/swarm/revoked"
CODE_REVOKED = "certificate_revoked"
MAX_REVOKED = 100_000  # serials a node takes from the tracker
_VERSION = 1
_CACHE_SIZE = 1024


def revoked_error(member_id: str) -> Unauthorized:
    return Unauthorized(
        f"the certificate of member {member_id!r} is revoked in this swarm; ask its admin for a new invite "
        "(and join with a new key)",
        code=CODE_REVOKED,
    )


class RevocationList:
    """``revoked.json`` of a swarm directory: serial (hex) -> who and when. Re-read when the file
    changes, so a tracker sees what ``meshnet swarm revoke`` wrote while it runs."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / REVOKED_FILE
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._entries: dict[str, dict[str, Any]] = {}

    def entries(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self._stamp, self._entries = None, {}
                return {}
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._entries, self._stamp = _read(self.path), stamp
            return self._entries

    def serials(self) -> frozenset[str]:
        return frozenset(self.entries())

    def add(self, serial: str, member_id: str) -> None:
        with self._lock:
            entries = _read(self.path) if self.path.exists() else {}
            entries[serial] = {"member_id": member_id, "revoked_at": int(time.time())}
            body = {"v": _VERSION, "revoked": dict(sorted(entries.items()))}
            write_atomic(self.path, json.dumps(body, indent=1).encode())
            self._stamp = None


def revoke_member(directory: Path, member_id: str) -> str:
    """Revoke the current certificate of ``member_id`` in the swarm at ``directory``; its serial.
    ``InvalidRequest`` for an id the swarm's registry does not know."""
    registry = Path(directory) / "members.json"
    try:
        members = json.loads(registry.read_bytes())["members"]
        entry = members.get(member_id)
    except FileNotFoundError:
        raise InvalidRequest(f"{registry} does not exist: is {directory} a swarm directory?") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"{registry} is not a Meshnet member registry: {exc}") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("serial"), str):
        known = ", ".join(sorted(members)) if isinstance(members, dict) else ""
        raise InvalidRequest(f"no member {member_id!r} in {registry} (members: {known or 'none'})", param="id")
    RevocationList(directory).add(entry["serial"], member_id)
    return str(entry["serial"])


class RevokedSerials:
    """The revoked serials a node holds (what the tracker last said); replaced as a whole."""

    def __init__(self) -> None:
        self.serials: frozenset[str] = frozenset()

    def update(self, serials: Iterable[object]) -> None:
        self.serials = frozenset(s for s in list(serials)[:MAX_REVOKED] if isinstance(s, str) and len(s) <= 64)


class RefuseRevoked:
    """ASGI middleware of a node: a request over a connection whose client certificate is revoked
    is a 401 ``certificate_revoked`` (a WebSocket is closed with 1008)."""

    def __init__(self, app: ASGIApp, revoked: RevokedSerials) -> None:
        self.app = app
        self.revoked = revoked
        self._serials: dict[bytes, str] = {}

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] in ("http", "websocket") and self.revoked.serials:
            pem = peer_certificate_pem(scope)
            serial = self._serial(pem) if pem is not None else None
            if serial is not None and serial in self.revoked.serials:
                exc = Unauthorized("your certificate is revoked in this swarm", code=CODE_REVOKED)
                if scope["type"] == "websocket":
                    from starlette.websockets import WebSocketClose

                    await WebSocketClose(code=1008, reason=exc.message)(scope, receive, send)
                else:
                    await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _serial(self, pem: bytes) -> str | None:
        serial = self._serials.get(pem)
        if serial is None:
            try:
                serial = format(x509.load_pem_x509_certificate(pem).serial_number, "x")
            except ValueError:
                return None
            if len(self._serials) >= _CACHE_SIZE:
                self._serials.clear()
            self._serials[pem] = serial
        return serial


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_bytes())
        entries = data["revoked"] if data.get("v") == _VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"{path} is not a Meshnet revocation list: {exc}") from None
    if not isinstance(entries, dict):
        raise InvalidRequest(f"{path} is not a Meshnet revocation list (version {_VERSION})")
    return entries
