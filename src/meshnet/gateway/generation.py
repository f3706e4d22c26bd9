"""Running one generation: the worker, and the async service that feeds telemetry.

The worker owns the engine call, the text decoding and the stop logic (``_Consumer``), so the
engine never computes a token nobody asked for, and reports through a callback. A local engine
computes on the caller's thread: ``run_worker`` runs on an executor thread and ``GenerationService``
hands each report to the event loop. An async engine (the route engine: it only waits on the
network) runs as a task on the loop itself (``run_async_worker``). All telemetry is recorded on
the loop. A client that goes away sets ``cancel``; the worker stops at the next step.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeGuard

from meshnet.backends.base import AnyEngine, AsyncTextEngine, EngineStep, PrefillProgress, RouteChange, Stop, TextEngine
from meshnet.errors import EngineError, MeshnetError, Overloaded, RouteInconsistent
from meshnet.gateway.metrics import GatewayMetrics
from meshnet.gateway.telemetry import EventType, GenerationTelemetry, Phase, TelemetryHub
from meshnet.routes import RoutePlan
from meshnet.sampling import Alternatives, Sampler, SamplingParams
from meshnet.tracker.billing import estimate

__all__ = [
    "Delta",
    "Failed",
    "Finished",
    "GenerationRequest",
    "GenerationService",
    "Heartbeat",
    "StopMatcher",
    "is_async",
    "plan_route",
    "release_route",
    "run_async_worker",
    "run_worker",
]

HEARTBEAT_S = 0.5
_log = logging.getLogger("meshnet.gateway")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    plan: RoutePlan | None = None
    trusted_only: bool = False  # its route over trusted nodes only (the API key's policy)
    prefix_namespace: bytes = b""  # the prefix-cache namespace of its prompt (the API key's)


@dataclass(frozen=True, slots=True)
class Delta:
    """One decoded token and the text it released (may be empty: partial UTF-8, held stop prefix)."""

    text: str
    token: int
    logprob: float
    hop_ms: tuple[float, ...] = ()
    drafted: int = 0  # speculative decoding: drafts verified with this token's step, and kept
    accepted: int = 0
    top: Alternatives = ()  # the most likely tokens at this position (top_logprobs)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str  # text held back until the end (a stop-string prefix that never completed)


@dataclass(frozen=True, slots=True)
class Failed:
    error: MeshnetError


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Nothing new for a while; streaming clients get an empty delta with telemetry."""


WorkerReport = PrefillProgress | RouteChange | Delta | Finished | Failed
StreamItem = Delta | Finished | Failed | Heartbeat


