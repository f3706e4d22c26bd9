"""A node's side of the decode channel (docs/protocol.md, "Decode channel").

- ``serve``: the ``/v1/channel`` WebSocket. A gateway dials one to every hop of its routes and an
  upstream hop dials one to its next hop; the node greets each with a ``HELLO`` naming it (its
  *return id*), then takes ``STEP`` frames, each on a task of its own (sessions do not wait for one
  another; the steps of one session run one after another, in the order they came: a gateway keeps
  several pipelined speculation rounds of a session in flight). A step's ``TOKEN`` (tail),
  ``ENTRY`` (a hop before it, once the step went on) or ``ERROR`` (any hop) goes to the channel
  named by the step's ``returns`` — the gateway's own channel to this hop — so the token skips
  every hop on its way back. A ``CREDIT`` (gateway → tail) is taken at once, in order with the
  frames around it (``on_credit``): the tail may then relay the next step to the head itself
  (``NodeService.relay``).
- ``Dialer``: this node's kept-open channels to its next hops, dialed on a session's first channel
  step and reused by every later step of every session.

A frame that cannot be read, or a step that fails, is answered with an ``ERROR`` for that session
(and step) only: the channel stays open for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.protocol import State

from meshnet.errors import HopFailed, InvalidRequest, MeshnetError
from meshnet.node.direct_ws import DIRECT_EXTENSION, DirectMessages
from meshnet.protocol.channel import (
    MAX_HEADER_BYTES,
    VERSION,
    ChannelFrame,
    Credit,
    Direct,
    InOrder,
    Kind,
    decode_frame,
    encode_frame,
    entry_frame,
    error_frame,
    read_credit,
    read_step,
    step_ids,
    token_frame,
    ws_url,
)
from meshnet.protocol.messages import HopEntry, HopRequest
from meshnet.protocol.ws_send import send_now

__all__ = ["CreditHandler", "Dialer", "Direct", "Peer", "StepHandler", "serve"]

log = logging.getLogger("meshnet.node")

_HELLO_TIMEOUT_S = 5.0
_FRAME_OVERHEAD = 14  # a WebSocket frame's header, at most, masking key included


# (request, direct) -> the tail's answer and the step it relayed after it (None: it relayed none), a
# hop's own entry for the gateway (a hop before the tail), or None
StepHandler = Callable[
    [HopRequest, Direct],
    Awaitable[tuple[dict[str, Any], int | None] | HopEntry | None],
]
CreditHandler = Callable[[Credit], None]  # raises MeshnetError to refuse it


class Peer:
    """One accepted channel: frames to it go out one at a time, straight to its transport where
    the server offers that (``node.direct_ws``) and nothing is waiting to go before them."""

    def __init__(self, websocket: WebSocket, direct: DirectMessages | None = None) -> None:
        self.websocket = websocket
        self.direct = direct
        self._lock = asyncio.Lock()

    async def send(self, data: bytes) -> bool:
        """False when the other side is gone (a report to nobody is dropped, not raised)."""
        if self.direct is not None and not self._lock.locked() and self.direct.write(data):
            return True
        async with self._lock:
            try:
                await self.websocket.send_bytes(data)
            except (WebSocketDisconnect, RuntimeError, OSError):
                return False
        return True


class _Channel:
    """What one accepted channel does with each binary message it reads (``take``): a ``CREDIT`` is
    taken at once, a step starts on a task of its own, after the session's steps before it."""

    def __init__(
        self, peer: Peer, peers: dict[str, Peer], max_body_bytes: int, on_step: StepHandler,
        on_credit: CreditHandler | None,
    ) -> None:  # fmt: skip
        self.peer, self.peers, self.max_body_bytes = peer, peers, max_body_bytes
        self.on_step, self.on_credit = on_step, on_credit
        self.tasks: set[asyncio.Future[Any]] = set()
        self.in_order: InOrder[str] = InOrder()  # a session's steps, one after another

    def take(self, data: bytes | None) -> None:
        if data is None:
            text = InvalidRequest("channel frames are binary messages, not text")
            self._later(self.peer.send(error_frame(None, None, text)))
            return
        try:
            frame: ChannelFrame | InvalidRequest = decode_frame(data)
        except InvalidRequest as exc:
            frame = exc
        if not isinstance(frame, InvalidRequest) and frame.kind is Kind.CREDIT:
            self._credit(frame)
            return
        session = step_ids(frame)[0] if not isinstance(frame, InvalidRequest) else None
        step = _one_step(frame, self.peer, self.peers, self.max_body_bytes, self.on_step)
        self._track(asyncio.ensure_future(step) if session is None else self.in_order.start(session, step))

    def _credit(self, frame: ChannelFrame) -> None:
        """Take a ``CREDIT``; a refused one is an ``ERROR`` for its session (no step: ``seq`` null)."""
        session, _ = step_ids(frame)
        try:
            if self.on_credit is None:
                raise InvalidRequest("this node takes no CREDIT frames")
            self.on_credit(read_credit(frame))
        except MeshnetError as exc:
            self._later(self.peer.send(error_frame(session, None, exc)))

    def _later(self, send: Awaitable[bool]) -> None:
        self._track(asyncio.ensure_future(send))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def serve(
    websocket: WebSocket, *, node_id: str, peers: dict[str, Peer], max_body_bytes: int, on_step: StepHandler,
    on_credit: CreditHandler | None = None,
) -> None:  # fmt: skip
    """Run one accepted channel until the other side closes it. Where the server offers direct
    messages (``node.direct_ws``: uvicorn with ``cli.serve.serve_app``), each binary message is
    taken as the server reads it, before the next; otherwise through ASGI's ``receive``, the same way."""
    direct = (websocket.scope.get("extensions") or {}).get(DIRECT_EXTENSION)
    direct = direct if isinstance(direct, DirectMessages) else None
    channel_id = secrets.token_urlsafe(16)
    peer = Peer(websocket, direct)
    channel = _Channel(peer, peers, max_body_bytes, on_step, on_credit)
    if direct is not None:
        direct.take(channel.take)  # before the accept: no message can come ahead of it
    await websocket.accept()
    peers[channel_id] = peer
    try:
        await peer.send(encode_frame(Kind.HELLO, {"channel": channel_id, "node": node_id, "version": VERSION}))
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            channel.take(message.get("bytes"))
    except WebSocketDisconnect:
        pass
    finally:
        peers.pop(channel_id, None)
        # steps already taken run to the end: their reports go to their own return channels


