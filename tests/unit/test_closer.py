"""protocol.closer: a session's close is retried off the request path until acknowledged (issue 28:
zombies), and a hop without room is a ``HopFull``, not a failure. A fake hop on loopback, reached
through the gateway's own hop client."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import BadGateway, HopFailed, HopFull, InvalidRequest, Overloaded, hop_error
from meshnet.ids import SessionId
from meshnet.protocol.closer import SessionCloser
from meshnet.protocol.hops import HttpTransport, acknowledged
from meshnet.sampling import SamplingParams
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

    async def main(base: str) -> None:
        hops = HttpTransport(httpx.AsyncClient())
        for name in ("busy", "refused"):
            sid = SessionId(name)
            assert not await closer.close(lambda sid=sid: hops.delete(base, sid, "t"), name, timeout_s=2)  # type: ignore[misc]
        assert await closer.wait_idle(10)
        await closer.shutdown()
        await hops.aclose()

    with serve_in_thread(app) as base:
        asyncio.run(main(base))
    assert len(seen["busy"]) == 4  # 409, 409, 503, then the 204 that closed it
    gaps = [b - a for a, b in zip(seen["busy"], seen["busy"][1:], strict=False)]
    assert gaps[1] >= gaps[0] * 0.9  # backing off, not hammering
    assert len(seen["refused"]) == 1 and closer.given_up == 1  # a refusal will not change


def test_an_unreachable_hop_is_retried_until_it_answers() -> None:
    closer = SessionCloser(first_retry_s=0.05, max_retry_s=0.1, attempts=3)

    async def main() -> None:
        hops = HttpTransport(httpx.AsyncClient())
        assert not await closer.close(lambda: hops.delete("http://127.0.0.1:9", SessionId("x")), "x", timeout_s=0.5)
        assert await closer.wait_idle(10)
        await closer.shutdown()
        await hops.aclose()

    asyncio.run(main())
    assert closer.given_up == 1  # three attempts, then the hop's TTL


def test_an_attempt_that_hangs_is_bounded_and_retried() -> None:
    closer = SessionCloser(first_retry_s=0.01, max_retry_s=0.02, attempts=3, timeout_s=0.05)
    calls: list[float] = []

    async def hang() -> bool | None:
        calls.append(time.monotonic())
        await asyncio.sleep(60)
        return True

    async def main() -> None:
        began = time.monotonic()
        assert not await closer.close(hang, "hung", timeout_s=0.05)
        assert time.monotonic() - began < 1
        assert await closer.wait_idle(10)

    asyncio.run(main())
    assert len(calls) == 3 and closer.given_up == 1


@pytest.mark.parametrize("code", ["kv_store_full", "rate_limit_exceeded", "hop_full"])
def test_a_hop_without_room_is_hop_full_not_a_failure(code: str) -> None:
    head = hop_error("full", status=503, failed_hop=None, sender="https://head", sender_is_head=True, code=code)
    assert isinstance(head, HopFull) and head.failed_hop == "https://head"
    deeper = hop_error("full", status=502, failed_hop="https://tail", sender="https://head", sender_is_head=True,
                       code=code)  # fmt: skip
    assert isinstance(deeper, HopFull) and deeper.failed_hop == "https://tail"
    plain = hop_error("boom", status=500, failed_hop=None, sender="https://head", sender_is_head=True, code="x")
    assert type(plain) is BadGateway and not isinstance(plain, HopFailed)


@pytest.mark.parametrize(("named", "blamed"), [("https://b", "https://b"), ("https://c", "https://c"),
                                                ("https://a", "https://b"), ("https://x", "https://b")])  # fmt: skip
def test_a_hop_error_names_only_its_sender_or_a_hop_after_it(named: str, blamed: str) -> None:
    # the route a -> b -> c; b answers (or relays) a failure naming ``named``
    error = hop_error("boom", status=502, failed_hop=named, sender="https://b", sender_is_head=False,
                      may_name=("https://b", "https://c"))  # fmt: skip
    assert isinstance(error, HopFailed) and error.failed_hop == blamed
    full = hop_error("full", status=503, failed_hop=named, sender="https://b", sender_is_head=False,
                     code="kv_store_full", may_name=("https://b", "https://c"))  # fmt: skip
    assert full.failed_hop == blamed and isinstance(full, HopFull) is (named == blamed)


class _RoomlessRoute:
    """A RouteEngine whose prefill meets a hop without room ``full`` times (no sockets: the wire
    methods are replaced), recording what the engine did about it."""

    def __init__(self, tmp_path: Any, full: int, *, room_wait_s: float = 30.0) -> None:
        from meshnet.backends.fake import FakeEngine
        from meshnet.gateway.billing_outbox import BillingOutbox
        from meshnet.gateway.route_engine import RouteEngine

        tokenizer = FakeEngine()
        outbox = BillingOutbox("http://tracker.invalid", spool_dir=tmp_path)
        engine = RouteEngine(tokenizer, "http://tracker.invalid", n_ctx=64, decode_channel=False, outbox=outbox,
                             room_wait_s=room_wait_s, speculative="off")  # fmt: skip
        self.engine, self.full, self.closed, self.planned, self.reported = engine, full, [], [], []
        self.info = tokenizer.info

        async def prefill(run: Any, tokens: Any, cancel: Any) -> Any:
            if self.full:
                self.full -= 1
                raise HopFull("route hop answered 429: member 'gw' holds 2 sessions", failed_hop="http://head")
            return None

        async def plan(**kwargs: Any) -> Any:
            self.planned.append(sorted(kwargs.get("exclude", ())))
            if "head" in kwargs.get("exclude", ()):
                raise Overloaded("no route without head")
            return _plan(self.info)

        engine._prefill = prefill  # type: ignore[method-assign]
        engine.plan = plan  # type: ignore[method-assign]

        async def close(plan: Any) -> None:
            self.closed.append(plan.session_id)

        async def report(*a: Any) -> None:
            self.reported.append(a)

        engine._close = close  # type: ignore[method-assign]
        engine._report_failure = report  # type: ignore[method-assign]

    def run(self) -> list[Any]:
        from meshnet.gateway.billing_outbox import Usage
        from meshnet.gateway.route_engine import _Run
        from meshnet.protocol.ledger import ChunkLedger

        run = _Run(_plan(self.info), SamplingParams(), Usage(), ChunkLedger(sends=False))
        return _steps(self.engine, run)


def _steps(engine: Any, run: Any) -> list[Any]:
    """The steps ``engine._prefill_with_retries`` emits on ``run``."""
    steps: list[Any] = []

    async def emit(step: Any) -> None:
        steps.append(step)

    run.emit = emit
    asyncio.run(engine._prefill_with_retries(run, [1, 2, 3], asyncio.Event()))
    return steps


def _plan(info: Any) -> Any:
    from meshnet.ids import new_route_id, new_session_id
    from meshnet.routes import Hop, RoutePlan

    return RoutePlan(new_session_id(), new_route_id(), (Hop("head", "http://head", info.layers),))


def test_a_hop_without_room_before_the_first_token_means_waiting_not_failing(tmp_path: Any) -> None:
    route = _RoomlessRoute(tmp_path, full=2)
    changes = route.run()
    assert [c.kind for c in changes] == ["wait"] * 4  # per wait: "waiting" on the old session, then the new one
    waiting, moved = changes[0], changes[1]
    assert waiting.failed_node == "head" and "waiting 0.25 s for room" in waiting.reason
    assert moved.plan.session_id != waiting.plan.session_id
    assert route.planned == [["head"], [], ["head"], []]  # around the full node first; none: wait for it
    assert len(route.closed) == 2 and route.reported == []  # what each attempt opened is freed; no failure


def test_waiting_for_room_is_bounded_and_ends_in_a_503(tmp_path: Any) -> None:
    route = _RoomlessRoute(tmp_path, full=100, room_wait_s=0.6)
    with pytest.raises(Overloaded, match="no room on a route") as refused:
        route.run()
    assert refused.value.status == 503 and refused.value.retry_after_s == 5 and route.reported == []


def test_a_hops_400_about_the_request_itself_is_the_requests_error() -> None:
    tail = hop_error("route hop answered 400: too slow", status=400, failed_hop=None, sender="https://tail",
                     sender_is_head=False, code="grammar_too_costly")  # fmt: skip
    assert type(tail) is InvalidRequest
    assert (tail.status, tail.param, tail.code) == (400, "grammar", "grammar_too_costly")
    head = hop_error("route hop answered 400: too slow", status=400, failed_hop=None, sender="https://head",
                     sender_is_head=True, code="grammar_too_costly")  # fmt: skip
    assert type(head) is InvalidRequest and head.failed_hop is None
    # the code on anything but a 400 means nothing more than any failure
    failed = hop_error("boom", status=502, failed_hop="https://tail", sender="https://head", sender_is_head=True,
                       code="grammar_too_costly")  # fmt: skip
    assert isinstance(failed, HopFailed) and failed.failed_hop == "https://tail"


@pytest.mark.parametrize("grammar", [True, False])
def test_a_grammar_too_costly_fails_only_a_request_with_a_grammar(tmp_path: Any, grammar: bool) -> None:
    """The tail's ``grammar_too_costly`` (passed up by the head) is the client's 400 when its request has
    a grammar: no hop reported, no new route. Without a grammar no honest tail says it: the tail failed."""
    from meshnet.gateway.billing_outbox import Usage
    from meshnet.gateway.route_engine import _Run
    from meshnet.protocol.ledger import ChunkLedger

    route = _RoomlessRoute(tmp_path, full=0)
    said = [hop_error("route hop answered 400: sampling took longer than the deadline", status=400, failed_hop=None,
                      sender="http://head", sender_is_head=True, code="grammar_too_costly")]  # fmt: skip

    async def prefill(run: Any, tokens: Any, cancel: Any) -> Any:
        if said:
            raise said.pop()
        return None

    route.engine._prefill = prefill  # type: ignore[method-assign]
    run = _Run(_plan(route.info), SamplingParams(), Usage(), ChunkLedger(sends=False), grammar=grammar)
    if grammar:
        with pytest.raises(InvalidRequest) as refused:
            _steps(route.engine, run)
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, "grammar", "grammar_too_costly")
        assert route.reported == [] and route.planned == []
    else:
        with pytest.raises(Overloaded, match="no route without head"):  # a fresh route without the tail
            _steps(route.engine, run)
        ((_, hop, reason),) = route.reported
        assert hop.node == "head" and "without a grammar" in reason  # a one-hop route: its head is its tail
        assert route.planned == [["head"]]
