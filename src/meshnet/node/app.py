"""A shard node's HTTP surface: the binary prefill/decode protocol, forwarding, health, metrics.

Flow of one request: validate headers and body (``protocol.wire``) → check the session's route
binding → compute this shard's layers on a worker thread → forward the result to the next hop
over a kept-alive connection → answer. The tail samples the next token (``meshnet.sampling``)
and its answer (token, logprob, per-hop timings) travels back up the chain.

Pipelined prefill: a non-final prefill chunk is answered ``202`` as soon as this node has
computed it and queued the forward; forwards of one session leave in position order. A forward
that fails marks the session *broken* on this node: every later request on it gets the reason,
so a session is either advanced on every hop or reported broken — never silently diverged.
Every failure names the innermost hop that failed (``failed_hop``), which is what route repair
replaces.

Route repair (docs/protocol.md): every non-tail node keeps a *seam log* per session — the
activations it sent onward, wire-encoded — within a node-wide byte budget. ``reroute`` points a
session at new next hops and replays the log into them (``X-Meshnet-Replay``: they rebuild
their KV without answering a token), then resends the interrupted step with
``X-Meshnet-Rewind`` so a hop that already computed it drops it first. Nothing upstream
recomputes, and no KV crosses the network.

Speculative decoding (``verify``): a decode step with drafted tokens after it
(``X-Meshnet-Draft``) computes every position as a one-position step would
(``shard.verify_chunk``); the tail keeps the drafts its sampler agrees with plus one token of its
own, and every hop drops the rejected positions as the answer passes it back.

Penalties and grammars: when the session's sampling parameters set a presence or frequency
penalty or a grammar, the token ids travel beside the activations to the tail (and into the seam
logs), which counts the generated ones and brings its grammar state up to them before each choice.

Decode channel (``node.channel``, docs/protocol.md): decode steps may also come as frames on a
kept-open WebSocket. They are validated and computed by the same code; a hop passes the step on
over its own channel to the next hop without waiting, the tail sends its answer straight to the
gateway, and a failure goes to the gateway from the hop that met it. After a verify chunk there,
the hops before the tail drop the rejected drafts when the next step says so (``X-Meshnet-Rewind``).

Concurrency: one request per session at a time (a second gets 409); compute is serialized by
the shard backend; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from meshnet.backends.shard import DecodeStep, ShardBackend, ShardOutput, compute_chunks, verify_chunk
from meshnet.errors import (
    Conflict,
    HopFailed,
    InvalidRequest,
    MeshnetError,
    SeamMismatch,
    SessionBroken,
    SessionBusy,
    SessionGone,
    SessionNotFound,
    hop_error,
)
from meshnet.httputil import EXCEPTION_HANDLERS, check_declared_length, error_field, error_message, read_body
from meshnet.ids import SessionId
from meshnet.node import channel
from meshnet.node.advert import (
    LatencyProber,
    SelfBenchmark,
    Traffic,
    advert_fields,
    benchmark_in_background,
    host_hardware,
)
from meshnet.node.batcher import DecodeBatcher
from meshnet.node.channel import Direct
from meshnet.node.metrics import NodeMetrics
from meshnet.protocol import headers as H
from meshnet.protocol.channel import CHANNEL_PATH, Kind, encode_frame
from meshnet.protocol.ledger import ChunkLedger, format_chunks, pack_chunks, parse_chunks
from meshnet.protocol.wire import (
    TensorFrame,
    decode_tensor,
    encode_tensor,
    format_shape,
    frame_values,
    parse_range,
    split_token_ids,
    token_ids_prefix,
)
from meshnet.routes import hop_timeout_s
from meshnet.sampling import Sampler, SamplingParams

__all__ = ["NodeConfig", "create_node_app"]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str
    url: str
    wire_dtype: str = "float32"  # what this node sends to the next hop (float32: exact)
    max_body_bytes: int = 256 * 2**20
    hop_timeout_s: float = 120.0
    sweep_interval_s: float = 5.0
    tracker_url: str | None = None
    heartbeat_s: float = 5.0
    # Outbound activations kept per session for route repair (all sessions together); 0 turns it off.
    seam_log_bytes: int = 512 * 2**20
    replay_chunk: int = 256  # positions per request when a repair replays the seam log
    # Extra fields for the tracker registration (e.g. the artifact manifest digest and held files).
    advert: tuple[tuple[str, Any], ...] = ()
    client_tls: ssl.SSLContext | None = None  # a private swarm's member TLS, for every outgoing connection


@dataclass
class _Route:
    """What a node remembers about a session beyond its KV: the route binding, the tail's sampler,
    the chunks it computed with their digests (``ledger``) and the seam log."""

    route_id: str
    next_hops: tuple[str, ...]
    sampler: Sampler | None
    ledger: ChunkLedger
    busy: bool = False
    broken: str | None = None
    broken_hop: str | None = None
    forward: asyncio.Task[Any] | None = None
    pending: list[asyncio.Task[Any]] = field(default_factory=list)
    # The seam log: every activation this node sent onward, wire-encoded, positions 0.. in order.
    # A repair replays it into a replacement next hop; ``None`` once dropped (budget) or on the tail.
    log: bytearray | None = field(default_factory=bytearray)
    log_dtype: str = ""
    # beside it, for a model whose every hop reads the token ids: the ids of positions 0.., int32
    ids_log: bytearray = field(default_factory=bytearray)
    # Token ids travel beside the activations to the tail (``carry_ids``) when its choices depend
    # on the tokens generated so far (presence/frequency penalties, a grammar); the tail keeps them by position.
    carry_ids: bool = False
    ids_seen: list[int] = field(default_factory=list)
    seq: int | None = None  # the newest decode-channel step this node computed for the session


class _Node:
    def __init__(self, shard: ShardBackend, config: NodeConfig) -> None:
        self.shard = shard
        self.config = config
        self.info = shard.info
        self.routes: dict[SessionId, _Route] = {}
        self.metrics = NodeMetrics()
        # Decode steps of different sessions that arrive together compute as one batch, where
        # the shard measured that a batch keeps every session's bits (node.batcher).
        self.batcher = DecodeBatcher(shard, self.metrics.batch) if shard.info.decode_batch > 1 else None
        self.started = time.time()
        self.client: httpx.AsyncClient | None = None
        self.traffic = Traffic()  # queue depth and measured speed, for the tracker (node.advert)
        self.log_bytes = 0  # all sessions' seam logs together
        self.peers: dict[str, channel.Peer] = {}  # accepted decode channels by return id
        self.dialer = channel.Dialer(config.max_body_bytes, tls=config.client_tls)  # decode channels to next hops

    # -- request plumbing ----------------------------------------------------------------------
    def check_model(self, headers: Headers) -> None:
        model = headers.get(H.MODEL)
        if model is not None and model != self.info.model_id:
            raise Conflict(f"this node serves model {self.info.model_id!r}, the request is for {model!r}")

    def check_length(self, request: Request) -> None:
        """Refuse an oversized body from its Content-Length, before the headers are parsed or it is read."""
        check_declared_length(request, self.config.max_body_bytes, "this node")

    async def body(self, request: Request) -> bytes:
        """The body, refused past the limit as it streams in too (a chunked upload declares no length)."""
        return await read_body(request, self.config.max_body_bytes, "this node")

    def session_route(self, sid: SessionId, headers: Headers, *, start: int) -> _Route:
        route = self.routes.get(sid)
        route_id = headers.get(H.ROUTE_ID)
        if route is None:
            if start != 0:
                # A session that is past position 0 existed once: this node lost it.
                raise SessionGone(
                    f"session {sid} is unknown at position {start}: this node restarted or the session "
                    "expired; start a fresh prefill"
                )
            if not route_id:
                raise InvalidRequest(f"header {H.ROUTE_ID} is required on a session's first request")
            sends = not self.info.layers.is_tail
            params = self._params(headers)
            sampler = self._sampler(params) if self.info.layers.is_tail else None
            hops = self.next_hops(headers)
            route = _Route(route_id, hops, sampler, ChunkLedger(sends), carry_ids=params.needs_history)
            if self.info.layers.is_tail or self.config.seam_log_bytes <= 0:
                route.log = None
            self.shard.open_session(sid)
            self.routes[sid] = route
            return route
        if route_id is not None and route_id != route.route_id:
            raise Conflict(f"session {sid} is pinned to route {route.route_id}, not {route_id}")
        if route.broken:
            raise SessionBroken(f"session {sid} is broken on this node: {route.broken}",
                                failed_hop=route.broken_hop)  # fmt: skip
        return route

    def next_hops(self, headers: Headers) -> tuple[str, ...]:
        raw = headers.get(H.NEXT_HOPS, "")
        hops = tuple(h.strip().rstrip("/") for h in raw.split(",") if h.strip())
        if self.info.layers.is_tail and hops:
            raise InvalidRequest("the tail node has no next hop; drop the X-Meshnet-Next-Hops header")
        if not self.info.layers.is_tail and not hops:
            raise InvalidRequest(f"node {self.config.node_id} ({self.info.layers}) needs {H.NEXT_HOPS}")
        return hops

    def _sampler(self, params: SamplingParams) -> Sampler:
        """The tail's sampler, with the session's grammar compiled against this shard's vocabulary."""
        return Sampler(params, self.shard.grammar(params.grammar) if params.grammar else None)

    def _params(self, headers: Headers) -> SamplingParams:
        """The session's sampling parameters: the tail samples with them; every hop reads whether
        the token ids must travel to the tail (penalties, grammar)."""
        raw = headers.get(H.SAMPLING)
        try:
            return SamplingParams(**json.loads(raw)) if raw else SamplingParams(temperature=0.0)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"{H.SAMPLING} must be JSON sampling parameters: {exc}") from None

    def inputs(self, headers: Headers, body: bytes, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Decode the body into (tokens, hidden) for this shard, checking the seam shape; past the
        head, the token ids come first in the body when ``X-Meshnet-Token-Ids`` says so."""
        ids: np.ndarray | None = None
        if headers.get(H.TOKEN_IDS) is not None:
            ids, body = self._token_ids(headers[H.TOKEN_IDS], body, n)
        elif not self.info.layers.is_head and self.info.seam.carries_token_ids:
            raise SeamMismatch(
                f"this model's layers read the token ids at every hop: send the chunk's {n} int32 ids first in the "
                f"body, with {H.TOKEN_IDS}: {n}"
            )
        data = decode_tensor(
            body,
            headers.get(H.SHAPE),
            headers.get(H.DTYPE),
            max_bytes=self.config.max_body_bytes,
        )
        if self.info.layers.is_head:
            if data.dtype != np.int32 or data.shape != (1, n):
                raise SeamMismatch(f"the head takes int32 token ids of shape 1,{n}, got {data.dtype} {data.shape}")
            return data.reshape(n), None
        want = (1, n, *self.info.seam.shape)
        if data.dtype != np.float32 or data.shape != want:
            raise SeamMismatch(f"this node takes activations of shape {format_shape(want)}, got {list(data.shape)}")
        return ids, data.reshape(want[1:])

    def drafts(self, headers: Headers) -> tuple[int, ...]:
        """The drafted token ids of a verify chunk (``X-Meshnet-Draft``), within this shard's limit."""
        raw = headers.get(H.DRAFT, "")
        parts = [p.strip() for p in raw.split(",")] if raw.strip() else []
        if not parts or not all(p.isascii() and p.isdigit() for p in parts):
            raise InvalidRequest(f"header {H.DRAFT} must list the drafted token ids, comma-separated, got {raw!r}")
        limit = self.info.max_verify
        if len(parts) > limit:
            why = f"at most {limit} per verify chunk" if limit else "none: it cannot drop rejected drafts"
            raise InvalidRequest(f"{len(parts)} drafted tokens, but node {self.config.node_id} verifies {why}")
        drafts = tuple(int(p) for p in parts)
        if self.info.layers.is_tail and max(drafts) >= self.info.n_vocab:
            raise InvalidRequest(f"drafted token ids must lie in 0..{self.info.n_vocab - 1}")
        return drafts

    def ids_onward(self, route: _Route, tokens: np.ndarray | None) -> bytes | None:
        """The chunk's token ids for the next hop, when this model's every hop reads them or the
        session's tail counts them (``carry_ids``)."""
        if not (self.info.seam.carries_token_ids or route.carry_ids):
            return None
        assert tokens is not None  # _handle required them
        return token_ids_prefix(tokens)

    def carried_ids(self, route: _Route, tokens: np.ndarray | None, start: int) -> np.ndarray | None:
        """Check that a session whose ids travel got them; the ids the shard itself computes from."""
        info = self.info
        if route.carry_ids and tokens is None and not info.layers.is_head:
            raise SeamMismatch(
                "this session's token ids travel to the tail (penalties, grammar): send the chunk's ids first in "
                f"the body, with {H.TOKEN_IDS}"
            )
        if route.carry_ids and info.layers.is_tail and tokens is not None:
            del route.ids_seen[start:]
            route.ids_seen.extend(int(t) for t in tokens)
        return tokens if info.layers.is_head or info.seam.carries_token_ids else None

    def _token_ids(self, raw: str, body: bytes, n: int) -> tuple[np.ndarray, bytes]:
        if self.info.layers.is_head:
            raise SeamMismatch(f"the head takes its token ids as the body: drop {H.TOKEN_IDS}")
        ids, rest = split_token_ids(body, raw, n)
        # checked where they are used: a shard that reads them, or the tail (a middle shard may hold no vocabulary)
        used = self.info.seam.carries_token_ids or self.info.layers.is_tail
        if used and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.info.n_vocab):
            raise SeamMismatch(f"token ids must lie in 0..{self.info.n_vocab - 1}")
        return ids, rest

    # -- compute and forward -----------------------------------------------------------------
    async def run(
        self,
        sid: SessionId,
        *,
        start: int,
        tokens: np.ndarray | None,
        hidden: np.ndarray | None,
        sizes: tuple[int, ...],
        verify: bool = False,
    ) -> tuple[np.ndarray | None, np.ndarray | None, float]:
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        if self.batcher is not None and sizes == (1,) and not verify:
            token = None if tokens is None else int(tokens[0])
            out = await self.batcher.step(DecodeStep(sid, start, token=token, hidden=hidden))
        else:
            out = await loop.run_in_executor(
                None, lambda: self._compute(sid, start=start, tokens=tokens, hidden=hidden, sizes=sizes, verify=verify)
            )
        return out.hidden, out.logits, 1000 * (time.perf_counter() - began)

    def _compute(
        self,
        sid: SessionId,
        *,
        start: int,
        tokens: np.ndarray | None,
        hidden: np.ndarray | None,
        sizes: tuple[int, ...],
        verify: bool = False,
    ) -> ShardOutput:
        """One compute call per chunk of ``sizes`` (``shard.compute_chunks``); a verify chunk (``sizes``
        all ones) computes every position to a one-position step's bits, and the tail returns the
        logits of every position (``shard.verify_chunk``)."""
        if verify:
            return verify_chunk(self.shard, sid, start, tokens=tokens, hidden=hidden)
        return compute_chunks(self.shard, sid, start, sizes, tokens=tokens, hidden=hidden)

    def record(
        self,
        route: _Route,
        sizes: tuple[int, ...],
        tokens: np.ndarray | None,
        hidden: np.ndarray | None,
        frame: TensorFrame | None,
    ) -> None:
        """Add the computed chunks to the session's ledger: what each was computed from and what went onward."""
        # past the head the ledger covers the activations, whatever token ids came beside them
        inputs = np.ascontiguousarray(hidden) if hidden is not None else np.ascontiguousarray(tokens, dtype="<i4")
        sent = None if frame is None else frame_values(frame).reshape(inputs.shape[0], -1)
        at = 0
        for size in sizes:
            out = b"" if sent is None else sent[at : at + size].tobytes()
            route.ledger.record(size, inputs[at : at + size].tobytes(), out)
            at += size

    def describe(self, route: _Route, compute_ms: float = 0.0, positions: int | None = None) -> dict[str, Any]:
        """This hop's entry in an answer's ``hops``: who computed what, and its ledger (protocol.ledger)."""
        entry: dict[str, Any] = {"node": self.config.node_id, "layers": str(self.info.layers)}
        if positions is not None:
            entry["positions"] = positions
        entry["compute_ms"] = round(compute_ms, 3)
        return {**entry, **route.ledger.describe()}

    async def forward(
        self,
        sid: SessionId,
        route: _Route,
        path: str,
        frame: TensorFrame,
        headers: dict[str, str],
        *,
        ids: bytes | None = None,
    ) -> dict[str, Any]:
        """POST ``frame`` (after the chunk's token ids, ``ids``, for a model whose every hop reads
        them) to the next hop; a failure names the innermost hop that failed (``HopFailed``)."""
        assert self.client is not None
        nxt = route.next_hops[0]
        url = f"{nxt}/v1/sessions/{sid}/{path}"
        send, body = self.onward(route, frame, headers, ids)
        send["Content-Type"] = "application/octet-stream"
        timeout = httpx.Timeout(hop_timeout_s(self.config.hop_timeout_s, len(route.next_hops)), connect=5.0)
        try:
            response = await self.client.post(url, content=body, headers=send, timeout=timeout)
        except httpx.HTTPError as exc:
            raise HopFailed(f"next hop {nxt} failed: {type(exc).__name__}: {exc}", failed_hop=nxt) from None
        if response.status_code >= 400:
            message = f"next hop {nxt} answered {response.status_code}: {error_message(response)}"
            deeper = error_field(response, "failed_hop")
            raise hop_error(message, status=response.status_code, failed_hop=deeper, sender=nxt, sender_is_head=False)
        try:
            return dict(response.json())
        except ValueError:
            raise HopFailed(f"next hop {nxt} sent an answer that is not JSON", failed_hop=nxt) from None

    def onward(
        self, route: _Route, frame: TensorFrame, headers: dict[str, str], ids: bytes | None
    ) -> tuple[dict[str, str], bytes]:
        """The headers and body that carry ``frame`` (after the chunk's token ids, ``ids``) to the next hop."""
        send = {
            **headers,
            H.MODEL: self.info.model_id,
            H.ROUTE_ID: route.route_id,
            H.SHAPE: format_shape(frame.shape),
            H.DTYPE: frame.dtype,
        }
        body = frame.body
        if ids is not None:
            send[H.TOKEN_IDS] = str(len(ids) // 4)
            body = ids + body
        self.metrics.seam_bytes.inc(len(body))
        return send, body

    async def send_step(
        self,
        sid: SessionId,
        route: _Route,
        verb: str,
        frame: TensorFrame,
        headers: dict[str, str],
        *,
        ids: bytes | None,
        direct: Direct,
    ) -> None:
        """Pass a decode-channel step on to the next hop over its channel, without waiting for anything."""
        send, body = self.onward(route, frame, headers, ids)
        header = {
            "session": sid,
            "seq": direct.seq,
            "verb": verb,
            "headers": send,
            "returns": list(direct.returns),
            "hops": list(direct.hops),
        }
        timeout = hop_timeout_s(self.config.hop_timeout_s, len(route.next_hops))
        await self.dialer.send(route.next_hops[0], encode_frame(Kind.STEP, header, body), timeout)

    def session_state(self, sid: SessionId) -> dict[str, Any]:
        """``GET /v1/sessions/{id}``: what this node holds of a session (a gateway asks it to find
        where a decode-channel step stopped)."""
        route = self.routes.get(sid)
        if route is None:
            self.shard.store.get(sid)  # 404/410 with the reason
            raise SessionNotFound(f"no session {sid} on this node")
        return {
            "session": sid,
            "node": self.config.node_id,
            "position": self.shard.store.get(sid).position,
            "seq": route.seq,
            "broken": route.broken,
            **route.ledger.describe(),
        }

    # -- the seam log (route repair) -------------------------------------------------------------
    def log_frame(self, route: _Route, start: int, frame: TensorFrame, ids: bytes | None = None) -> None:
        """Append the activations of positions ``start..`` (and their token ids, for a model whose
        every hop reads them) to the session's seam log, within budget."""
        log = route.log
        if log is None:
            return
        row = len(frame.body) // frame.shape[1]
        gapless = len(log) == start * row and (ids is None or len(route.ids_log) == start * 4)
        if (route.log_dtype and route.log_dtype != frame.dtype) or not gapless:
            self.drop_log(route)  # not a gapless record of this session any more: useless for a replay
            return
        size = len(frame.body) + len(ids or b"")
        if self.log_bytes + size > self.config.seam_log_bytes:
            self.drop_log(route)
            return
        route.log_dtype = frame.dtype
        log += frame.body
        if ids is not None:
            route.ids_log += ids
        self.log_bytes += size

    def drop_log(self, route: _Route) -> None:
        if route.log is not None:
            self.log_bytes -= len(route.log) + len(route.ids_log)
            route.log = None
            route.ids_log = bytearray()

    def forget(self, sid: SessionId) -> _Route | None:
        route = self.routes.pop(sid, None)
        if route is not None:
            self.drop_log(route)
        return route

    async def rewind(self, sid: SessionId, route: _Route, position: int) -> None:
        """A repair resends a step this node may already hold: drop it (KV and log) first."""
        before = self.shard.store.get(sid).position
        if before <= position:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: self.shard.rewind(sid, position))
        route.ledger.rewind(position)
        if route.log:
            keep = position * (len(route.log) // before)
            self.log_bytes -= len(route.log) - keep
            del route.log[keep:]
        if route.ids_log:
            self.log_bytes -= len(route.ids_log) - 4 * position
            del route.ids_log[4 * position :]
        del route.ids_seen[position:]

    async def reroute(
        self,
        sid: SessionId,
        route: _Route,
        hops: tuple[str, ...],
        *,
        replay: int,
        sampling: str | None,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Point the session at new next hops; with ``replay`` > 0, rebuild their KV from the seam log.

        Every position but the newest is replayed in exactly the chunks it was first computed in
        (``X-Meshnet-Chunks``: a position's KV depends on its chunk, protocol.ledger), packed into
        prefill requests that the first ``replay`` hops compute without answering a token; the
        newest position — the interrupted decode step — is then resent through the whole chain
        (``X-Meshnet-Rewind`` lets a hop that already has it drop it first), and its answer — the
        next token — is returned, with this hop's own ledger entry first.

        ``step``: the interrupted step's position. A hop that holds more (the drafts of an
        interrupted verify chunk) drops them first: the step is resent without drafts.
        """
        if route.forward is not None:
            with contextlib.suppress(Exception):
                await route.forward  # the failed forward: its outcome is why we are here
        route.next_hops, route.broken, route.broken_hop, route.forward = hops, None, None, None
        if step is not None and self.shard.store.get(sid).position > step + 1:
            await self.rewind(sid, route, step + 1)
        position = self.shard.store.get(sid).position
        me = self.describe(route)
        if replay == 0:
            return {"rerouted": sid, "position": position, "next_hops": list(hops), "hops": [me]}
        sizes = route.ledger.sizes()
        if route.log is None or not route.log_dtype or route.ledger.position != position or sizes[-1:] != [1]:
            raise Conflict(
                f"session {sid} cannot be replayed from this node (no complete seam log, or its newest "
                "position is not a decode step); it needs a fresh prefill",
                code="no_seam_log",
            )
        row = len(route.log) // position
        seam = self.info.seam.shape
        with_ids = self.info.seam.carries_token_ids or route.carry_ids
        if with_ids and len(route.ids_log) != 4 * position:
            raise Conflict(f"session {sid} has no complete token-id log on this node; it needs a fresh prefill",
                           code="no_seam_log")  # fmt: skip

        def ids(a: int, b: int) -> bytes | None:
            return bytes(route.ids_log[4 * a : 4 * b]) if with_ids else None

        first = {H.NEXT_HOPS: ",".join(hops[1:]), **({H.SAMPLING: sampling} if sampling else {})}
        try:
            for begin, chunks in pack_chunks(sizes[:-1], self.config.replay_chunk):
                end = begin + sum(chunks)
                frame = TensorFrame((1, end - begin, *seam), route.log_dtype, bytes(route.log[begin * row : end * row]))
                headers = {H.TOKEN_RANGE: f"{begin}-{end - 1}", H.REPLAY: str(replay), **(first if begin == 0 else {})}
                if len(chunks) > 1:
                    headers[H.CHUNKS] = format_chunks(chunks)
                await self.forward(sid, route, "prefill", frame, headers, ids=ids(begin, end))
            last = TensorFrame((1, 1, *seam), route.log_dtype, bytes(route.log[(position - 1) * row :]))
            headers = {H.POSITION: str(position - 1), H.REWIND: "1", **(first if position == 1 else {})}
            answer = await self.forward(sid, route, "decode-step", last, headers, ids=ids(position - 1, position))
        except MeshnetError as exc:
            self.break_session(route, exc)
            raise
        answer["hops"] = [me, *answer.get("hops", [])]
        return answer

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
        self.drop_log(route)
        if route.next_hops and self.client is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.delete(f"{route.next_hops[0]}/v1/sessions/{sid}")

    def break_session(self, route: _Route, error: MeshnetError) -> None:
        if not route.broken:
            route.broken, route.broken_hop = error.message, error.failed_hop


def create_node_app(shard: ShardBackend, config: NodeConfig) -> Starlette:
    node = _Node(shard, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        node.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.hop_timeout_s, connect=5.0),
            limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=300),
            verify=config.client_tls or True,
        )
        tasks = [asyncio.create_task(_sweep(node))]
        bench = SelfBenchmark(shard)
        benching: set[asyncio.Task[None]] = set()
        if config.tracker_url:
            # The first registration does not wait for the self-benchmark (it says "speed unknown");
            # the heartbeat re-registers as soon as the benchmark is done.
            benching.add(asyncio.create_task(benchmark_in_background(bench, node.traffic)))
            tasks.append(asyncio.create_task(_heartbeat(node, config.tracker_url)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            bench.stop()
            if benching:
                await asyncio.wait(benching, timeout=10.0)  # it stops between steps; never close the shard under it
            await node.dialer.close()
            await node.client.aclose()
            shard.close()

    async def prefill(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        headers = request.headers
        node.check_model(headers)
        node.check_length(request)
        start, stop = parse_range(headers.get(H.TOKEN_RANGE))
        tokens, hidden = node.inputs(headers, await node.body(request), stop - start)
        sizes = parse_chunks(headers.get(H.CHUNKS), stop - start)
        final = headers.get(H.SAMPLE) == "1"
        answer, status = await _handle(
            node, sid, headers, start=start, tokens=tokens, hidden=hidden, final=final, sizes=sizes
        )
        return JSONResponse(answer, status_code=status)

    async def decode_step(request: Request) -> Response:
        return await _http_step(node, request, verify=False)

    async def verify(request: Request) -> Response:
        return await _http_step(node, request, verify=True)

    async def reroute(request: Request) -> Response:
        return await _reroute(node, request)

    async def session(request: Request) -> Response:
        return JSONResponse(node.session_state(SessionId(request.path_params["session_id"])))

    async def on_step(
        sid: SessionId, headers: Headers, body: bytes, verify: bool, direct: Direct
    ) -> dict[str, Any] | None:
        node.metrics.channel_steps.inc()
        return (await step(node, sid, headers, body, verify=verify, direct=direct))[0]

    async def decode_channel(websocket: WebSocket) -> None:
        await channel.serve(
            websocket, node_id=config.node_id, peers=node.peers, max_body_bytes=config.max_body_bytes, on_step=on_step
        )

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
                "max_verify": info.max_verify,
                "verify_batched": info.verify_batched,
                "verify_batched_below": info.verify_batched_below,
                "decode_batch": info.decode_batch,
                "decode_batch_below": info.decode_batch_below,
                "started": node.started,
            }
        )

    async def metrics(_: Request) -> Response:
        node.metrics.sessions.set(len(shard.store))
        node.metrics.kv_bytes.set(shard.store.bytes_used())
        node.metrics.channels.set(len(node.peers))
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/sessions/{session_id}/prefill", prefill, methods=["POST"]),
        Route("/v1/sessions/{session_id}/decode-step", decode_step, methods=["POST"]),
        Route("/v1/sessions/{session_id}/verify", verify, methods=["POST"]),
        Route("/v1/sessions/{session_id}/reroute", reroute, methods=["POST"]),
        Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}", session, methods=["GET"]),
        WebSocketRoute(CHANNEL_PATH, decode_channel),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )


async def _http_step(node: _Node, request: Request, *, verify: bool) -> Response:
    """``POST .../decode-step`` and ``.../verify``: the answer travels back up the chain."""
    sid = SessionId(request.path_params["session_id"])
    node.check_length(request)
    answer, status = await step(node, sid, request.headers, await node.body(request), verify=verify)
    assert answer is not None
    return JSONResponse(answer, status_code=status)


async def step(
    node: _Node, sid: SessionId, headers: Headers, body: bytes, *, verify: bool, direct: Direct | None = None
) -> tuple[dict[str, Any] | None, int]:
    """``decode-step``: one position; ``verify``: the step's position and its drafts (``X-Meshnet-Draft``).
    ``direct``: the step came over the decode channel (``node.channel``)."""
    node.check_model(headers)
    position = _position(headers)
    drafts = node.drafts(headers) if verify else None
    n = 1 + len(drafts or ())
    tokens, hidden = node.inputs(headers, body, n)
    return await _handle(
        node, sid, headers, start=position, tokens=tokens, hidden=hidden, final=True, sizes=(1,) * n, decode=True,
        drafts=drafts, direct=direct,
    )  # fmt: skip


async def _handle(
    node: _Node,
    sid: SessionId,
    headers: Headers,
    *,
    start: int,
    tokens: np.ndarray | None,
    hidden: np.ndarray | None,
    final: bool,
    sizes: tuple[int, ...],
    decode: bool = False,
    drafts: tuple[int, ...] | None = None,
    direct: Direct | None = None,
) -> tuple[dict[str, Any] | None, int]:
    """Compute a request's positions and pass them on; the answer and its HTTP status. A ``direct``
    step goes on over the decode channel and answers nothing here (``None``) but on the tail, whose
    answer goes straight to the gateway with every hop's entry."""
    route = node.session_route(sid, headers, start=start)
    replay = _replay_hops(headers, verify=drafts is not None)
    if direct is not None and replay:
        raise InvalidRequest(f"a decode-channel step is never replayed: drop {H.REPLAY}")
    rewind = headers.get(H.REWIND) == "1"
    if route.busy:
        raise SessionBusy(f"session {sid} already has a request in flight on this node; send one at a time")
    route.busy = True
    try:
        if rewind:
            await node.rewind(sid, route, start)
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        own = node.carried_ids(route, tokens, start)
        with node.traffic.measure(n, decode=decode):
            out_hidden, logits, compute_ms = await node.run(
                sid, start=start, tokens=own, hidden=hidden, sizes=sizes, verify=drafts is not None
            )
        node.metrics.positions.inc(n)
        frame = None
        if out_hidden is not None:
            frame = encode_tensor(out_hidden.reshape(1, *out_hidden.shape), node.config.wire_dtype)
        node.record(route, sizes, tokens, hidden, frame)
        if direct is not None:
            route.seq = direct.seq
        me = node.describe(route, compute_ms, positions=n)
        if node.info.layers.is_tail:
            if replay:
                return {"replayed": n, "hops": [me]}, 200
            if not final:
                return {"accepted": n, "hops": [me]}, 202
            assert logits is not None
            answer = await _sampled(
                node, sid, route, start=start, n=n, logits=logits, drafts=drafts, me=me, direct=direct is not None
            )
            if direct is not None:
                answer["hops"] = [*direct.hops, *answer["hops"]]
            return answer, 200
        assert frame is not None
        passing = _Passing(start=start, n=n, final=final, decode=decode, drafts=drafts, replay=replay, rewind=rewind)
        return await _pass_on(
            node, sid, route=route, headers=headers, frame=frame, tokens=tokens, p=passing, me=me, direct=direct
        )
    finally:
        route.busy = False


@dataclass(frozen=True, slots=True)
class _Passing:
    """What a non-tail hop passes on of a request it computed."""

    start: int
    n: int
    final: bool
    decode: bool
    drafts: tuple[int, ...] | None
    replay: int
    rewind: bool


async def _pass_on(
    node: _Node,
    sid: SessionId,
    *,
    route: _Route,
    headers: Headers,
    frame: TensorFrame,
    tokens: np.ndarray | None,
    p: _Passing,
    me: dict[str, Any],
    direct: Direct | None,
) -> tuple[dict[str, Any] | None, int]:
    """Log and forward what this hop computed; the answer (``None`` for a ``direct`` step) and its status."""
    ids = node.ids_onward(route, tokens)
    node.log_frame(route, p.start, frame, ids)
    if p.replay == 1:
        return {"replayed": p.n, "hops": [me]}, 200  # the hops after this one already hold it
    path = ("verify" if p.drafts is not None else "decode-step") if p.decode else "prefill"
    if p.decode:
        onward = {H.POSITION: str(p.start)}
    else:
        onward = _prefill_headers(headers, route, p.start, p.start + p.n, p.final)
    onward.update(_onward(drafts=p.drafts, replay=p.replay, rewind=p.rewind))
    previous = route.forward
    if direct is not None:  # fire and forget: the tail answers the gateway, a failure is reported there
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous  # its outcome is the session's break reason, checked below
        if route.broken:
            raise SessionBroken(f"session {sid} is broken on this node: {route.broken}",
                                failed_hop=route.broken_hop)  # fmt: skip
        try:
            await node.send_step(sid, route, path, frame, onward, ids=ids, direct=direct.onward(me))
        except MeshnetError as exc:
            node.break_session(route, exc)
            raise
        return None, 202

    async def send() -> dict[str, Any]:
        if previous is not None:
            await previous  # forwards leave in position order
        try:
            return await node.forward(sid, route, path, frame, onward, ids=ids)
        except MeshnetError as exc:
            node.break_session(route, exc)
            raise

    task: asyncio.Task[Any] = asyncio.ensure_future(send())
    route.forward = task
    if not p.final and not p.replay:
        task.add_done_callback(_consume)
        return {"accepted": p.n, "hops": [me]}, 202
    answer = await task
    if p.drafts is not None:  # the rejected drafts go here too, as the answer passes back up
        await _drop_rejected(node, sid, route, answer, start=p.start, n=p.n)
        me = {**me, **route.ledger.describe()}
    answer["hops"] = [me, *answer.get("hops", [])]
    return answer, 200


async def _sampled(
    node: _Node,
    sid: SessionId,
    route: _Route,
    *,
    start: int,
    n: int,
    logits: np.ndarray,
    drafts: tuple[int, ...] | None,
    me: dict[str, Any],
    direct: bool = False,
) -> dict[str, Any]:
    """The tail's answer: the token after the chunk; for a verify chunk, the drafts it keeps and one
    token of its own (``Sampler.verify``), with the rejected drafts' positions dropped first. Its
    ledger entry (``me``) says what it held before: after a ``direct`` verify chunk, the hops before
    it drop the rejected drafts only when the next step tells them (``X-Meshnet-Rewind``), so every
    entry of the answer describes the whole chunk."""
    assert route.sampler is not None
    sampler = route.sampler
    if route.carry_ids:  # the generated tokens before the first one this answer picks
        before = start + n - len(drafts or ())
        sampler.set_history(route.ids_seen[sampler.params.generated_from : before])
    if drafts is None:
        token, logprob = sampler.sample(logits, position=start + n)
        top = {"top": sampler.alternatives(logits)} if sampler.params.top_logprobs else {}
        return {"token": token, "logprob": logprob, **top, "position": start + n, "hops": [me]}
    tokens, logprobs = sampler.verify(logits, drafts, position=start + 1)
    kept = start + len(tokens)
    await node.rewind(sid, route, kept)
    if not direct:
        me = {**me, **route.ledger.describe()}
    tops = {"tops": [sampler.alternatives(row) for row in logits[: len(tokens)]]} if sampler.params.top_logprobs else {}
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        **tops,
        "position": kept,
        "drafted": len(drafts),
        "accepted": len(tokens) - 1,
        "hops": [me],
    }


async def _drop_rejected(
    node: _Node, sid: SessionId, route: _Route, answer: dict[str, Any], *, start: int, n: int
) -> None:
    """Keep what the verify ``answer`` kept (up to its ``position``) of the chunk of ``n`` at ``start``."""
    kept, hop = answer.get("position"), route.next_hops[0]
    if not isinstance(kept, int) or not start < kept <= start + n:
        error = HopFailed(f"next hop {hop} answered a verify chunk at {start} with position {kept!r}", failed_hop=hop)
        node.break_session(route, error)
        raise error
    await node.rewind(sid, route, kept)


def _onward(*, drafts: tuple[int, ...] | None, replay: int, rewind: bool) -> dict[str, str]:
    """The headers a request passes on beside its position or token range."""
    headers = {}
    if drafts is not None:
        headers[H.DRAFT] = ",".join(map(str, drafts))
    if replay:
        headers[H.REPLAY] = str(replay - 1)
    if rewind:
        headers[H.REWIND] = "1"
    return headers


async def _reroute(node: _Node, request: Request) -> Response:
    """``POST /v1/sessions/{id}/reroute``: new next hops for a session, optionally rebuilt (route repair)."""
    sid = SessionId(request.path_params["session_id"])
    node.check_model(request.headers)
    route = node.routes.get(sid)
    if route is None:
        node.shard.store.get(sid)  # 404/410 with the reason
        raise SessionNotFound(f"no session {sid} on this node")
    route_id = request.headers.get(H.ROUTE_ID)
    if route_id != route.route_id:
        raise Conflict(f"session {sid} is pinned to route {route.route_id}, not {route_id}")
    hops = node.next_hops(request.headers)
    raw = request.headers.get(H.REPLAY, "0")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > len(hops):
        raise InvalidRequest(f"header {H.REPLAY} must be 0..{len(hops)} (hops to rebuild), got {raw!r}")
    if route.busy:
        raise SessionBusy(f"session {sid} has a request in flight on this node; reroute it after that")
    route.busy = True
    try:
        step = _position(request.headers) if request.headers.get(H.POSITION) is not None else None
        sampling = request.headers.get(H.SAMPLING)
        answer = await node.reroute(sid, route, hops, replay=int(raw), sampling=sampling, step=step)
    finally:
        route.busy = False
    return JSONResponse(answer)


def _position(headers: Headers) -> int:
    raw = headers.get(H.POSITION)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        raise SeamMismatch(f"header {H.POSITION} must be the step's absolute position, got {raw!r}")
    return int(raw)


def _replay_hops(headers: Headers, *, verify: bool = False) -> int:
    raw = headers.get(H.REPLAY)
    if raw is None:
        return 0
    if verify:
        raise InvalidRequest(f"a verify chunk is never replayed: drop {H.REPLAY}")
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise InvalidRequest(f"header {H.REPLAY} must be the number of hops to rebuild (>= 1), got {raw!r}")
    if headers.get(H.SAMPLE) == "1":
        raise InvalidRequest(f"a replayed chunk answers no token: drop {H.SAMPLE}")
    return int(raw)


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the failure is recorded as the session's break reason


def _prefill_headers(headers: Headers, route: _Route, start: int, stop: int, final: bool) -> dict[str, str]:
    onward = {H.TOKEN_RANGE: f"{start}-{stop - 1}", H.NEXT_HOPS: ",".join(route.next_hops[1:])}
    for name in (H.SAMPLING, H.CHUNKS):
        value = headers.get(name)
        if value:
            onward[name] = value
    if final:
        onward[H.SAMPLE] = "1"
    return onward


async def _heartbeat(node: _Node, tracker_url: str) -> None:
    """Register, then re-register every ``heartbeat_s``: a restarted tracker relearns us by itself.

    Each registration carries the advertisement (``node.advert``); the tracker answers with the
    candidate next hops, which are probed in the background and reported on the next heartbeat.
    """
    assert node.client is not None
    info = node.info
    log = logging.getLogger("meshnet.node")
    extra = dict(node.config.advert)
    threads = extra.pop("threads", None)
    prober = LatencyProber()
    probing: asyncio.Task[None] | None = None
    reported = False
    try:
        while True:
            node.traffic.news.clear()
            body = {
                "node_id": node.config.node_id,
                "url": node.config.url,
                "model": info.model_id,
                "layers": str(info.layers),
                "total_layers": info.layers.total,
                "backend": info.backend,
                "kv_bytes_free": node.shard.store.free_bytes(),
                "heartbeat_s": node.config.heartbeat_s,
                "wire_dtype": node.config.wire_dtype,
                "hardware": host_hardware(threads),
                **advert_fields(node.shard, node.traffic, prober),
                **extra,
            }
            try:
                response = await node.client.post(f"{tracker_url}/v1/nodes", json=body, timeout=5.0)
                if response.status_code >= 400:
                    log.warning("tracker refused registration: %s", error_message(response))
                elif probing is None or probing.done():
                    hops = response.json().get("next_hops") or []
                    probing = asyncio.create_task(prober.probe(node.client, [str(h) for h in hops]))
                    probing.add_done_callback(_consume)
                reported = False
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                if not reported:  # say it once per outage, not every heartbeat
                    log.warning("tracker %s unreachable (%s); retrying", tracker_url, exc)
                    reported = True
            with contextlib.suppress(TimeoutError):  # the self-benchmark finishing wakes us early
                await asyncio.wait_for(node.traffic.news.wait(), node.config.heartbeat_s)
    finally:
        if probing is not None:
            probing.cancel()


async def _sweep(node: _Node) -> None:
    """Expire idle sessions (frees their KV) and forget their route bindings."""
    while True:
        await asyncio.sleep(node.config.sweep_interval_s)
        node.shard.store.expire_idle()
        alive = set(node.shard.store.ids())
        for sid in [s for s in node.routes if s not in alive]:
            node.forget(sid)