async def _one_step(
    frame: ChannelFrame | InvalidRequest, peer: Peer, peers: dict[str, Peer], max_body: int, on_step: StepHandler
) -> None:
    session: str | None = None
    seq: int | None = None
    reply = peer
    try:
        if isinstance(frame, InvalidRequest):
            raise frame
        session, seq = step_ids(frame)  # first: an error about the rest still names the step
        step = read_step(frame)
        reply = peers.get(step.returns[0], peer)
        answered = await on_step(step.request(max_body), Direct(step.seq, step.returns))
        if isinstance(answered, HopEntry):
            await reply.send(entry_frame(step.session, step.seq, answered))
        elif answered is not None:
            await reply.send(token_frame(step.session, step.seq, *answered))
    except MeshnetError as exc:
        await reply.send(error_frame(session, seq, exc))
    except Exception as exc:  # never let one step take the channel down
        log.exception("decode-channel step of session %s failed", session)
        error = MeshnetError(f"the node failed on this step: {type(exc).__name__}: {exc}")
        await reply.send(error_frame(session, seq, error))


def _fits(connection: ClientConnection, size: int) -> bool:
    """Whether a frame of ``size`` bytes goes out without waiting: the transport is not paused (its
    write buffer is at or under the low-water mark, where asyncio resumes it) and the frame leaves
    the buffer under the high-water mark (so the write does not pause it). Then nothing is worth a
    deadline, which costs a decode step's hop ~50 µs when its caches are cold after the compute."""
    transport = connection.transport
    buffered = transport.get_write_buffer_size()
    low, high = transport.get_write_buffer_limits()
    return buffered <= low and buffered + size + _FRAME_OVERHEAD <= high


class Dialer:
    """Kept-open channels to next hops, one per URL, shared by every session."""

    def __init__(self, max_frame_bytes: int, *, tls: ssl.SSLContext | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes + MAX_HEADER_BYTES
        self.tls = tls  # the member TLS this node dials ``https`` next hops with
        self._open: dict[str, ClientConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._drains: set[asyncio.Task[None]] = set()

    async def send(self, url: str, data: bytes, timeout_s: float) -> None:
        """Send one frame to the hop at ``url``, dialing it first if need be; ``HopFailed`` names it."""
        try:
            connection = await self._dial(url)
            if _fits(connection, len(data)):  # written at once: websockets waits only while the transport is paused
                if not send_now(connection, data):
                    await connection.send(data)
            else:
                async with asyncio.timeout(timeout_s):  # in this task: wait_for's task of its own cost a loop turn
                    await connection.send(data)
        except (OSError, TimeoutError, WebSocketException, InvalidRequest) as exc:
            self._open.pop(url, None)
            raise HopFailed(f"next hop {url} failed on its decode channel: {type(exc).__name__}: {exc}",
                            failed_hop=url) from None  # fmt: skip

    async def _dial(self, url: str) -> ClientConnection:
        connection = self._open.get(url)
        if connection is not None and connection.state is State.OPEN:
            return connection
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            connection = self._open.get(url)
            if connection is not None and connection.state is State.OPEN:
                return connection
            connection = await connect(
                ws_url(url),
                ssl=self.tls if url.startswith("https:") else None,
                open_timeout=_HELLO_TIMEOUT_S,
                compression=None,
                max_size=self.max_frame_bytes,
            )
            try:
                hello = decode_frame(await asyncio.wait_for(connection.recv(decode=False), _HELLO_TIMEOUT_S))
                if hello.kind is not Kind.HELLO:
                    raise InvalidRequest(f"{url} opened its channel with {hello.kind.name}, not HELLO")
            except BaseException:
                await connection.close()
                raise
            self._open[url] = connection
            task = asyncio.create_task(self._drain(url, connection))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
            return connection

    async def _drain(self, url: str, connection: ClientConnection) -> None:
        """A next hop reports to the gateway, not to us: anything it sends here is only logged."""
        with contextlib.suppress(WebSocketException, OSError):
            async for message in connection:
                with contextlib.suppress(InvalidRequest):
                    frame = decode_frame(message if isinstance(message, bytes) else message.encode())
                    log.warning("next hop %s sent %s on its channel: %s", url, frame.kind.name, frame.header)
        if self._open.get(url) is connection:
            del self._open[url]

    async def close(self) -> None:
        for connection in list(self._open.values()):
            with contextlib.suppress(Exception):
                await connection.close()
        self._open.clear()
        for task in list(self._drains):
            task.cancel()
