"""The hop client: how a node reaches its next hop and how the gateway reaches every hop of a route.

One interface, ``HopTransport``, for both callers, in two bindings:

- ``HttpTransport``: the HTTP binding of docs/protocol.md over one kept-alive ``httpx`` client, and
  (the gateway's) decode-channel steps over kept-open WebSockets (``protocol.channel_client``);
- ``LocalTransport``: hop services in this process, called directly (no sockets, no threads beyond
  the shards' own). It exists so that pipelining, repair, rewind, snapshots, prefix reuse and every
  failure path of the node service *and* of the gateway's route engine run in milliseconds over fake
  shards; its errors go through the same error map (``errors.hop_error``) as an HTTP error answer.

Who asks decides what an error means (``errors.hop_error``). A node asks its next hop
(``downstream=None``): any error of that hop's own is that hop's failure. The gateway asks a hop of
a route (``downstream``: that hop and the hops after it to the tail, in order: the ones it may name as failed): an error
of the head's own is the gateway's 502, and a hop naming one outside ``downstream`` has failed itself.

A transport raises ``HopFailed`` naming the hop when it cannot reach it, and the mapped error when
the hop answers one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import httpx

from meshnet.errors import HopFailed, MeshnetError, hop_error
from meshnet.httputil import error_field, error_message
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol import http_binding
from meshnet.protocol.channel import Credit, Direct, InOrder
from meshnet.protocol.channel_client import Channels, ChannelUnavailable, Probe, StepSlot, no_entry, silent_hop
from meshnet.protocol.ledger import parse_chunks
from meshnet.protocol.messages import (
    Accepted,
    HopAnswer,
    HopRequest,
    PrefixRequest,
    RerouteRequest,
    RestoreRequest,
    answer_from_json,
    remote_error,
)
from meshnet.protocol.wire import TensorFrame, parse_shape

__all__ = ["HopTransport", "HttpTransport", "LocalHop", "LocalTransport", "Sendable", "acknowledged", "seq_probe"]

Sendable = HopRequest | PrefixRequest | RerouteRequest | RestoreRequest
_RETRIED = frozenset({408, 409, 425, 429})


def acknowledged(status: int) -> bool | None:
    """What a ``DELETE``'s status means to whoever must see the session closed: True, closed (or
    nothing to close: 404, 410); False, retry (409 still computing, 408/425/429, 5xx); None, give
    up (any other 4xx, a refused ticket: it will not change)."""
    if status < 300 or status in (404, 410):
        return True
    if status in _RETRIED or status >= 500:
        return False
    return None


class LocalHop(Protocol):
    """What ``LocalTransport`` calls on a hop of this process: ``node.service.NodeService``'s handlers
    (a protocol here, so the transport does not import the service that uses it). The caller is one
    the transport vouches for (``caller=None``)."""

    async def handle(self, request: HopRequest, direct: Direct | None = None) -> HopAnswer: ...

    async def prefix(self, request: PrefixRequest) -> HopAnswer: ...

    async def reroute(self, request: RerouteRequest) -> HopAnswer: ...

    async def restore(self, request: RestoreRequest) -> HopAnswer: ...

    async def delete(self, sid: SessionId, ticket: str | None = None) -> None: ...

    def session_state(self, sid: SessionId) -> dict[str, Any]: ...

    def seam_log(self, sid: SessionId) -> tuple[TensorFrame, tuple[int, ...]]: ...

    async def snapshot(self, sid: SessionId, ticket: str | None) -> dict[str, Any]: ...

    async def receive_snapshot(self, sid: SessionId, ticket: str | None, body: bytes) -> dict[str, Any]: ...

    async def drop_snapshot(self, sid: SessionId, ticket: str | None) -> None: ...

    def take_credit(self, credit: Credit) -> None: ...

    async def relay(self, sid: SessionId, direct: Direct, answer: HopAnswer) -> int | None: ...


class HopTransport(Protocol):
    async def send(
        self, hop: str, request: Sendable, *, timeout_s: float, downstream: Sequence[str] | None = None
    ) -> HopAnswer:
        """``request``'s answer from ``hop``. ``downstream``: the caller is the gateway, and these are
        the hops ``hop`` may name as failed (module docstring)."""
        ...

    async def start_step(
        self, route: Sequence[str], request: HopRequest, *, timeout_s: float, slot: StepSlot | None = None
    ) -> asyncio.Future[HopAnswer] | None:
        """Send a decode step over the decode channel to the route of nodes at ``route`` (head first),
        as ``slot``'s step if given (``reserve_step``); the future of the tail's answer, which comes
        straight back (cancel it when the answer is of no more use). ``None``: a node of the route
        takes no channel (nothing was sent: ``send`` it instead). A session's steps reach every hop
        in the order they were started (pipelined speculation keeps several in flight)."""
        ...

    async def reserve_step(self, route: Sequence[str], session: SessionId, *, timeout_s: float) -> StepSlot | None:
        """A decode-channel step's number and answer before it is sent (``Channels.reserve``): for
        ``start_step``, or for the route's tail to relay (``credit``). ``None``: no channel to relay on."""
        ...

    async def credit(
        self, slot: StepSlot, *, after: int, model: str | None, route_id: str | None, stop: Iterable[int]
    ) -> bool:
        """Give the route's tail leave to send ``slot``'s step itself once it has answered step
        ``after`` (a ``CREDIT``); False when it could not be given (nothing was)."""
        ...

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> bool | None:
        """Free the session on ``hop`` (and down the chain from it); ``ticket``: the session's route
        ticket, which a node of a private swarm wants on a ``DELETE``. Whether it was acknowledged
        (``acknowledged``; an unreachable hop is False)."""
        ...

    async def state(self, hop: str, session: SessionId, *, timeout_s: float) -> dict[str, Any] | None:
        """What ``hop`` holds of the session (``GET /v1/sessions/{id}``); None when it cannot say."""
        ...

    async def seam_log(self, hop: str, session: SessionId, *, timeout_s: float) -> tuple[TensorFrame, tuple[int, ...]]:
        """What ``hop`` sent on of the session (its seam log) and the chunks it computed them in, for an
        audit (``GET /v1/sessions/{id}/seam``). Raises ``HopFailed`` when it cannot be reached, the
        error it answered, or ``ValueError`` for a log that is not one."""
        ...

    async def take_snapshot(self, hop: str, session: SessionId, ticket: str, *, timeout_s: float) -> dict[str, Any]:
        """Ask ``hop`` to snapshot its KV of the session to the standby ``ticket`` names; its answer
        (``{"snapshot": positions, "to": standby}``); raises the error it answered."""
        ...

    async def push_snapshot(self, hop: str, session: SessionId, ticket: str, body: bytes, *, timeout_s: float) -> None:
        """Hand a KV snapshot (``node.snapshots``) to the standby at ``hop``; raises ``HopFailed``
        naming it, or the error it answered."""
        ...

    async def drop_snapshot(self, hop: str, session: SessionId, ticket: str) -> None:
        """Tell the standby at ``hop`` that the session ended: its snapshot is of no more use. Failures
        are ignored (the standby drops it at the session's idle TTL)."""
        ...

    async def aclose(self) -> None: ...


