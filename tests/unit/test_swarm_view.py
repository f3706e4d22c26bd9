"""``GET /v1/swarm`` reads members' answers carefully (issue 28): a bounded body, known fields of
their types only, and one fixed reason for every failure (no exception text: no port oracle).
A fake tracker and fake nodes on loopback, the real gateway app over the FakeEngine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from meshnet.backends.fake import FakeEngine
from meshnet.gateway import create_app
from meshnet.gateway.swarm_view import UNREACHABLE, node_health
from tests.asgi import serve_in_thread

pytestmark = pytest.mark.timeout(60)

GOOD = {"status": "ok", "node_id": "n1", "layers": "0:15", "sessions": 1, "max_sessions": 4, "seam": [1, 64]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_node_health_keeps_known_fields_of_their_types() -> None:
    lying = {**GOOD, "sessions": "many", "max_sessions": True, "secret": "x" * 10, "layers": "0:15" * 500,
             "seam": [1, "a"], "started": float("nan"), "status": "ok <script>"}  # fmt: skip
    kept = node_health(lying)
    assert kept["status"] == "unknown"  # only exactly "ok" is ok
    assert "secret" not in kept and "sessions" not in kept and "max_sessions" not in kept and "seam" not in kept
    assert "started" not in kept and len(kept["layers"]) == 256
    assert node_health(GOOD) == GOOD
    assert node_health(["not", "an", "object"]) == {"status": "unreachable", "reason": UNREACHABLE}


def test_swarm_view_is_bounded_typed_and_says_no_exception_text() -> None:
    sent = {"bytes": 0}

    async def huge(_: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:  # 200 MiB of a JSON string, lazily
            yield b'{"status": "ok", "pad": "'
            for _ in range(200 * 16):
                sent["bytes"] += 65536
                yield b"x" * 65536
                await asyncio.sleep(0.002)  # reading it all would take over 6 s
            yield b'"}'

        return StreamingResponse(body(), media_type="application/json")

    async def extra(_: Request) -> Response:
        return JSONResponse({**GOOD, "node_id": "n3", "debug": {"env": "SECRET"}, "sessions": -4})

    async def good(_: Request) -> Response:
        return JSONResponse(GOOD)

    nodes_app = Starlette(
        routes=[
            Route("/huge/v1/health", huge),
            Route("/extra/v1/health", extra),
            Route("/good/v1/health", good),
            Route("/text/v1/health", lambda _: Response("not json")),
        ]
    )
    closed = f"http://127.0.0.1:{_free_port()}"
    with serve_in_thread(nodes_app) as base:
        listing = [{"node_id": name, "url": f"{base}/{name}"} for name in ("huge", "extra", "good", "text")]
        listing += [{"node_id": "closed", "url": closed}, {"node_id": "junk", "url": 5}, "junk"]

        async def nodes(_: Request) -> Response:
            return JSONResponse({"nodes": listing})

        with (
            serve_in_thread(Starlette(routes=[Route("/v1/nodes", nodes)])) as tracker,
            TestClient(create_app(FakeEngine(), swarm_tracker=tracker)) as client,
        ):
            answer = client.get("/v1/swarm")
            read = sent["bytes"]  # what the node had sent when the gateway answered
    assert answer.status_code == 200
    view: dict[str, Any] = answer.json()
    health = {n["node_id"]: n["health"] for n in view["nodes"]}
    assert set(health) == {"huge", "extra", "good", "text", "closed"}  # a listing without a URL is skipped
    for name in ("huge", "text", "closed"):
        assert health[name] == {"status": "unreachable", "reason": UNREACHABLE}, name
    assert read <= 4 * 2**20, read  # abandoned near the limit (plus socket buffers), not read to 200 MiB
    assert health["good"] == GOOD
    assert "debug" not in health["extra"] and "sessions" not in health["extra"]
    text = answer.text
    for leak in ("Connect", "refused", "Errno", "SECRET", str(closed.rsplit(":", 1)[1]) + ")"):
        assert leak not in text, leak


def test_an_unreachable_tracker_is_named_without_its_error() -> None:
    closed = f"http://127.0.0.1:{_free_port()}"
    with TestClient(create_app(FakeEngine(), swarm_tracker=closed)) as client:
        view = client.get("/v1/swarm").json()
    assert view["error"] == "tracker unreachable"
