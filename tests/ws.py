"""A raw WebSocket client for tests that play a peer on a node's decode channel themselves."""

from __future__ import annotations

from typing import Any

from websockets.sync.client import ClientConnection, connect

from meshnet.protocol.channel import ws_url


def open_channel(url: str, *, open_timeout_s: float, **options: Any) -> ClientConnection:
    """A blocking connection to the decode channel of the node at ``url`` (a context manager).

    For the nodes a test starts itself (no test plays a peer that hangs after TLS here): websockets' own
    ``open_timeout`` bounds it. No proxy from the environment: the node is dialed directly, as the
    test's HTTP requests reach it (``options``: more ``websockets.sync.client.connect`` settings)."""
    options.setdefault("proxy", None)
    connection: ClientConnection = connect(ws_url(url), open_timeout=open_timeout_s, **options)
    return connection
