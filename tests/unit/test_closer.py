"""gateway.closer: a session's close is retried off the request path until acknowledged (issue 28:
zombies), and a hop without room is a ``HopFull``, not a failure. A fake hop on loopback."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import BadGateway, HopFailed, HopFull, hop_error
from meshnet.gateway.closer import SessionCloser, acknowledged
from tests.asgi import serve_in_thread

pytestmark = pytest.mark.timeout(60)


def test_what_acknowledges_a_close() -> None:
    assert [acknowledged(s) for s in (200, 204, 404, 410)] == [True] * 4
    assert [acknowledged(s) for s in (409, 429, 500, 502, 503)] == [False] * 5
    assert [acknowledged(s) for s in (400, 401, 403)] == [None] * 3


def test_a_busy_hop_is_closed_once_it_is_free_and_a_refusal_is_given_up() -> None:
    answers = {"busy": [409, 409, 503, 204], "refused": [401, 401]}
    seen: dict[str, list[float]] = {"busy": [], "refused": []}
    lock = threading.Lock()

    async def delete(request: Request) -> Response:
        name = request.path_params["name"]
        with lock:
            seen[name].append(time.monotonic())
            status = answers[name].pop(0) if answers[name] else 204
        body = {"error": {"message": "busy", "type": "conflict_error", "param": None, "code": "session_busy"}}
        return JSONResponse(body, status_code=status) if status >= 400 else Response(status_code=status)

    app = Starlette(routes=[Route("/v1/sessions/{name}", delete, methods=["DELETE"])])
    closer = SessionCloser(first_retry_s=0.05, max_retry_s=0.2)
    with serve_in_thread(app) as base, httpx.Client() as client:
        assert not closer.close(f"{base}/v1/sessions/busy", {"X-T": "t"}, client=client, timeout_s=2)
        assert not closer.close(f"{base}/v1/sessions/refused", {}, client=client, timeout_s=2)
        assert closer.wait_idle(10)
        closer.shutdown()
    assert len(seen["busy"]) == 4  # 409, 409, 503, then the 204 that closed it
    gaps = [b - a for a, b in zip(seen["busy"], seen["busy"][1:], strict=False)]
    assert gaps[1] >= gaps[0] * 0.9  # backing off, not hammering
    assert len(seen["refused"]) == 1 and closer.given_up == 1  # a refusal will not change


def test_an_unreachable_hop_is_retried_until_it_answers() -> None:
    closer = SessionCloser(first_retry_s=0.05, max_retry_s=0.1, attempts=3)
    with httpx.Client() as client:
        assert not closer.close("http://127.0.0.1:9/v1/sessions/x", {}, client=client, timeout_s=0.5)
    assert closer.wait_idle(10)
    closer.shutdown()
    assert closer.given_up == 1  # three attempts, then the hop's TTL


@pytest.mark.parametrize("code", ["kv_store_full", "rate_limit_exceeded", "hop_full"])
def test_a_hop_without_room_is_hop_full_not_a_failure(code: str) -> None:
    head = hop_error("full", status=503, failed_hop=None, sender="https://head", sender_is_head=True, code=code)
    assert isinstance(head, HopFull) and head.failed_hop == "https://head"
    deeper = hop_error("full", status=502, failed_hop="https://tail", sender="https://head", sender_is_head=True,
                       code=code)  # fmt: skip
    assert isinstance(deeper, HopFull) and deeper.failed_hop == "https://tail"
    plain = hop_error("boom", status=500, failed_hop=None, sender="https://head", sender_is_head=True, code="x")
    assert type(plain) is BadGateway and not isinstance(plain, HopFailed)
