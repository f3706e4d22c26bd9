"""A shard node's HTTP surface: the binary prefill/decode protocol, forwarding, health, metrics.

Flow of one request: validate headers and body (``protocol.wire``) → check the session's route
binding → compute this shard's layers on a worker thread → forward the result to the next hop
over a kept-alive connection → answer. The tail samples the next token (``meshnet.sampling``)
and its answer (token, logprob, per-hop timings) travels back up the chain.

Pipelined prefill: a non-final prefill chunk is answered ``202`` as soon as this node has
computed it and queued the forward; forwards of one session leave in position order. A forward
that fails marks the session *broken* on this node: every later request on it gets the reason,
so a session is either advanced on every hop or reported broken — never silently diverged.

Concurrency: one request per session at a time (a second gets 409); compute is serialized by
the shard backend; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.backends.shard import ShardBackend
from meshnet.errors import (
    BadGateway,
    Conflict,
    InvalidRequest,
    MeshnetError,
    PayloadTooLarge,
    SeamMismatch,
    SessionBusy,
    SessionGone,
    SessionNotFound,
)
from meshnet.httputil import EXCEPTION_HANDLERS, error_message
from meshnet.ids import SessionId
from meshnet.node.metrics import NodeMetrics
from meshnet.protocol import headers as H
from meshnet.protocol.wire import decode_tensor, encode_tensor, format_shape, parse_range
from meshnet.sampling import Sampler, SamplingParams

__all__ = ["NodeConfig", "create_node_app"]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str
    url: str
    wire_dtype: str = "bfloat16"  # what this node sends to the next hop
    max_body_bytes: int = 256 * 2**20
    hop_timeout_s: float = 120.0
    sweep_interval_s: float = 5.0
    tracker_url: str | None = None
    heartbeat_s: float = 5.0
    # Extra fields for the tracker registration (e.g. the artifact manifest digest and held files).
    advert: tuple[tuple[str, Any], ...] = ()


@dataclass
class _Route:
    """What a node remembers about a session beyond its KV: the route binding and the tail's sampler."""

    route_id: str
    next_hops: tuple[str, ...]
    sampler: Sampler | None
    busy: bool = False
    broken: str | None = None
    forward: asyncio.Task[Any] | None = None
    pending: list[asyncio.Task[Any]] = field(default_factory=list)