def seq_probe(hops: HopTransport, sid: SessionId, timeout_s: float) -> Probe:
    """Whether the node at a URL computed a decode-channel step of session ``sid``: it or a later step
    of the session (a hop takes a session's steps in order); ``None`` when it cannot say."""

    async def probe(url: str, seq: int) -> bool | None:
        held = await hops.state(url, sid, timeout_s=min(5.0, timeout_s))
        if held is None:
            return None
        newest = held.get("seq")
        return isinstance(newest, int) and not isinstance(newest, bool) and newest >= seq

    return probe


def _prefix(downstream: Sequence[str] | None) -> str:
    return "next hop" if downstream is None else "node"


def _route_error(
    status: object, message: str, failed_hop: object, code: object, *, hop: str, downstream: Sequence[str]
) -> MeshnetError:
    """What an error answer from ``hop``, a hop of a route, means to the gateway (module docstring):
    ``downstream`` is it and the hops after it, the only ones it may name as failed."""
    return hop_error(f"route hop answered {status}: {message}", status=status, failed_hop=failed_hop, sender=hop,
                     sender_is_head=True, code=code, may_name={hop, *downstream})  # fmt: skip


def _encode(request: Sendable) -> tuple[str, dict[str, str], bytes]:
    if isinstance(request, HopRequest):
        return http_binding.encode_request(request)
    if isinstance(request, PrefixRequest):
        path, headers = http_binding.encode_prefix(request)
    elif isinstance(request, RerouteRequest):
        path, headers = http_binding.encode_reroute(request)
    else:
        path, headers = http_binding.encode_restore(request)
    return path, headers, b""


