"""TelemetryHub retention and lookup; GenerationTelemetry event following."""

from __future__ import annotations

import asyncio
import json

import pytest

from meshnet.errors import Conflict, NotFound
from meshnet.gateway.telemetry import (
    EventType,
    GenerationTelemetry,
    Phase,
    TelemetryEvent,
    TelemetryHub,
)
from meshnet.ids import GenerationId
from meshnet.layers import LayerRange
from meshnet.routes import Hop

pytestmark = pytest.mark.timeout(10)

TIMEOUT_S = 2.0


def _tel(gid: str = "gen-1") -> GenerationTelemetry:
    return GenerationTelemetry(
        generation_id=GenerationId(gid),
        model="fake-model",
        quantization="F32",
        route=(Hop(node="local", url="http://n1", layers=LayerRange.full(4)),),
        session_id="ses-1",
        route_id="rte-1",
    )


def _complete(tel: GenerationTelemetry) -> None:
    """What the generation service does at the end: phase first, then the terminal event."""
    tel.phase = Phase.COMPLETED
    tel.emit(EventType.GENERATION_COMPLETED, finish_reason="stop")


def _types(events) -> list[str]:
    return [str(e.type) for e in events]


# -- hub -----------------------------------------------------------------------------------------
def test_open_then_get():
    hub = TelemetryHub()
    tel = hub.open(_tel("gen-a"))
    assert hub.get(GenerationId("gen-a")) is tel
    assert hub.active() == [tel]


def test_open_duplicate_is_conflict():
    hub = TelemetryHub()
    hub.open(_tel("gen-a"))
    with pytest.raises(Conflict) as info:
        hub.open(_tel("gen-a"))
    assert info.value.status == 409


def test_open_duplicate_of_a_finished_generation_is_conflict():
    hub = TelemetryHub()
    tel = hub.open(_tel("gen-a"))
    _complete(tel)
    hub.finish(tel)
    with pytest.raises(Conflict):
        hub.open(_tel("gen-a"))


def test_get_unknown_is_not_found():
    with pytest.raises(NotFound) as info:
        TelemetryHub().get(GenerationId("gen-nope"))
    assert info.value.status == 404


def test_retention_keeps_at_most_keep_finished():
    hub = TelemetryHub(keep_finished=2)
    live = hub.open(_tel("gen-live"))
    for i in range(5):
        tel = hub.open(_tel(f"gen-{i}"))
        _complete(tel)
        hub.finish(tel)
    for i in range(3):
        with pytest.raises(NotFound):
            hub.get(GenerationId(f"gen-{i}"))
    assert hub.get(GenerationId("gen-3")).finished
    assert hub.get(GenerationId("gen-4")).finished
    # Live generations are never evicted by retention.
    assert hub.get(GenerationId("gen-live")) is live
    assert hub.active() == [live]
    # An evicted id may be used again.
    hub.open(_tel("gen-0"))


def test_active_lists_only_unfinished():
    hub = TelemetryHub()
    a = hub.open(_tel("gen-a"))
    b = hub.open(_tel("gen-b"))
    _complete(a)
    hub.finish(a)
    assert hub.active() == [b]


# -- events and snapshot ---------------------------------------------------------------------------
def test_emit_records_events_with_generation_id_and_monotonic_t():
    tel = _tel("gen-e")
    first = tel.emit(EventType.ROUTE_ACCEPTED, session_id="ses-1")
    second = tel.emit(EventType.MODEL_SELECTED, model="fake-model")
    assert tel.events == [first, second]
    assert first.t <= second.t
    body = json.loads(first.encode())
    assert body["type"] == "route.accepted"
    assert body["generation_id"] == "gen-e"
    assert body["session_id"] == "ses-1"
    assert isinstance(body["t"], float)


def test_snapshot_reflects_state():
    tel = _tel("gen-s")
    tel.prompt_tokens = 5
    tel.emit(EventType.ROUTE_ACCEPTED)
    snap = tel.snapshot()
    assert snap["generation_id"] == "gen-s"
    assert snap["phase"] == "queued"
    assert snap["finished"] is False
    assert snap["prompt_tokens"] == 5
    assert snap["last_event"] == "route.accepted"
    assert snap["events"] == 1
    assert snap["route"] == [{"node": "local", "url": "http://n1", "layers": "0:4"}]
    _complete(tel)
    snap = tel.snapshot()
    assert snap["phase"] == "completed"
    assert snap["finished"] is True
    assert snap["last_event"] == "generation.completed"


def test_record_token_throttles_progress():
    tel = _tel()
    assert tel.record_token(100.0) is True
    assert tel.record_token(100.1) is False
    assert tel.record_token(100.3) is True
    assert tel.completion_tokens == 3
    assert tel.tokens_per_second() == pytest.approx(2 / 0.3)


# -- follow ----------------------------------------------------------------------------------------
async def _collect(agen, limit: int = 100) -> list[TelemetryEvent | None]:
    out: list[TelemetryEvent | None] = []
    async for event in agen:
        out.append(event)
        if len(out) >= limit:
            break
    return out


