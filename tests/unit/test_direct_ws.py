"""Direct WebSocket messages (``node.direct_ws``) on a real uvicorn server: binary messages go
straight to the app's callback in order, text and the close still through ASGI; a direct write
says when it would have to wait; a callback that raises loses that message only; a server without
the protocol offers no extension and the app reads through ASGI as before."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.client import ClientProtocol
from websockets.http11 import Response
from websockets.uri import parse_uri

from meshnet.node.direct_ws import DIRECT_EXTENSION, DirectMessages, websocket_protocol
from meshnet.protocol.channel import ws_url
from tests.asgi import serve_in_thread
from tests.ws import open_channel

WAIT_S = 10.0


def _app(log: list[Any]) -> Starlette:
    """Echoes each binary message, prefixed with how it came (``direct:`` or ``asgi:``), and
    records the text messages and the disconnect it sees through ASGI. A binary message ``raise``
    makes the direct callback raise; ``flood N`` writes N messages of 256 KiB directly and records
    the first that could not go (then sends that one and the rest through ASGI)."""

    async def endpoint(websocket: WebSocket) -> None:
        direct = (websocket.scope.get("extensions") or {}).get(DIRECT_EXTENSION)
        log.append(("offered", isinstance(direct, DirectMessages)))
        pending: list[asyncio.Task[None]] = []

        def taken(data: bytes) -> None:
            assert isinstance(direct, DirectMessages)
            if data == b"raise":
                raise RuntimeError("a bug in the handler")
            if data.startswith(b"flood "):
                pending.append(asyncio.ensure_future(flood(direct, int(data.split()[1]))))
                return
            assert direct.write(b"direct:" + data)

        async def flood(direct: DirectMessages, n: int) -> None:
            payload = bytes(256 * 1024)
            for i in range(n):
                if not direct.write(payload):
                    log.append(("waits at", i))
                    for _ in range(i, n):
                        await websocket.send_bytes(payload)
                    return
            log.append(("never waited", n))

        if isinstance(direct, DirectMessages):
            direct.take(taken)
        await websocket.accept()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                log.append(("disconnect",))
                return
            if message.get("text") is not None:
                log.append(("text", message["text"]))
                await websocket.send_text("asgi:" + message["text"])
            else:
                await websocket.send_bytes(b"asgi:" + message["bytes"])

    return Starlette(routes=[WebSocketRoute("/v1/channel", endpoint)])


def _wait_for(log: list[Any], seen: Callable[[Any], bool], what: str) -> Any:
    """The first entry of ``log`` that ``seen``, within ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = next((e for e in log if seen(e)), None)
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s: {log}"
        time.sleep(0.01)


def _disconnected(log: list[Any]) -> None:
    _wait_for(log, lambda e: e == ("disconnect",), "disconnect")


def test_binary_messages_go_straight_to_the_callback_in_order_and_text_through_asgi(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[Any] = []
    with serve_in_thread(_app(log), ws=websocket_protocol()) as url:
        with caplog.at_level(logging.ERROR, logger="meshnet.channel"), open_channel(url, open_timeout_s=WAIT_S) as ws:
            for i in range(50):
                ws.send(b"m%d" % i)
            assert [ws.recv(timeout=WAIT_S) for _ in range(50)] == [b"direct:m%d" % i for i in range(50)]
            ws.send("hello")
            assert ws.recv(timeout=WAIT_S) == "asgi:hello"
            ws.send(b"raise")  # the handler's bug: this message is lost, the connection goes on
            ws.send(b"after")
            assert ws.recv(timeout=WAIT_S) == b"direct:after"
        _disconnected(log)
    assert log[0] == ("offered", True) and ("text", "hello") in log
    assert "a direct WebSocket message's handler failed" in caplog.text


def test_a_direct_write_says_false_once_the_transport_would_wait_and_nothing_is_lost() -> None:
    """A client with a small receive buffer reads nothing while the server writes 64 messages of
    256 KiB: the direct write refuses once the transport pauses (its buffer past the high-water
    mark), the rest go through ASGI's send, which waits; the client then reads all 64, whole."""
    log: list[Any] = []
    with serve_in_thread(_app(log), ws=websocket_protocol()) as url:
        protocol = ClientProtocol(parse_uri(ws_url(url)), max_size=None)
        protocol.send_request(protocol.connect())
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(WAIT_S)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"".join(protocol.data_to_send()))
            events = _read(sock, protocol, bool)
            assert isinstance(events[0], Response) and events[0].status_code == 101, events
            protocol.send_binary(b"flood 64")
            sock.sendall(b"".join(protocol.data_to_send()))
            paused = _wait_for(log, lambda e: e[0] in ("waits at", "never waited"), "end of the flood")
            assert paused[0] == "waits at" and 0 < paused[1] < 64, log
            frames = _read(sock, protocol, lambda events: len(events) >= 64)
        assert [len(f.data) for f in frames] == [256 * 1024] * 64
        _disconnected(log)


def _read(sock: socket.socket, protocol: ClientProtocol, enough: Callable[[list[Any]], bool]) -> list[Any]:
    """What ``protocol`` made of ``sock``'s bytes once ``enough`` of it came (each read bounded)."""
    events: list[Any] = []
    while not enough(events):
        data = sock.recv(1 << 20)
        assert data, f"the server closed the connection after {len(events)} events"
        protocol.receive_data(data)
        events.extend(protocol.events_received())
    return events


def test_a_server_without_the_protocol_offers_nothing_and_the_app_reads_through_asgi() -> None:
    log: list[Any] = []
    with serve_in_thread(_app(log), ws="websockets-sansio") as url:
        with open_channel(url, open_timeout_s=WAIT_S) as ws:
            ws.send(b"m1")
            assert ws.recv(timeout=WAIT_S) == b"asgi:m1"
        _disconnected(log)
    assert log[0] == ("offered", False)