class HttpTransport:
    """The HTTP binding over ``client``; decode-channel steps over ``channels`` (None: none)."""

    def __init__(self, client: httpx.AsyncClient, channels: Channels | None = None) -> None:
        self.client = client
        self.channels = channels

    async def send(
        self, hop: str, request: Sendable, *, timeout_s: float, downstream: Sequence[str] | None = None
    ) -> HopAnswer:
        path, headers, body = _encode(request)
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        try:
            response = await self.client.post(f"{hop}{path}", content=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise HopFailed(f"{_prefix(downstream)} {hop} failed: {type(exc).__name__}: {exc}",
                            failed_hop=hop) from None  # fmt: skip
        if downstream is None:
            return http_binding.answer_from_response(response, hop)
        if response.status_code >= 400:
            raise _route_error(response.status_code, error_message(response), error_field(response, "failed_hop"),
                               error_field(response, "code"), hop=hop, downstream=downstream)  # fmt: skip
        try:
            return answer_from_json(response.status_code, response.json())
        except ValueError as exc:  # a bad answer is a failed tail (it alone answers tokens), repaired like a dead one
            tail = downstream[-1] if downstream else hop
            raise HopFailed(f"the route's tail {tail} answered a malformed step ({exc})", failed_hop=tail) from None

    async def start_step(
        self, route: Sequence[str], request: HopRequest, *, timeout_s: float, slot: StepSlot | None = None
    ) -> asyncio.Future[HopAnswer] | None:
        if self.channels is None:
            return None
        sid = request.session
        try:
            # no hop waits for another here, so no nesting: one hop timeout bounds the walk, as it
            # bounds the innermost HTTP hop's wait for everything below it
            return await self.channels.start(list(route), request, timeout_s=timeout_s,
                                             probe=seq_probe(self, sid, timeout_s), slot=slot)  # fmt: skip
        except ChannelUnavailable:
            if slot is not None:
                slot.answer.cancel()
            return None

    async def reserve_step(self, route: Sequence[str], session: SessionId, *, timeout_s: float) -> StepSlot | None:
        if self.channels is None:
            return None
        try:
            return await self.channels.reserve(list(route), session, timeout_s=timeout_s,
                                               probe=seq_probe(self, session, timeout_s))  # fmt: skip
        except ChannelUnavailable:
            return None

    async def credit(
        self, slot: StepSlot, *, after: int, model: str | None, route_id: str | None, stop: Iterable[int]
    ) -> bool:
        if self.channels is None:
            return False
        return await self.channels.credit(slot, after=after, model=model, route_id=route_id, stop=stop)

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> bool | None:
        headers = {} if ticket is None else {H.TICKET: ticket}
        try:
            response = await self.client.delete(f"{hop}/v1/sessions/{session}", headers=headers)
        except httpx.HTTPError:
            return False
        return acknowledged(response.status_code)

    async def state(self, hop: str, session: SessionId, *, timeout_s: float) -> dict[str, Any] | None:
        try:
            response = await self.client.get(f"{hop}/v1/sessions/{session}", timeout=timeout_s)
            held = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return held if isinstance(held, dict) else None

    async def seam_log(self, hop: str, session: SessionId, *, timeout_s: float) -> tuple[TensorFrame, tuple[int, ...]]:
        try:
            response = await self.client.get(f"{hop}/v1/sessions/{session}/seam", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise HopFailed(f"node {hop} failed: {type(exc).__name__}: {exc}", failed_hop=hop) from None
        if response.status_code != 200:
            raise http_binding.error_from_response(response, hop, sender_is_head=True)
        shape = parse_shape(response.headers.get(H.SHAPE))
        if len(shape) < 2:
            raise ValueError(f"a seam log of shape {shape} has no positions")
        chunks = parse_chunks(response.headers.get(H.CHUNKS), shape[1])
        return TensorFrame(shape, response.headers.get(H.DTYPE, ""), response.content), chunks

    async def take_snapshot(self, hop: str, session: SessionId, ticket: str, *, timeout_s: float) -> dict[str, Any]:
        try:
            response = await self.client.post(f"{hop}/v1/sessions/{session}/snapshot", headers={H.TICKET: ticket},
                                              timeout=timeout_s)  # fmt: skip
        except httpx.HTTPError as exc:
            raise HopFailed(f"node {hop} failed: {type(exc).__name__}: {exc}", failed_hop=hop) from None
        if response.status_code >= 400:
            raise http_binding.error_from_response(response, hop, sender_is_head=True)
        try:
            taken = response.json()
        except ValueError:
            taken = None
        return taken if isinstance(taken, dict) else {}

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
        if self.channels is not None:
            await self.channels.aclose()
        await self.client.aclose()


class LocalTransport:
    """Hop services of this process by URL; a URL with no service is a hop that is down.

    ``channels``: decode-channel steps too (``start_step``), with the channel's semantics: every hop
    passes the step on without waiting (its ``channel_send`` is ``channel_send`` here), a session's
    steps run on each hop one after another in the order they came, the tail's answer (or any
    hop's error) and each other hop's entry go straight back to the caller, whose reading of them
    is the channel client's, and a tail given leave (``credit``) relays the next step to the head
    itself, as over the channel."""

    def __init__(self, *, channels: bool = False) -> None:
        self.services: dict[str, LocalHop] = {}
        self.channels = channels
        self._seq = itertools.count()
        self._waiting: dict[int, tuple[tuple[str, ...], asyncio.Future[HopAnswer]]] = {}
        self._in_order: InOrder[tuple[str, str]] = InOrder()  # (hop, session): its steps one after another
        self._steps: set[asyncio.Task[None]] = set()
        self._slots: dict[int, StepSlot] = {}  # reserved steps, which a tail may relay

    def add(self, url: str, service: LocalHop) -> None:
        self.services[url] = service

    def remove(self, url: str) -> None:
        """The hop at ``url`` is gone, as after ``kill -9``: every later request to it fails."""
        self.services.pop(url, None)

    def _service(self, hop: str, role: str = "next hop") -> LocalHop:
        service = self.services.get(hop)
        if service is None:
            raise HopFailed(f"{role} {hop} failed: ConnectError: nothing listens there", failed_hop=hop)
        return service

    async def send(
        self, hop: str, request: Sendable, *, timeout_s: float, downstream: Sequence[str] | None = None
    ) -> HopAnswer:
        service = self._service(hop, _prefix(downstream))
        try:
            if isinstance(request, PrefixRequest):
                return await service.prefix(request)
            if isinstance(request, RerouteRequest):
                return await service.reroute(request)
            if isinstance(request, RestoreRequest):
                return await service.restore(request)
            answer = await service.handle(request)
        except MeshnetError as exc:
            if downstream is None:
                raise remote_error(exc, sender=hop, sender_is_head=False) from None
            raise _route_error(exc.status, exc.message, exc.failed_hop, exc.code, hop=hop,
                               downstream=downstream) from None  # fmt: skip
        return answer

    async def reserve_step(self, route: Sequence[str], session: SessionId, *, timeout_s: float) -> StepSlot | None:
        if not self.channels:
            return None
        seq = next(self._seq)
        urls = tuple(route)
        answer: asyncio.Future[HopAnswer] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = (urls, answer)
        slot = StepSlot((session, seq), urls, answer, seq_probe(self, session, timeout_s), timeout_s)
        self._slots[seq] = slot
        answer.add_done_callback(lambda _: (self._waiting.pop(seq, None), self._slots.pop(seq, None)))
        return slot

    async def credit(
        self, slot: StepSlot, *, after: int, model: str | None, route_id: str | None, stop: Iterable[int]
    ) -> bool:
        tail = self.services.get(slot.urls[-1])
        if tail is None:
            return False
        credit = Credit(slot.key[0], after, slot.seq, slot.urls[0], slot.urls, model, route_id, frozenset(stop))
        try:
            tail.take_credit(credit)
        except MeshnetError:
            return False
        return True

    async def start_step(
        self, route: Sequence[str], request: HopRequest, *, timeout_s: float, slot: StepSlot | None = None
    ) -> asyncio.Future[HopAnswer] | None:
        if not self.channels:
            return None  # every step is sent
        if slot is None:
            slot = await self.reserve_step(route, request.session, timeout_s=timeout_s)
            assert slot is not None  # (channels: one is reserved)
        slot.launched = True
        self._dispatch(slot.urls[0], request, Direct(slot.seq, slot.urls))
        return asyncio.ensure_future(self._wait(slot.seq, slot.answer, request.session, timeout_s))

    async def channel_send(self, hop: str, request: HopRequest, direct: Direct, timeout_s: float) -> None:
        """A hop passing a decode-channel step on to ``hop`` (a ``NodeService``'s ``channel_send``)."""
        if hop not in self.services:
            raise HopFailed(f"next hop {hop} failed on its decode channel: ConnectError: nothing listens there",
                            failed_hop=hop)  # fmt: skip
        self._dispatch(hop, request, direct)

    def _dispatch(self, hop: str, request: HopRequest, direct: Direct) -> None:
        task = self._in_order.start((hop, request.session), self._run_step(hop, request, direct))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    async def _run_step(self, hop: str, request: HopRequest, direct: Direct) -> None:
        service = self.services.get(hop)
        if service is None:  # its channel closed: the caller learns it from its own channel to the hop
            waiting = self._waiting.get(direct.seq)
            if waiting is not None and not waiting[1].done():
                waiting[1].set_exception(HopFailed(f"node {hop} failed: its decode channel closed", failed_hop=hop))
            return
        try:
            answer = await service.handle(request, direct)
        except MeshnetError as exc:
            self._deliver(direct.seq, hop, exc)
            return
        except Exception as exc:  # as a node's channel answers a step it failed on (node.channel)
            error = MeshnetError(f"the node failed on this step: {type(exc).__name__}: {exc}")
            self._deliver(direct.seq, hop, error)
            return
        if isinstance(answer, Accepted):  # a hop before the tail passed the step on: its entry
            self._deliver(direct.seq, hop, answer)
            return
        relayed = await service.relay(request.session, direct, answer)  # as the node's channel does
        slot = None if relayed is None else self._slots.get(relayed)
        if slot is not None:
            slot.launched = True
        self._deliver(direct.seq, hop, answer)

    def _deliver(self, seq: int, hop: str, outcome: HopAnswer | MeshnetError) -> None:
        """The caller's reading of a hop's report, as the channel client reads it (``channel_client``)."""
        waiting = self._waiting.get(seq)
        if waiting is None or waiting[1].done():
            return  # nobody waits for it any more
        urls, answer = waiting
        at = urls.index(hop)
        slot = self._slots[seq]
        if isinstance(outcome, MeshnetError):
            message = f"route hop answered {outcome.status}: {outcome.message}"
            answer.set_exception(hop_error(message, status=outcome.status, failed_hop=outcome.failed_hop, sender=hop,
                                           sender_is_head=at == 0, code=outcome.code, may_name=urls[at:]))  # fmt: skip
        elif at != len(urls) - 1 and isinstance(outcome, Accepted):  # a hop's own entry, as its ENTRY frame
            slot.add_entry(hop, outcome.hops[0])
        elif at != len(urls) - 1:
            answer.set_exception(HopFailed(f"node {hop} sent the step's token, which only the tail {urls[-1]} "
                                           "computes", failed_hop=hop))  # fmt: skip
        elif not slot.take(outcome):  # the hops before it sent theirs first (each as it passed the step on)
            missing = slot.missing()
            assert missing is not None  # (what keeps the answer waiting)
            answer.set_exception(no_entry(missing, seq))

    async def _wait(
        self, seq: int, answer: asyncio.Future[HopAnswer], session: SessionId, timeout_s: float
    ) -> HopAnswer:
        urls = self._waiting[seq][0]
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except TimeoutError:
            raise await silent_hop(urls, seq, timeout_s, seq_probe(self, session, timeout_s)) from None
        finally:
            self._waiting.pop(seq, None)

    async def delete(self, hop: str, session: SessionId, ticket: str | None = None) -> bool | None:
        service = self.services.get(hop)
        if service is None:
            return False
        try:
            await service.delete(session, ticket)
        except MeshnetError as exc:
            return acknowledged(exc.status)
        return True

    async def state(self, hop: str, session: SessionId, *, timeout_s: float) -> dict[str, Any] | None:
        service = self.services.get(hop)
        if service is None:
            return None
        try:
            return service.session_state(session)
        except MeshnetError:
            return None

    async def seam_log(self, hop: str, session: SessionId, *, timeout_s: float) -> tuple[TensorFrame, tuple[int, ...]]:
        service = self._service(hop, "node")
        try:
            return service.seam_log(session)
        except MeshnetError as exc:
            raise remote_error(exc, sender=hop, sender_is_head=True) from None

    async def take_snapshot(self, hop: str, session: SessionId, ticket: str, *, timeout_s: float) -> dict[str, Any]:
        service = self._service(hop, "node")
        try:
            return await service.snapshot(session, ticket)
        except MeshnetError as exc:
            raise remote_error(exc, sender=hop, sender_is_head=True) from None

    async def push_snapshot(self, hop: str, session: SessionId, ticket: str, body: bytes, *, timeout_s: float) -> None:
        service = self._service(hop, "standby")
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
        for task in list(self._steps):
            task.cancel()
        self.services.clear()