class _Node:
    def __init__(self, shard: ShardBackend, config: NodeConfig) -> None:
        self.shard = shard
        self.config = config
        self.info = shard.info
        self.routes: dict[SessionId, _Route] = {}
        self.metrics = NodeMetrics()
        self.started = time.time()
        self.client: httpx.AsyncClient | None = None

    # -- request plumbing ----------------------------------------------------------------------
    def check_model(self, request: Request) -> None:
        model = request.headers.get(H.MODEL)
        if model is not None and model != self.info.model_id:
            raise Conflict(f"this node serves model {self.info.model_id!r}, the request is for {model!r}")

    def check_length(self, request: Request) -> None:
        """Refuse an oversized body from its Content-Length, before reading it into memory."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise PayloadTooLarge(
                f"body of {declared} bytes exceeds this node's limit of {self.config.max_body_bytes} bytes"
            )

    def session_route(self, sid: SessionId, request: Request, *, start: int) -> _Route:
        route = self.routes.get(sid)
        route_id = request.headers.get(H.ROUTE_ID)
        if route is None:
            if start != 0:
                # A session that is past position 0 existed once: this node lost it.
                raise SessionGone(
                    f"session {sid} is unknown at position {start}: this node restarted or the session "
                    "expired; start a fresh prefill"
                )
            if not route_id:
                raise InvalidRequest(f"header {H.ROUTE_ID} is required on a session's first request")
            route = _Route(route_id, self._next_hops(request), self._sampler(request))
            self.shard.open_session(sid)
            self.routes[sid] = route
            return route
        if route_id is not None and route_id != route.route_id:
            raise Conflict(f"session {sid} is pinned to route {route.route_id}, not {route_id}")
        if route.broken:
            raise Conflict(f"session {sid} is broken on this node: {route.broken}", code="session_broken")
        return route

    def _next_hops(self, request: Request) -> tuple[str, ...]:
        raw = request.headers.get(H.NEXT_HOPS, "")
        hops = tuple(h.strip().rstrip("/") for h in raw.split(",") if h.strip())
        if self.info.layers.is_tail and hops:
            raise InvalidRequest("the tail node has no next hop; drop the X-Meshnet-Next-Hops header")
        if not self.info.layers.is_tail and not hops:
            raise InvalidRequest(f"node {self.config.node_id} ({self.info.layers}) needs {H.NEXT_HOPS}")
        return hops

    def _sampler(self, request: Request) -> Sampler | None:
        if not self.info.layers.is_tail:
            return None
        raw = request.headers.get(H.SAMPLING)
        try:
            params = SamplingParams(**json.loads(raw)) if raw else SamplingParams(temperature=0.0)
            return Sampler(params)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"{H.SAMPLING} must be JSON sampling parameters: {exc}") from None

    def inputs(self, request: Request, body: bytes, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Decode the body into (tokens, hidden) for this shard, checking the seam shape."""
        data = decode_tensor(
            body,
            request.headers.get(H.SHAPE),
            request.headers.get(H.DTYPE),
            max_bytes=self.config.max_body_bytes,
        )
        if self.info.layers.is_head:
            if data.dtype != np.int32 or data.shape != (1, n):
                raise SeamMismatch(f"the head takes int32 token ids of shape 1,{n}, got {data.dtype} {data.shape}")
            return data.reshape(n), None
        want = (1, n, *self.info.seam.shape)
        if data.dtype != np.float32 or data.shape != want:
            raise SeamMismatch(f"this node takes activations of shape {format_shape(want)}, got {list(data.shape)}")
        return None, data.reshape(want[1:])

    # -- compute and forward -----------------------------------------------------------------
    async def run(
        self, sid: SessionId, start: int, tokens: np.ndarray | None, hidden: np.ndarray | None
    ) -> tuple[np.ndarray | None, np.ndarray | None, float]:
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        out = await loop.run_in_executor(None, lambda: self.shard.prefill(sid, start, tokens=tokens, hidden=hidden))
        return out.hidden, out.logits, 1000 * (time.perf_counter() - began)

    async def forward(
        self, sid: SessionId, route: _Route, path: str, hidden: np.ndarray, headers: dict[str, str]
    ) -> dict[str, Any]:
        assert self.client is not None
        frame = encode_tensor(hidden.reshape(1, *hidden.shape), self.config.wire_dtype)
        url = f"{route.next_hops[0]}/v1/sessions/{sid}/{path}"
        send = {
            **headers,
            H.MODEL: self.info.model_id,
            H.ROUTE_ID: route.route_id,
            H.SHAPE: format_shape(frame.shape),
            H.DTYPE: frame.dtype,
            "Content-Type": "application/octet-stream",
        }
        self.metrics.seam_bytes.inc(len(frame.body))
        try:
            response = await self.client.post(url, content=frame.body, headers=send)
        except httpx.HTTPError as exc:
            raise BadGateway(f"next hop {route.next_hops[0]} failed: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise BadGateway(
                f"next hop {route.next_hops[0]} answered {response.status_code}: {error_message(response)}"
            )
        try:
            return dict(response.json())
        except ValueError:
            raise BadGateway(f"next hop {route.next_hops[0]} sent an answer that is not JSON") from None

    async def delete(self, sid: SessionId) -> None:
        """Free a session here, then on the next hop (the delete travels down the chain)."""
        route = self.routes.pop(sid, None)
        if route is None:
            self.shard.store.get(sid)  # raises 404/410 with the reason
            raise SessionNotFound(f"no session {sid} on this node")
        if route.forward is not None:
            with contextlib.suppress(Exception):
                await route.forward  # its outcome was already recorded; only the order matters
        try:
            self.shard.close_session(sid)
        except SessionBusy:
            self.routes[sid] = route  # still computing: keep it, and say so instead of leaking its KV
            raise
        except (SessionGone, SessionNotFound):
            pass  # already expired on this node; the delete still travels down the chain
        if route.next_hops and self.client is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.delete(f"{route.next_hops[0]}/v1/sessions/{sid}")

    def break_session(self, route: _Route, reason: str) -> None:
        route.broken = route.broken or reason


