"""How a node reaches its next hop: the ``HopTransport`` interface and its two bindings.

- ``HttpTransport``: the HTTP binding of docs/protocol.md over one kept-alive ``httpx`` client;
- ``LocalTransport``: hop services in this process, called directly (no sockets, no threads
  beyond the shards' own). It exists so that pipelining, repair, rewind and every failure path of
  ``node.service`` can be exercised in milliseconds with fake shards; its errors go through the
  same error map (``messages.remote_error``) as an HTTP error answer does.

A transport raises ``HopFailed`` naming the hop when it cannot reach it, and the mapped error when
the hop answers one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import httpx

from meshnet.errors import HopFailed, MeshnetError
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol import http_binding
from meshnet.protocol.messages import HopAnswer, HopRequest, PrefixRequest, remote_error

__all__ = ["HopTransport", "HttpTransport", "LocalHop", "LocalTransport"]


class LocalHop(Protocol):
    """What ``LocalTransport`` calls on a hop of this process: ``node.service.NodeService``'s handlers
    (a protocol here, so the transport does not import the service that uses it)."""

    async def handle(self, request: HopRequest) -> HopAnswer | None: ...

    async def prefix(self, request: PrefixRequest) -> HopAnswer: ...

    async def delete(self, sid: SessionId, ticket: str | None = None) -> None: ...

    async def receive_snapshot(self, sid: SessionId, ticket: str | None, body: bytes) -> dict[str, Any]: ...

    async def drop_snapshot(self, sid: SessionId, ticket: str | None) -> None: ...


class HopTransport(Protocol):
    async def send(self, hop: str, request: HopRequest | PrefixRequest, *, timeout_s: float) -> HopAnswer: ...

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> None:
        """Free the session on ``hop`` (and down the chain from it); failures are ignored. ``ticket``:
        the session's route ticket, which a node of a private swarm wants on a ``DELETE``."""

    async def push_snapshot(self, hop: str, session: SessionId, ticket: str, body: bytes, *, timeout_s: float) -> None:
        """Hand a KV snapshot (``node.snapshots``) to the standby at ``hop``; raises ``HopFailed``
        naming it, or the error it answered."""

    async def drop_snapshot(self, hop: str, session: SessionId, ticket: str) -> None:
        """Tell the standby at ``hop`` that the session ended: its snapshot is of no more use. Failures
        are ignored (the standby drops it at the session's idle TTL)."""

    async def aclose(self) -> None: ...


class HttpTransport:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def send(self, hop: str, request: HopRequest | PrefixRequest, *, timeout_s: float) -> HopAnswer:
        if isinstance(request, PrefixRequest):
            path, headers = http_binding.encode_prefix(request)
            body = b""
        else:
            path, headers, body = http_binding.encode_request(request)
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        try:
            response = await self.client.post(f"{hop}{path}", content=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise HopFailed(f"next hop {hop} failed: {type(exc).__name__}: {exc}", failed_hop=hop) from None
        return http_binding.answer_from_response(response, hop)

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> None:
        headers = {} if ticket is None else {H.TICKET: ticket}
        with contextlib.suppress(httpx.HTTPError):
            await self.client.delete(f"{hop}/v1/sessions/{session}", headers=headers)

    async def push_snapshot(self, hop: str, session: SessionId, ticket: str, body: bytes, *, timeout_s: float) -> None:
        headers = {H.TICKET: ticket, "Content-Type": http_binding.OCTETS}
        try:
            response = await self.client.post(
                f"{hop}/v1/snapshots/{session}", content=body, headers=headers, timeout=httpx.Timeout(timeout_s)
            )
        except httpx.HTTPError as exc:
            raise HopFailed(f"standby {hop} failed: {type(exc).__name__}: {exc}", failed_hop=hop) from None
        if response.status_code >= 400:
            raise http_binding.error_from_response(response, hop, sender_is_head=False)

    async def drop_snapshot(self, hop: str, session: SessionId, ticket: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.delete(f"{hop}/v1/snapshots/{session}", headers={H.TICKET: ticket})

    async def aclose(self) -> None:
        await self.client.aclose()


class LocalTransport:
    """Hop services of this process by URL; a URL with no service is a hop that is down."""

    def __init__(self) -> None:
        self.services: dict[str, LocalHop] = {}

    def add(self, url: str, service: LocalHop) -> None:
        self.services[url] = service

    def remove(self, url: str) -> None:
        """The hop at ``url`` is gone, as after ``kill -9``: every later request to it fails."""
        self.services.pop(url, None)

    async def send(self, hop: str, request: HopRequest | PrefixRequest, *, timeout_s: float) -> HopAnswer:
        service = self.services.get(hop)
        if service is None:
            raise HopFailed(f"next hop {hop} failed: ConnectError: nothing listens there", failed_hop=hop)
        try:
            if isinstance(request, PrefixRequest):
                return await service.prefix(request)
            answer = await service.handle(request)
        except MeshnetError as exc:
            raise remote_error(exc, sender=hop, sender_is_head=False) from None
        assert answer is not None  # only a decode-channel step answers nothing
        return answer

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> None:
        service = self.services.get(hop)
        if service is not None:
            with contextlib.suppress(MeshnetError):
                await service.delete(session, ticket)

    async def push_snapshot(self, hop: str, session: SessionId, ticket: str, body: bytes, *, timeout_s: float) -> None:
        service = self.services.get(hop)
        if service is None:
            raise HopFailed(f"standby {hop} failed: ConnectError: nothing listens there", failed_hop=hop)
        try:
            await service.receive_snapshot(session, ticket, body)
        except MeshnetError as exc:
            raise remote_error(exc, sender=hop, sender_is_head=False) from None

    async def drop_snapshot(self, hop: str, session: SessionId, ticket: str) -> None:
        service = self.services.get(hop)
        if service is not None:
            with contextlib.suppress(MeshnetError):
                await service.drop_snapshot(session, ticket)

    async def aclose(self) -> None:
        self.services.clear()
