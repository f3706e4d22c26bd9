"""Generation Telemetry: the event stream, the polling snapshot and their retention.

Concurrency rule: every method here runs on the gateway's event loop thread. Worker threads
never touch a ``GenerationTelemetry``; they hand results to the loop, which records them. That
keeps this module lock-free.

Event names are a public contract (docs/telemetry.md); clients match on them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meshnet.errors import Conflict, NotFound
from meshnet.ids import GenerationId
from meshnet.routes import Hop
from meshnet.tracker.billing import BillingEstimate

__all__ = [
    "EventType",
    "GenerationTelemetry",
    "Hop",
    "Phase",
    "TelemetryEvent",
    "TelemetryHub",
]


class EventType(StrEnum):
    ROUTE_ACCEPTED = "route.accepted"
    MODEL_SELECTED = "model.selected"
    PREFILL_STARTED = "prefill.started"
    PREFILL_PROGRESS = "prefill.progress"
    PREFILL_COMPLETED = "prefill.completed"
    DECODE_STARTED = "decode.started"
    DECODE_PROGRESS = "decode.progress"
    ROUTE_HEALTH = "route.health"
    ROUTE_RETRY = "route.retry"
    BILLING_ESTIMATE = "billing.estimate"
    GENERATION_COMPLETED = "generation.completed"
    GENERATION_FAILED = "generation.failed"


TERMINAL_EVENTS = frozenset({EventType.GENERATION_COMPLETED, EventType.GENERATION_FAILED})


class Phase(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TelemetryEvent:
    type: EventType
    generation_id: GenerationId
    t: float
    data: Mapping[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "type": str(self.type),
            "generation_id": self.generation_id,
            "t": round(self.t, 4),
            **self.data,
        }

    def encode(self) -> str:
        return json.dumps(self.as_json(), separators=(",", ":"))


# Rolling decode speed is measured over the most recent tokens, so a stall shows up quickly.
_ROLLING_WINDOW = 32
# decode.progress events are throttled; the polling snapshot is always exact.
_PROGRESS_INTERVAL_S = 0.25


@dataclass
class GenerationTelemetry:
    """Everything a client may learn about one generation, past and present."""

    generation_id: GenerationId
    model: str
    quantization: str
    route: tuple[Hop, ...]
    session_id: str
    route_id: str
    accepted_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    prompt_tokens: int = 0
    prefill_done: int = 0
    cached_tokens: int = 0  # prompt tokens the route's prefix caches gave it (not computed)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    retries: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and kept by the route
    accepted_tokens: int = 0
    billing: BillingEstimate | None = None
    events: list[TelemetryEvent] = field(default_factory=list)
    prefill_started_at: float | None = None
    prefill_seconds: float | None = None
    decode_started_at: float | None = None
    _token_times: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=_ROLLING_WINDOW))
    _last_progress_at: float = 0.0
    _hop_ms_sum: list[float] = field(default_factory=list)
    _hop_tokens: int = 0
    _subscribers: set[asyncio.Queue[TelemetryEvent | None]] = field(default_factory=set)

    # -- recording -------------------------------------------------------------------------
    def emit(self, event_type: EventType, **data: Any) -> TelemetryEvent:
        event = TelemetryEvent(event_type, self.generation_id, time.monotonic() - self.accepted_at, data)
        self.events.append(event)
        for queue in self._subscribers:
            queue.put_nowait(event)
        if event_type in TERMINAL_EVENTS:
            for queue in self._subscribers:
                queue.put_nowait(None)
        return event

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.COMPLETED, Phase.FAILED)

    def elapsed(self) -> float:
        return time.monotonic() - self.accepted_at

    def tokens_per_second(self) -> float:
        """Rolling decode speed over the last few tokens (0 until two tokens exist)."""
        times = self._token_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    def mean_tokens_per_second(self) -> float:
        if self.decode_started_at is None or self.completion_tokens < 2 or not self._token_times:
            return 0.0
        span = self._token_times[-1] - self.decode_started_at
        return self.completion_tokens / span if span > 0 else 0.0

    def record_token(self, now: float) -> bool:
        """Count one decoded token; True when a throttled decode.progress event is due."""
        self.completion_tokens += 1
        self._token_times.append(now)
        if now - self._last_progress_at >= _PROGRESS_INTERVAL_S:
            self._last_progress_at = now
            return True
        return False

    def record_hops(self, hop_ms: tuple[float, ...], tokens: int = 1) -> None:
        """Accumulate one decode step's per-hop compute times (routes report them) and the tokens it gave."""
        if len(self._hop_ms_sum) != len(hop_ms):
            self._hop_ms_sum, self._hop_tokens = [0.0] * len(hop_ms), 0
        self._hop_ms_sum = [a + b for a, b in zip(self._hop_ms_sum, hop_ms, strict=True)]
        self._hop_tokens += tokens

    def hop_health(self) -> list[dict[str, Any]]:
        """Per hop: status, the mean time per decoded token of the whole route (``decode_step_ms``)
        and, where the route reports it, the hop's own compute time per decoded token."""
        decode_s = (time.monotonic() - self.decode_started_at) if self.decode_started_at else 0.0
        step = round(1000 * decode_s / self.completion_tokens, 3) if self.completion_tokens else None
        if self._hop_tokens and len(self._hop_ms_sum) == len(self.route):
            compute: list[float | None] = [round(t / self._hop_tokens, 3) for t in self._hop_ms_sum]
        else:
            compute = [None] * len(self.route)
        return [
            {**hop.as_json(), "status": "ok", "decode_step_ms": step, "compute_ms_per_token": ms}
            for hop, ms in zip(self.route, compute, strict=True)
        ]

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        last = self.events[-1] if self.events else None
        return {
            "generation_id": self.generation_id,
            "session_id": self.session_id,
            "route_id": self.route_id,
            "model": self.model,
            "quantization": self.quantization,
            "phase": str(self.phase),
            "finished": self.finished,
            "elapsed": round(self.elapsed(), 4),
            "prompt_tokens": self.prompt_tokens,
            "prefill_done": self.prefill_done,
            "cached_tokens": self.cached_tokens,
            "prefill_seconds": None if self.prefill_seconds is None else round(self.prefill_seconds, 4),
            "completion_tokens": self.completion_tokens,
            "tokens_per_second": round(self.tokens_per_second(), 2),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "billing_units": None if self.billing is None else self.billing.units,
            "route": [hop.as_json() for hop in self.route],
            "retries": self.retries,
            "speculation": {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens},
            "last_event": None if last is None else str(last.type),
            "events": len(self.events),
        }

    async def follow(self, *, keepalive_s: float | None = None) -> AsyncIterator[TelemetryEvent | None]:
        """History first, then live events, ending after the terminal event.

        With ``keepalive_s`` it yields ``None`` whenever that long passes without an event, so a
        transport can keep its connection visibly alive.
        """
        queue: asyncio.Queue[TelemetryEvent | None] = asyncio.Queue()
        history = list(self.events)
        # Decide once, at subscription: events emitted while the history is being yielded land
        # in the queue and must still be delivered, even if the generation finishes meanwhile.
        finished_before = self.finished
        if not finished_before:
            self._subscribers.add(queue)
        try:
            for event in history:
                yield event
            if finished_before:
                return
            while True:
                try:
                    live = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield None
                    continue
                if live is None:
                    return
                yield live
        finally:
            self._subscribers.discard(queue)