def create_node_app(shard: ShardBackend, config: NodeConfig) -> Starlette:
    node = _Node(shard, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        node.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.hop_timeout_s, connect=5.0),
            limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=300),
        )
        tasks = [asyncio.create_task(_sweep(node))]
        if config.tracker_url:
            tasks.append(asyncio.create_task(_heartbeat(node, config.tracker_url)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await node.client.aclose()
            shard.close()

    async def prefill(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        node.check_model(request)
        node.check_length(request)
        start, stop = parse_range(request.headers.get(H.TOKEN_RANGE))
        tokens, hidden = node.inputs(request, await request.body(), stop - start)
        final = request.headers.get(H.SAMPLE) == "1"
        return await _handle(node, sid, request, start=start, tokens=tokens, hidden=hidden, final=final)

    async def decode_step(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        node.check_model(request)
        node.check_length(request)
        raw = request.headers.get(H.POSITION)
        if raw is None or not (raw.isascii() and raw.isdigit()):
            raise SeamMismatch(f"header {H.POSITION} must be the step's absolute position, got {raw!r}")
        tokens, hidden = node.inputs(request, await request.body(), 1)
        return await _handle(node, sid, request, start=int(raw), tokens=tokens, hidden=hidden, final=True, decode=True)

    async def delete_session(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        await node.delete(sid)
        return JSONResponse({"deleted": sid})

    async def health(_: Request) -> Response:
        store = shard.store
        info = shard.info
        return JSONResponse(
            {
                "status": "ok",
                "node_id": config.node_id,
                "url": config.url,
                "model": info.model_id,
                "architecture": info.architecture,
                "backend": info.backend,
                "layers": str(info.layers),
                "total_layers": info.layers.total,
                "sessions": len(store),
                "kv_bytes_used": store.bytes_used(),
                "kv_bytes_free": store.free_bytes(),
                "kv_bytes_per_token": info.kv.bytes_per_token,
                "max_sessions": store.limits.max_sessions,
                "max_positions": info.max_positions,
                "weight_bytes": info.weight_bytes,
                "seam": list(info.seam.shape),
                "started": node.started,
            }
        )

    async def metrics(_: Request) -> Response:
        node.metrics.sessions.set(len(shard.store))
        node.metrics.kv_bytes.set(shard.store.bytes_used())
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/sessions/{session_id}/prefill", prefill, methods=["POST"]),
        Route("/v1/sessions/{session_id}/decode-step", decode_step, methods=["POST"]),
        Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )


async def _handle(
    node: _Node,
    sid: SessionId,
    request: Request,
    *,
    start: int,
    tokens: np.ndarray | None,
    hidden: np.ndarray | None,
    final: bool,
    decode: bool = False,
) -> Response:
    route = node.session_route(sid, request, start=start)
    if route.busy:
        raise SessionBusy(f"session {sid} already has a request in flight on this node; send one at a time")
    route.busy = True
    try:
        out_hidden, logits, compute_ms = await node.run(sid, start, tokens, hidden)
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        node.metrics.positions.inc(n)
        me = {
            "node": node.config.node_id,
            "layers": str(node.info.layers),
            "compute_ms": round(compute_ms, 3),
        }
        if node.info.layers.is_tail:
            if not final:
                return JSONResponse({"accepted": n, "hops": [me]}, status_code=202)
            assert logits is not None and route.sampler is not None
            token, logprob = route.sampler.sample(logits)
            return JSONResponse({"token": token, "logprob": logprob, "position": start + n, "hops": [me]})
        assert out_hidden is not None
        path = "decode-step" if decode else "prefill"
        headers = {H.POSITION: str(start)} if decode else _prefill_headers(request, route, start, start + n, final)
        previous = route.forward

        async def send() -> dict[str, Any]:
            if previous is not None:
                await previous  # forwards leave in position order
            try:
                return await node.forward(sid, route, path, out_hidden, headers)
            except MeshnetError as exc:
                node.break_session(route, exc.message)
                raise

        task: asyncio.Task[Any] = asyncio.ensure_future(send())
        route.forward = task
        if not final:
            task.add_done_callback(_consume)
            return JSONResponse({"accepted": n, "hops": [me]}, status_code=202)
        answer = await task
        answer["hops"] = [me, *answer.get("hops", [])]
        return JSONResponse(answer)
    finally:
        route.busy = False


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the failure is recorded as the session's break reason


def _prefill_headers(request: Request, route: _Route, start: int, stop: int, final: bool) -> dict[str, str]:
    headers = {H.TOKEN_RANGE: f"{start}-{stop - 1}", H.NEXT_HOPS: ",".join(route.next_hops[1:])}
    sampling = request.headers.get(H.SAMPLING)
    if sampling:
        headers[H.SAMPLING] = sampling
    if final:
        headers[H.SAMPLE] = "1"
    return headers


async def _heartbeat(node: _Node, tracker_url: str) -> None:
    """Register, then re-register every ``heartbeat_s``: a restarted tracker relearns us by itself."""
    assert node.client is not None
    info = node.info
    log = logging.getLogger("meshnet.node")
    reported = False
    while True:
        body = {
            "node_id": node.config.node_id,
            "url": node.config.url,
            "model": info.model_id,
            "layers": str(info.layers),
            "total_layers": info.layers.total,
            "backend": info.backend,
            "kv_bytes_free": node.shard.store.free_bytes(),
            **dict(node.config.advert),
        }
        try:
            response = await node.client.post(f"{tracker_url}/v1/nodes", json=body, timeout=5.0)
            if response.status_code >= 400:
                log.warning("tracker refused registration: %s", error_message(response))
            reported = False
        except httpx.HTTPError as exc:
            if not reported:  # say it once per outage, not every heartbeat
                log.warning("tracker %s unreachable (%s); retrying", tracker_url, exc)
                reported = True
        await asyncio.sleep(node.config.heartbeat_s)


async def _sweep(node: _Node) -> None:
    """Expire idle sessions (frees their KV) and forget their route bindings."""
    while True:
        await asyncio.sleep(node.config.sweep_interval_s)
        node.shard.store.expire_idle()
        alive = set(node.shard.store.ids())
        for sid in [s for s in node.routes if s not in alive]:
            node.routes.pop(sid, None)
