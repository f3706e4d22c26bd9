"""The gateway's side of the decode channel (docs/protocol.md, "Decode channel").

The gateway keeps one WebSocket open to every node its routes use, shared by every generation.
A decode step goes to the head as a ``STEP`` frame naming each hop's *return id* (the id the node
gave this gateway's channel in its ``HELLO``); the head passes it on over its own channel to the
next hop, and so on; the tail sends the ``TOKEN`` straight back on the gateway's channel to the
tail, and any hop that fails sends an ``ERROR`` on the gateway's channel to itself. So a step
costs one one-way leg per seam plus one back, and a failure still names the hop.

A node whose channel closes (its process died) fails every step waiting on a route through it at
once, naming it; a step that hears nothing within its deadline is located by asking each hop what
it holds (``GET /v1/sessions/{id}``): the first hop that did not compute it is the failed one.

Threading: generations run on gateway worker threads and call ``step``; one reader thread per
channel hands each frame to the step waiting for it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from meshnet.errors import BadGateway, HopFailed, InvalidRequest, hop_error
from meshnet.protocol.channel import MAX_HEADER_BYTES, ChannelFrame, Kind, decode_frame, read_token, step_frame, ws_url
from meshnet.protocol.messages import HopAnswer

__all__ = ["ChannelUnavailable", "Channels", "Probe", "open_websocket"]

log = logging.getLogger("meshnet.gateway")

_OPEN_TIMEOUT_S = 5.0
_RETRY_S = 30.0  # a node that refused its channel gets HTTP steps this long before it is dialed again
_MAX_FRAME_BYTES = 64 * 2**20 + MAX_HEADER_BYTES


def open_websocket(
    url: str, *, ssl_context: ssl.SSLContext | None, open_timeout_s: float, **options: Any
) -> ClientConnection:
    """``websockets.sync.client.connect``, bounded by ``open_timeout_s`` in every case.

    websockets (17.x) can wait forever for a peer that completes TLS but does not answer the
    WebSocket upgrade in time: after its handshake times out it closes the socket and joins its
    reader thread, which sits in a blocking TLS read (a TLS 1.3 session ticket made the socket
    readable) that closing does not wake. So the socket is opened here, and a watchdog shuts it
    down (which wakes any read) if the open is not done half a second after its deadline."""
    target = ws_url(url) if url.startswith(("http:", "https:")) else url
    parts = urlsplit(target)
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    sock = socket.create_connection((parts.hostname, port), timeout=open_timeout_s)
    sock.settimeout(None)  # as websockets leaves its own: its reader blocks, its handshake keeps the deadline
    watch = socket.socket(fileno=os.dup(sock.fileno()))  # the same connection, under the TLS wrapper to come

    def stop() -> None:
        with contextlib.suppress(OSError):
            watch.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(open_timeout_s + 0.5, stop)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection: ClientConnection = connect(target, sock=sock, ssl=ssl_context, open_timeout=open_timeout_s,
                                               **options)  # fmt: skip
        return connection
    except BaseException:
        sock.close()
        raise
    finally:
        watchdog.cancel()
        watchdog.join()
        watch.close()


class ChannelUnavailable(Exception):
    """A node of the route takes no decode channel (an older node, a proxy that passes no WebSocket,
    a node that is down): nothing was sent, the caller sends the step over HTTP instead."""


# (node url, step seq) -> True: it computed the step; False: it did not; None: it cannot be asked
Probe = Callable[[str, int], bool | None]


@dataclass(frozen=True, slots=True)
class _Closed:
    url: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Report:
    url: str  # the node whose channel it came on
    frame: ChannelFrame


class _Waiter:
    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = frozenset(urls)
        self.box: queue.Queue[_Report | _Closed] = queue.Queue()


class _NodeChannel:
    def __init__(self, owner: Channels, url: str) -> None:
        self.url = url
        self._stack = contextlib.ExitStack()  # websockets wants its sync connect() entered as a context
        try:
            self.connection: ClientConnection = self._stack.enter_context(
                open_websocket(
                    url,
                    ssl_context=owner.tls if url.startswith("https:") else None,
                    open_timeout_s=_OPEN_TIMEOUT_S,
                    compression=None,
                    max_size=_MAX_FRAME_BYTES,
                    close_timeout=2,
                )
            )
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ChannelUnavailable(f"node {url} refused its decode channel: {type(exc).__name__}: {exc}") from None
        try:
            hello = decode_frame(bytes(self.connection.recv(timeout=_OPEN_TIMEOUT_S, decode=False)))
            if hello.kind is not Kind.HELLO or not isinstance(hello.header.get("channel"), str):
                raise InvalidRequest(f"it opened with {hello.kind.name}, not HELLO")
        except (OSError, TimeoutError, WebSocketException, InvalidRequest) as exc:
            self._stack.close()
            raise ChannelUnavailable(f"node {url} sent no HELLO on its decode channel: {exc}") from None
        except BaseException:
            self._stack.close()
            raise
        self.return_id: str = hello.header["channel"]
        self.closed = False
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(owner,), name=f"channel {url}", daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> None:
        """Nothing went out when this fails: the caller can still send the step another way."""
        try:
            with self._send_lock:
                self.connection.send(data)
        except (OSError, WebSocketException) as exc:
            raise ChannelUnavailable(f"node {self.url}: decode channel lost: {exc}") from None

    def _read(self, owner: Channels) -> None:
        reason = "closed"
        try:
            for message in self.connection:
                try:
                    frame = decode_frame(message if isinstance(message, bytes) else message.encode())
                except Exception as exc:
                    log.warning("node %s sent an unreadable channel frame: %s", self.url, exc)
                    continue
                owner.deliver(_Report(self.url, frame))
        except (OSError, WebSocketException) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.closed = True
            owner.lost(self, reason)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()


class Channels:
    """Kept-open decode channels to nodes, by URL; to ``https`` nodes with the member TLS ``tls``."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self._open: dict[str, _NodeChannel] = {}
        self._dialing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._waiters: dict[tuple[str, int], _Waiter] = {}
        self._seq = itertools.count()
        self._refused: dict[str, float] = {}  # url -> when its channel was refused: HTTP until then + _RETRY_S

    def _channel(self, url: str) -> _NodeChannel:
        with self._lock:
            channel = self._open.get(url)
            if channel is not None and not channel.closed:
                return channel
            if time.monotonic() - self._refused.get(url, -_RETRY_S) < _RETRY_S:
                raise ChannelUnavailable(f"node {url} refused its decode channel less than {_RETRY_S:.0f} s ago")
            dialing = self._dialing.setdefault(url, threading.Lock())
        with dialing:
            with self._lock:
                channel = self._open.get(url)
                if channel is not None and not channel.closed:
                    return channel
            try:
                channel = _NodeChannel(self, url)
            except ChannelUnavailable as exc:
                with self._lock:
                    self._refused[url] = time.monotonic()
                log.warning("%s; its routes get HTTP decode steps, the channel is tried again in %.0f s", exc, _RETRY_S)
                raise
            with self._lock:
                self._open[url] = channel
                self._refused.pop(url, None)
            return channel

    def step(
        self,
        urls: Sequence[str],
        session: str,
        *,
        verb: str,
        headers: dict[str, str],
        body: bytes,
        timeout_s: float,
        probe: Probe,
    ) -> HopAnswer:
        """Send a step to the route of nodes at ``urls`` (head first); the tail's answer.

        Raises ``ChannelUnavailable`` (before anything was sent) when a node takes no channel,
        ``HopFailed`` naming the hop that failed, ``BadGateway`` for an error of the head's own.
        ``probe(url, seq)`` says whether the node at ``url`` has computed step ``seq`` (``None``: it
        cannot say); it locates a failure: a hop whose channel closed is named only once the hop
        before it has computed the step (else that one's own report is awaited, so a repair always
        has an upstream that holds the step), and after ``timeout_s`` of silence the first hop that
        has not computed it is named."""
        channels = [self._channel(url) for url in urls]
        seq = next(self._seq)
        waiter = _Waiter(urls)
        key = (session, seq)
        frame = step_frame(session, seq, verb=verb, headers=headers, body=body, returns=[c.return_id for c in channels])
        with self._lock:
            self._waiters[key] = waiter
        try:
            for channel in channels:  # one that closed before the waiter was registered never tells it
                if channel.closed:
                    waiter.box.put(_Closed(channel.url, "closed"))
            channels[0].send(frame)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    item = waiter.box.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    failed = next((url for url in urls if probe(url, seq) is not True), urls[-1])
                    raise HopFailed(f"Timeout: node {failed} did not pass step {seq} on within {timeout_s:.0f} s",
                                    failed_hop=failed) from None  # fmt: skip
                if isinstance(item, _Closed):
                    at = urls.index(item.url)
                    if at > 0 and probe(urls[at - 1], seq) is not True:
                        continue  # the hop before it has not sent the step yet: its report will name the lost one
                return _answer(item, urls)
        finally:
            with self._lock:
                self._waiters.pop(key, None)

    def deliver(self, report: _Report) -> None:
        header = report.frame.header
        key = (header.get("session"), header.get("seq"))
        with self._lock:
            waiter = self._waiters.get(key)  # type: ignore[arg-type]
        if waiter is not None and report.url not in waiter.urls:
            log.warning("node %s sent a %s for a step of a route it is not on; ignored", report.url,
                        report.frame.kind.name)  # fmt: skip
        elif waiter is not None:
            waiter.box.put(report)
        elif report.frame.kind is Kind.ERROR:
            log.warning("node %s reported an error for no waiting step: %s", report.url, header.get("error"))

    def lost(self, channel: _NodeChannel, reason: str) -> None:
        with self._lock:
            if self._open.get(channel.url) is channel:
                del self._open[channel.url]
            waiting = [w for w in self._waiters.values() if channel.url in w.urls]
        for waiter in waiting:
            waiter.box.put(_Closed(channel.url, reason))

    def close(self) -> None:
        with self._lock:
            channels = list(self._open.values())
            self._open.clear()
        for channel in channels:
            channel.close()


