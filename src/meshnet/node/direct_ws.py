"""Direct WebSocket messages for the decode channel: uvicorn's sans-I/O WebSocket protocol with a
way around ASGI for the app that asks for it (docs/protocol.md, "Decode channel").

Through ASGI each binary message a node reads goes into a queue; reading pauses until the app's task
takes it (``pause_reading`` and ``resume_reading``: two system calls a message), and the app's
receive loop wakes on a later turn of the event loop, only to start the step's own task. A reply
awaits the protocol's ``send``. All of that is on a decode token's way through every hop.

``DirectProtocol`` puts a ``DirectMessages`` in each WebSocket scope's ``extensions``
(``DIRECT_EXTENSION``). An app that calls its ``take`` before it accepts the WebSocket gets each
binary message handed to its callback as the protocol reads it: in order, on the event loop, with no
queue and no pause. Its ``write`` sends a binary message at once while the transport is writable,
and says False otherwise (then the app sends it through ASGI, which waits). Text messages, the close and the
disconnect still come through ASGI. Flow control is the app's: it reads as fast as its callback
returns (a node's channel starts a task per step, as its receive loop did).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from websockets.exceptions import InvalidState

__all__ = ["DIRECT_EXTENSION", "DirectMessages", "direct_protocol", "websocket_protocol"]

DIRECT_EXTENSION = "meshnet.direct"

log = logging.getLogger("meshnet.channel")

OnMessage = Callable[[bytes], None]


class DirectMessages:
    """One WebSocket's way around ASGI (module docstring)."""

    __slots__ = ("_on_message", "_protocol")

    def __init__(self, protocol: Any) -> None:
        self._protocol = protocol
        self._on_message: OnMessage | None = None

    def take(self, on_message: OnMessage) -> None:
        """Hand every binary message from now on to ``on_message`` (it must not block; what it
        raises is logged and the message dropped) instead of to the app's ``receive``."""
        self._on_message = on_message

    def write(self, data: bytes) -> bool:
        """Send ``data`` as one binary message now; False when it cannot go without waiting (the
        transport is paused or closing, the WebSocket closed): send it through ASGI then."""
        p = self._protocol
        if p.disconnected or p.close_sent or not p.handshake_complete or p.initial_response is not None:
            return False
        if not p.writable.is_set() or p.transport.is_closing():
            return False
        try:
            p.conn.send_binary(data)
        except InvalidState:
            return False
        p.transport.write(b"".join(p.conn.data_to_send()))
        return True

    def handle(self, data: bytes) -> bool:
        """Give ``data`` to the app's callback; False when the app took none (ASGI gets it)."""
        on_message = self._on_message
        if on_message is None:
            return False
        try:
            on_message(data)
        except Exception:  # a bug in the callback must not take the connection's reading down
            log.exception("a direct WebSocket message's handler failed; the message is dropped")
        return True


def direct_protocol(base: type[Any]) -> type[Any]:
    """``base`` (uvicorn's ``WebSocketsSansIOProtocol``) with a ``DirectMessages`` in each WebSocket scope."""

    class DirectProtocol(base):  # type: ignore[misc]
        direct: DirectMessages | None = None

        def handle_connect(self, event: Any) -> None:
            super().handle_connect(event)
            scope = getattr(self, "scope", None)  # (none when the handshake was refused)
            if isinstance(scope, dict) and isinstance(scope.get("extensions"), dict):
                self.direct = DirectMessages(self)
                scope["extensions"][DIRECT_EXTENSION] = self.direct

        def send_receive_event_to_app(self) -> None:
            direct = self.direct
            if direct is None or self.curr_msg_data_type != "bytes" or self.close_sent:
                super().send_receive_event_to_app()
                return
            frames: list[bytes] = self.frames
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            if direct.handle(data):
                frames.clear()  # (a list of this message's own: the next one starts another)
            else:
                super().send_receive_event_to_app()

    DirectProtocol.__name__ = DirectProtocol.__qualname__ = f"Direct{base.__name__}"
    return DirectProtocol


def websocket_protocol() -> type[Any]:
    """uvicorn's sans-I/O WebSocket protocol with direct messages, for ``uvicorn.Config(ws=...)``."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    return direct_protocol(WebSocketsSansIOProtocol)
