"""A Meshnet server keeps an idle connection open longer than a Meshnet client keeps it for reuse:
a node's heartbeat every 5 s reuses its connection to the tracker instead of racing its close."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from meshnet.cli.serve import serve_app
from meshnet.httputil import CLIENT_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S

pytestmark = pytest.mark.slow

HEARTBEAT_S = 5.0  # a node's default heartbeat period, and uvicorn's default keep-alive


async def ping(_: Request) -> PlainTextResponse:
    return PlainTextResponse("pong")


def test_a_connection_idle_for_a_heartbeat_period_is_reused() -> None:
    assert CLIENT_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S
    sock = socket.create_server(("127.0.0.1", 0))
    servers: list[Any] = []
    thread = threading.Thread(
        target=serve_app, args=(Starlette(routes=[Route("/ping", ping)]), sock), kwargs={"on_start": servers.append},
        daemon=True,
    )  # fmt: skip
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (servers and servers[0].started):
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start within 30 s"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/ping"
        with httpx.Client(limits=httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S)) as client:
            ports = []
            for _ in range(2):
                response = client.get(url)
                assert response.text == "pong"
                ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])
                time.sleep(HEARTBEAT_S + 0.5)  # past the idle time uvicorn closes a connection after by default
        assert ports[0] == ports[1], "the server closed the idle connection: the client had to open another"
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
        sock.close()