def _answer(item: _Report | _Closed, urls: Sequence[str]) -> HopAnswer:
    """The tail's answer, or the failure as the HTTP binding reports it: an error past the head
    names the hop that sent it (or the one at or after it that it names), the head's own is the
    gateway's 502. A token counts only from the tail's channel: a hop that answers for the route
    (skipping the hops after it) has failed."""
    if isinstance(item, _Closed):
        raise HopFailed(f"node {item.url} failed: its decode channel closed ({item.reason})", failed_hop=item.url)
    frame = item.frame
    if frame.kind is Kind.TOKEN and item.url != urls[-1]:
        raise HopFailed(f"node {item.url} sent the step's token, which only the tail {urls[-1]} computes",
                        failed_hop=item.url)  # fmt: skip
    if frame.kind is Kind.TOKEN:
        try:
            return read_token(frame)
        except ValueError as exc:
            raise HopFailed(f"the tail {item.url} sent a TOKEN frame without an answer: {exc}",
                            failed_hop=item.url) from None  # fmt: skip
    if frame.kind is not Kind.ERROR:
        raise BadGateway(f"node {item.url} sent a {frame.kind.name} frame for a step")
    raw = frame.header.get("error")
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    status = frame.header.get("status")
    message = f"route hop answered {status}: {error.get('message', 'no message')}"
    at = urls.index(item.url)  # deliver() passes on only the route's own reports
    raise hop_error(message, status=status, failed_hop=error.get("failed_hop"), sender=item.url,
                    sender_is_head=at == 0, code=error.get("code"), may_name=urls[at:])  # fmt: skip