def test_follow_yields_history_then_live_events_and_ends():
    async def main() -> list[TelemetryEvent | None]:
        tel = _tel()
        tel.emit(EventType.ROUTE_ACCEPTED)
        tel.emit(EventType.MODEL_SELECTED)
        task = asyncio.create_task(_collect(tel.follow()))
        await asyncio.sleep(0)  # let the follower take its history and subscribe
        tel.emit(EventType.PREFILL_STARTED)
        await asyncio.sleep(0)
        tel.emit(EventType.DECODE_STARTED)
        _complete(tel)
        tel.emit(EventType.ROUTE_HEALTH)  # after the terminal event: not delivered
        return await asyncio.wait_for(task, TIMEOUT_S)

    events = asyncio.run(main())
    assert _types(events) == [
        "route.accepted",
        "model.selected",
        "prefill.started",
        "decode.started",
        "generation.completed",
    ]


def test_follow_keeps_live_events_that_arrive_while_history_is_yielded():
    async def main() -> list[TelemetryEvent | None]:
        tel = _tel()
        tel.emit(EventType.ROUTE_ACCEPTED)
        tel.emit(EventType.MODEL_SELECTED)
        agen = tel.follow()
        out = [await anext(agen)]  # history taken, follower subscribed, one history event left
        tel.emit(EventType.DECODE_STARTED)
        _complete(tel)
        out += await asyncio.wait_for(_collect(agen), TIMEOUT_S)
        return out

    assert _types(asyncio.run(main())) == [
        "route.accepted",
        "model.selected",
        "decode.started",
        "generation.completed",
    ]


def test_follow_ends_after_generation_failed():
    async def main() -> list[TelemetryEvent | None]:
        tel = _tel()
        task = asyncio.create_task(_collect(tel.follow()))
        await asyncio.sleep(0)
        tel.phase = Phase.FAILED
        tel.emit(EventType.GENERATION_FAILED, reason="boom")
        return await asyncio.wait_for(task, TIMEOUT_S)

    assert _types(asyncio.run(main())) == ["generation.failed"]


def test_late_subscriber_gets_full_history_and_ends():
    async def main() -> tuple[list[TelemetryEvent | None], GenerationTelemetry]:
        tel = _tel()
        for kind in (EventType.ROUTE_ACCEPTED, EventType.MODEL_SELECTED, EventType.DECODE_STARTED):
            tel.emit(kind)
        _complete(tel)
        events = await asyncio.wait_for(_collect(tel.follow()), TIMEOUT_S)
        return events, tel

    events, tel = asyncio.run(main())
    assert events == tel.events
    assert _types(events)[-1] == "generation.completed"
    assert not tel._subscribers


def test_several_followers_see_the_same_events():
    async def main() -> list[list[TelemetryEvent | None]]:
        tel = _tel()
        tel.emit(EventType.ROUTE_ACCEPTED)
        tasks = [asyncio.create_task(_collect(tel.follow())) for _ in range(3)]
        await asyncio.sleep(0)
        tel.emit(EventType.PREFILL_STARTED)
        _complete(tel)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S))

    results = asyncio.run(main())
    assert all(_types(r) == ["route.accepted", "prefill.started", "generation.completed"] for r in results)


def test_follow_yields_none_as_keepalive():
    async def main() -> list[TelemetryEvent | None]:
        tel = _tel()
        tel.emit(EventType.ROUTE_ACCEPTED)
        agen = tel.follow(keepalive_s=0.01)
        out = [await anext(agen), await asyncio.wait_for(anext(agen), TIMEOUT_S)]
        tel.emit(EventType.PREFILL_STARTED)
        # Keepalives may interleave; the live event still arrives.
        while True:
            event = await asyncio.wait_for(anext(agen), TIMEOUT_S)
            out.append(event)
            if event is not None:
                break
        await agen.aclose()
        assert not tel._subscribers  # closing the follower unsubscribes it
        return out

    events = asyncio.run(main())
    assert _types(events[:1]) == ["route.accepted"]
    assert events[1] is None
    assert events[-1] is not None
    assert str(events[-1].type) == "prefill.started"


# -- wait_for --------------------------------------------------------------------------------------
def test_wait_for_returns_a_known_generation_at_once():
    async def main() -> None:
        hub = TelemetryHub()
        tel = hub.open(_tel("gen-k"))
        assert await hub.wait_for(GenerationId("gen-k"), 0) is tel
        assert await hub.wait_for(GenerationId("gen-k"), TIMEOUT_S) is tel

    asyncio.run(main())


def test_wait_for_returns_once_the_generation_is_opened():
    async def main() -> None:
        hub = TelemetryHub()
        waiters = [asyncio.create_task(hub.wait_for(GenerationId("gen-w"), TIMEOUT_S)) for _ in range(2)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        tel = hub.open(_tel("gen-w"))
        results = await asyncio.wait_for(asyncio.gather(*waiters), TIMEOUT_S)
        assert all(r is tel for r in results)
        assert not hub._arrivals

    asyncio.run(main())


def test_wait_for_raises_not_found_after_its_timeout():
    async def main() -> float:
        hub = TelemetryHub()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(NotFound):
            await hub.wait_for(GenerationId("gen-never"), 0.05)
        elapsed = loop.time() - start
        assert not hub._arrivals  # the last waiter cleans up
        return elapsed

    elapsed = asyncio.run(main())
    assert 0.04 <= elapsed < TIMEOUT_S


def test_wait_for_with_zero_timeout_raises_not_found_at_once():
    async def main() -> None:
        with pytest.raises(NotFound):
            await TelemetryHub().wait_for(GenerationId("gen-never"), 0)

    asyncio.run(main())