class TelemetryHub:
    """All generations this gateway knows: every live one, and the most recent finished ones."""

    def __init__(self, *, keep_finished: int = 1024) -> None:
        self._generations: dict[GenerationId, GenerationTelemetry] = {}
        self._finished: collections.deque[GenerationId] = collections.deque()
        self._keep_finished = keep_finished
        # Subscribers waiting for a proposed id that has not arrived yet: (event, waiter count).
        self._arrivals: dict[GenerationId, tuple[asyncio.Event, int]] = {}

    def open(self, telemetry: GenerationTelemetry) -> GenerationTelemetry:
        gid = telemetry.generation_id
        self.check_free(gid)
        self._generations[gid] = telemetry
        entry = self._arrivals.pop(gid, None)
        if entry is not None:
            entry[0].set()
        return telemetry

    def check_free(self, gid: GenerationId) -> None:
        if gid in self._generations:
            raise Conflict(f"generation id {gid!r} is already in use; propose a fresh one or omit it")

    def known(self, gid: GenerationId) -> bool:
        return gid in self._generations

    def finish(self, telemetry: GenerationTelemetry) -> None:
        self._finished.append(telemetry.generation_id)
        while len(self._finished) > self._keep_finished:
            self._generations.pop(self._finished.popleft(), None)

    def active(self) -> list[GenerationTelemetry]:
        return [g for g in self._generations.values() if not g.finished]

    def get(self, gid: GenerationId) -> GenerationTelemetry:
        try:
            return self._generations[gid]
        except KeyError:
            raise NotFound(f"no generation {gid!r} (unknown, or expired from telemetry retention)") from None

    async def wait_for(self, gid: GenerationId, timeout_s: float) -> GenerationTelemetry:
        """Wait (bounded) for a generation a client announced by proposing its id."""
        if gid in self._generations or timeout_s <= 0:
            return self.get(gid)
        arrival, waiters = self._arrivals.get(gid, (asyncio.Event(), 0))
        self._arrivals[gid] = (arrival, waiters + 1)
        try:
            await asyncio.wait_for(arrival.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            entry = self._arrivals.get(gid)
            if entry is not None:  # still unannounced: drop the entry with its last waiter
                if entry[1] <= 1:
                    del self._arrivals[gid]
                else:
                    self._arrivals[gid] = (entry[0], entry[1] - 1)
        return self.get(gid)
