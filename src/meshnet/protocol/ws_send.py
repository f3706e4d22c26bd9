"""Writing a decode-channel frame on a websockets client connection without its asynchronous
``send`` where that would not wait anyway (docs/protocol.md, "Decode channel")."""

from __future__ import annotations

from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

__all__ = ["send_now"]


def send_now(connection: ClientConnection, data: bytes) -> bool:
    """Write ``data`` as one binary message on ``connection`` now; False where websockets' own
    ``send`` might have to wait or fail (not open, a fragmented message going out, the transport
    paused or closing): then ``await connection.send(data)``."""
    if connection.protocol.state is not State.OPEN or getattr(connection, "send_in_progress", True) is not None:
        return False
    send_data = getattr(connection, "send_data", None)  # (websockets' own write of what its protocol made)
    if send_data is None or getattr(connection, "paused", True) or connection.transport.is_closing():
        return False
    connection.protocol.send_binary(data)
    send_data()
    return True