class StopMatcher:
    """Holds back text that might be the start of a stop string; cuts at the first full match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, stopped)``."""
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = min((i for s in self._stops if (i := buf.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        keep = max((_overlap(buf, s) for s in self._stops), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _overlap(buf: str, stop: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``stop``."""
    for n in range(min(len(buf), len(stop) - 1), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0


def is_async(engine: AnyEngine) -> TypeGuard[AsyncTextEngine]:
    """Whether ``engine`` generates as coroutines on the event loop (the route engine)."""
    return inspect.iscoroutinefunction(engine.generate)


async def plan_route(engine: AnyEngine, **size: Any) -> RoutePlan:
    """``engine.plan``: on the loop for an async engine, else off it (it may ask a tracker)."""
    if is_async(engine):
        return await engine.plan(**size)
    local: TextEngine = engine  # type: ignore[assignment]
    return await asyncio.get_running_loop().run_in_executor(None, lambda: local.plan(**size))


async def release_route(engine: AnyEngine, plan: RoutePlan) -> None:
    if is_async(engine):
        await engine.release(plan)
    else:
        engine.release(plan)


class _Consumer:
    """Turns engine steps into reports: text decoding, stop strings, ``max_tokens``."""

    def __init__(self, engine: AnyEngine, request: GenerationRequest,
                 report: Callable[[WorkerReport], None]) -> None:  # fmt: skip
        self.engine, self.request, self.report = engine, request, report
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = StopMatcher(request.stop)
        self.produced = 0
        self.finished: Finished | None = None

    def sampler(self) -> Sampler:
        """The request's sampler, its grammar compiled against the engine's vocabulary."""
        sampling = self.request.sampling
        return Sampler(sampling, self.engine.grammar(sampling.grammar) if sampling.grammar else None)

    @contextlib.contextmanager
    def failures_reported(self) -> Iterator[None]:
        """Every outcome, errors included, ends in a report: an error in the block is one ``Failed``."""
        try:
            yield
        except MeshnetError as exc:
            self.report(Failed(exc))
        except Exception as exc:  # an engine bug must still end the generation visibly
            self.report(Failed(EngineError(f"{type(exc).__name__}: {exc}")))

    def take(self, step: EngineStep) -> bool:
        """Report ``step``; whether the generation goes on."""
        if isinstance(step, PrefillProgress | RouteChange):
            self.report(step)
            return True
        if self.engine.is_end_of_generation(step.token):
            self.finished = Finished("stop", self._rest())
            return False
        self.produced += 1
        text, stopped = self.stops.feed(self.decoder.decode(self.engine.token_bytes(step.token)))
        self.report(Delta(text, step.token, step.logprob, step.hop_ms, step.drafted, step.accepted, step.top))
        if stopped:
            self.finished = Finished("stop", "")
        elif self.produced >= self.request.max_tokens:
            self.finished = Finished("length", self._rest())
        return self.finished is None

    def end(self, cancelled: bool) -> None:
        """Reported only once the engine closed the generation (a route: its session freed, its
        prompt blocks in the hops' prefix caches), so a client's next turn finds them there."""
        if self.finished is None:  # the engine ran out of context (or was cancelled) before any other stop condition
            self.finished = Finished("cancelled" if cancelled else "length", self._rest())
        self.report(self.finished)

    def _rest(self) -> str:
        return self.stops.flush() + self.decoder.decode(b"", final=True)


def run_worker(
    engine: TextEngine,
    request: GenerationRequest,
    cancel: threading.Event,
    report: Callable[[WorkerReport], None],
) -> None:
    """Drive a local ``engine`` for one generation; every outcome, errors included, ends in a report."""
    consumer = _Consumer(engine, request, report)
    with consumer.failures_reported():
        steps = engine.generate(request.prompt_tokens, consumer.sampler(), cancel, request.plan)
        with contextlib.closing(steps):
            for step in steps:
                if not consumer.take(step):
                    break
        consumer.end(cancel.is_set())


async def run_async_worker(
    engine: AsyncTextEngine,
    request: GenerationRequest,
    cancel: asyncio.Event,
    report: Callable[[WorkerReport], None],
) -> None:
    """``run_worker`` for an async engine, on the event loop."""
    consumer = _Consumer(engine, request, report)

    async def emit(step: EngineStep) -> None:
        if not consumer.take(step):
            raise Stop

    with consumer.failures_reported():
        await engine.generate(request.prompt_tokens, consumer.sampler(), cancel, request.plan, emit)
        consumer.end(cancel.is_set())


class GenerationService:
    """Queues generations in front of an engine and turns worker reports into telemetry."""

    def __init__(self, engine: AnyEngine, hub: TelemetryHub, metrics: GatewayMetrics, *, max_queue: int = 64) -> None:
        self.engine = engine
        self.hub = hub
        self.metrics = metrics
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(engine.max_concurrency)
        self._executor = ThreadPoolExecutor(engine.max_concurrency, thread_name_prefix="meshnet-engine")
        self._tasks: set[asyncio.Task[None]] = set()  # an async engine's generations
        self.waiting = 0

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _launch(
        self, request: GenerationRequest, queue: asyncio.Queue[WorkerReport]
    ) -> tuple[threading.Event | asyncio.Event, asyncio.Future[None]]:
        """Start the worker: a task on this loop for an async engine, else an executor thread."""
        engine = self.engine
        if is_async(engine):
            cancel = asyncio.Event()
            task = asyncio.ensure_future(run_async_worker(engine, request, cancel, queue.put_nowait))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return cancel, task
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def report(item: WorkerReport) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        local: TextEngine = engine  # type: ignore[assignment]
        return stop, loop.run_in_executor(self._executor, run_worker, local, request, stop, report)

    async def stream(self, request: GenerationRequest, tel: GenerationTelemetry) -> AsyncIterator[StreamItem]:
        """Yield deltas (and heartbeats) until one ``Finished`` or ``Failed``; always ends the telemetry."""
        try:
            async for beat in self._acquire_slot(tel):
                yield beat
        except BaseException:
            self._fail(tel, EngineError("cancelled while queued"), reason="cancelled")
            raise
        queue: asyncio.Queue[WorkerReport] = asyncio.Queue()
        self._begin_prefill(tel)
        cancel, future = self._launch(request, queue)
        # The slot frees only when the worker really stopped, so the next generation never
        # finds the engine busy.
        future.add_done_callback(lambda _: self._slots.release())
        ended = False
        try:
            while not ended:
                if queue.empty():
                    try:
                        item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                    except TimeoutError:
                        yield Heartbeat()
                        continue
                else:
                    item = queue.get_nowait()
                if isinstance(item, PrefillProgress):
                    self._on_prefill(tel, item)
                    continue
                if isinstance(item, RouteChange):
                    self._on_route_change(tel, item)
                    continue
                if isinstance(item, Delta):
                    self._on_token(tel, item)
                elif isinstance(item, Finished):
                    self._complete(tel, item.finish_reason)
                    ended = True
                else:
                    self._fail(tel, item.error)
                    ended = True
                yield item
        finally:
            cancel.set()
            if not ended:
                self._fail(tel, EngineError("the client disconnected"), reason="cancelled")

    def admit(self, tel: GenerationTelemetry) -> None:
        """Refuse up front (before any response starts) when the queue is full."""
        if self.waiting >= self.max_queue:
            error = Overloaded(f"{self.waiting} requests are already queued; retry shortly", retry_after_s=2)
            self._fail(tel, error)
            raise error

    def abandon(self, tel: GenerationTelemetry, reason: str) -> None:
        """End the telemetry of a generation whose client left before it ever started."""
        self._fail(tel, EngineError(reason), reason="cancelled")

    async def _acquire_slot(self, tel: GenerationTelemetry) -> AsyncIterator[Heartbeat]:
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        try:
            reported = False
            while True:
                try:
                    await asyncio.wait_for(self._slots.acquire(), HEARTBEAT_S)
                    return
                except TimeoutError:
                    if not reported:
                        tel.emit(EventType.ROUTE_HEALTH, status="queued", queue_depth=self.waiting, hops=[])
                        reported = True
                    yield Heartbeat()
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)

    # -- telemetry transitions (event loop thread only) ----------------------------------------
    def _begin_prefill(self, tel: GenerationTelemetry) -> None:
        tel.phase = Phase.PREFILL
        tel.prefill_started_at = time.monotonic()
        tel.emit(EventType.PREFILL_STARTED, prompt_tokens=tel.prompt_tokens)
        self.metrics.active.inc()

    def _on_prefill(self, tel: GenerationTelemetry, progress: PrefillProgress) -> None:
        tel.prefill_done, tel.cached_tokens = progress.done, progress.cached
        tel.emit(EventType.PREFILL_PROGRESS, done=progress.done, total=progress.total, cached=progress.cached)
        if progress.done < progress.total:
            return
        now = time.monotonic()
        seconds = now - (tel.prefill_started_at or now)
        tel.prefill_seconds = seconds
        self.metrics.prefill_seconds.observe(seconds)
        tel.emit(
            EventType.PREFILL_COMPLETED,
            prompt_tokens=progress.total,
            cached_tokens=progress.cached,
            seconds=round(seconds, 4),
            tokens_per_second=round(progress.total / seconds, 2) if seconds > 0 else None,
        )
        self._emit_billing(tel)
        tel.phase = Phase.DECODE
        tel.decode_started_at = time.monotonic()
        tel.emit(EventType.DECODE_STARTED)

    def _on_route_change(self, tel: GenerationTelemetry, change: RouteChange) -> None:
        """A hop failed and the route engine recovered: say so, with the reason and the new route."""
        if change.kind == "wait" and change.plan.session_id == tel.session_id:  # no room yet: waiting
            _log.info("generation %s waits for room: %s", tel.generation_id, change.reason)
            tel.emit(EventType.ROUTE_HEALTH, status="waiting", reason=change.reason, node=change.failed_node,
                     hops=[])  # fmt: skip
            return
        failed = next((h for h in tel.route if h.node == change.failed_node), None)
        tel.route, tel.session_id, tel.route_id = change.plan.hops, change.plan.session_id, change.plan.route_id
        tel.retries += 1
        self.metrics.route_retries.labels(kind=change.kind).inc()
        self.metrics.route_recovery_seconds.labels(kind=change.kind).observe(change.seconds)
        self.metrics.route_replayed_positions.labels(kind=change.kind).inc(change.replayed)
        (_log.info if change.kind == "wait" else _log.warning)(  # a wait for room is no failure
            "route %s (attempt %d): generation %s session %s: node %s%s failed (%s); route now %s; "
            "%d positions replayed in %.3fs",
            change.kind,
            change.attempt,
            tel.generation_id,
            tel.session_id,
            change.failed_node,
            f" (layers {failed.layers})" if failed is not None else "",
            change.reason,
            " -> ".join(f"{h.node}[{h.layers}]" for h in change.plan.hops),
            change.replayed,
            change.seconds,
        )
        tel.emit(
            EventType.ROUTE_RETRY,
            kind=change.kind,
            attempt=change.attempt,
            reason=change.reason,
            failed_node=change.failed_node,
            replayed_positions=change.replayed,
            seconds=round(change.seconds, 4),
            session_id=tel.session_id,
            route_id=tel.route_id,
            nodes=[hop.as_json() for hop in tel.route],
        )
        if change.kind == "reroute" and tel.phase == Phase.PREFILL:
            tel.prefill_done = 0

    def _on_token(self, tel: GenerationTelemetry, delta: Delta) -> None:
        if delta.hop_ms and tel.completion_tokens:  # the first token's hop times are the prompt's
            tel.record_hops(delta.hop_ms, delta.accepted + 1 if delta.drafted else 1)
        if delta.drafted:
            tel.drafted_tokens += delta.drafted
            tel.accepted_tokens += delta.accepted
        if tel.record_token(time.monotonic()):
            tel.emit(EventType.DECODE_PROGRESS, **_progress(tel))

    def _emit_billing(self, tel: GenerationTelemetry) -> None:
        layers = sum(len(hop.layers) for hop in tel.route)
        tel.billing = estimate(prompt_tokens=tel.prompt_tokens, completion_tokens=tel.completion_tokens, layers=layers)
        tel.emit(EventType.BILLING_ESTIMATE, **tel.billing.as_json())

    def _emit_health(self, tel: GenerationTelemetry) -> None:
        tel.emit(EventType.ROUTE_HEALTH, status="ok", hops=tel.hop_health())

    def _complete(self, tel: GenerationTelemetry, finish_reason: str) -> None:
        tel.finish_reason = finish_reason
        tel.emit(EventType.DECODE_PROGRESS, **_progress(tel))
        self._emit_health(tel)
        self._emit_billing(tel)
        tel.phase = Phase.COMPLETED
        tel.emit(
            EventType.GENERATION_COMPLETED,
            finish_reason=finish_reason,
            prompt_tokens=tel.prompt_tokens,
            completion_tokens=tel.completion_tokens,
            tokens_per_second=round(tel.mean_tokens_per_second(), 2),
            seconds=round(tel.elapsed(), 4),
        )
        self._record_metrics(tel, "completed")

    def _fail(self, tel: GenerationTelemetry, error: MeshnetError, *, reason: str | None = None) -> None:
        if tel.finished:
            return
        tel.error = error.message
        tel.finish_reason = reason or "error"
        if isinstance(error, RouteInconsistent):
            self.metrics.route_inconsistencies.inc()
            _log.error("generation %s stopped: its route is inconsistent: %s", tel.generation_id, error.message)
        tel.phase = Phase.FAILED
        tel.emit(EventType.ROUTE_HEALTH, status="failed", reason=error.message, hops=[])
        tel.emit(EventType.GENERATION_FAILED, reason=error.message, code=error.code or error.error_type)
        self._record_metrics(tel, reason or "failed")

    def _record_metrics(self, tel: GenerationTelemetry, outcome: str) -> None:
        self.hub.finish(tel)
        m = self.metrics
        if tel.prefill_started_at is not None:
            m.active.dec()
        m.generations.labels(outcome=outcome).inc()
        m.prompt_tokens.inc(tel.prompt_tokens)
        m.completion_tokens.inc(tel.completion_tokens)
        if tel.decode_started_at is not None and tel.completion_tokens:
            m.decode_seconds.observe(time.monotonic() - tel.decode_started_at)
            m.decode_tokens_per_second.set(tel.mean_tokens_per_second())


def _progress(tel: GenerationTelemetry) -> dict[str, Any]:
    """A decode.progress event's fields; speculative decoding's counts once it drafted."""
    fields: dict[str, Any] = {
        "completion_tokens": tel.completion_tokens,
        "tokens_per_second": round(tel.tokens_per_second(), 2),
    }
    if tel.drafted_tokens:
        fields.update(drafted_tokens=tel.drafted_tokens, accepted_tokens=tel.accepted_tokens)
    return fields
