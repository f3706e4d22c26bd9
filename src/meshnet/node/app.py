"""A shard node's HTTP surface: the binary hop protocol, the decode channel, health, metrics.

The node's logic lives in ``node.service.NodeService``; this module binds it to HTTP
(``protocol.http_binding``: headers and raw tensor bodies to typed records and back) and to the
decode channel (``node.channel``: the same headers and bodies inside WebSocket frames), and runs
the node's background work: the tracker heartbeat with the node's advertisement, the idle-session
sweep and the self-benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from meshnet.backends.shard import ShardBackend
from meshnet.cores import CoreLease
from meshnet.errors import Unauthorized
from meshnet.httputil import (
    CLIENT_KEEP_ALIVE_S,
    EXCEPTION_HANDLERS,
    check_declared_length,
    read_body,
)
from meshnet.ids import SessionId
from meshnet.node import channel
from meshnet.node.advert import SelfBenchmark, benchmark_in_background
from meshnet.node.heartbeat import heartbeat
from meshnet.node.placement import AutoPlacement
from meshnet.node.service import ChannelSend, NodeConfig, NodeService
from meshnet.protocol import headers as H
from meshnet.protocol import http_binding
from meshnet.protocol.channel import CHANNEL_PATH, Credit, Direct, step_frame
from meshnet.protocol.hops import HttpTransport
from meshnet.protocol.ledger import format_chunks
from meshnet.protocol.messages import HopEntry, HopRequest, Verb
from meshnet.protocol.wire import format_shape
from meshnet.security.membership import scope_member
from meshnet.security.revocation import RefuseRevoked, RevokedSerials

__all__ = ["NodeConfig", "create_node_app"]

log = logging.getLogger("meshnet.node")

# How long a stopping node waits for the grammar steps it told to stop (they stop within one chunk
# of a vocabulary check) before it leaves its model loaded rather than free it under them.
_GRAMMAR_STOP_S = 10.0


def create_node_app(shard: ShardBackend, config: NodeConfig, *, placement: AutoPlacement | None = None) -> Any:
    """The node's ASGI app; in a private swarm (``client_tls``) behind ``RefuseRevoked``, fed the
    revoked serials by the tracker's answer to each heartbeat. ``placement``: a ``--layers auto``
    node's (node.placement): its heartbeats carry its ask, and a move the tracker answers drains it."""
    revoked = RevokedSerials()
    app = _node_app(shard, config, revoked, placement)
    return app if config.client_tls is None else RefuseRevoked(app, revoked)


def _node_app(
    shard: ShardBackend, config: NodeConfig, revoked: RevokedSerials, placement: AutoPlacement | None = None
) -> Starlette:
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.hop_timeout_s, connect=5.0),
        limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=CLIENT_KEEP_ALIVE_S),
        verify=config.client_tls or True,
    )
    dialer = channel.Dialer(config.max_body_bytes, tls=config.client_tls)  # decode channels to next hops
    peers: dict[str, channel.Peer] = {}  # accepted decode channels by return id

    node = NodeService(shard, config, HttpTransport(client), channel_send=_channel_sender(dialer))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # this loop's worker threads, counted: a short decode step runs on the loop while none is busy (node.offload)
        node.calls.install(asyncio.get_running_loop(), shares_cores=shard.shares_cores)
        tasks = [asyncio.create_task(_sweep(node))]
        bench = SelfBenchmark(shard)
        benching: set[asyncio.Task[None]] = set()
        if config.tracker_url:
            # The first registration does not wait for the self-benchmark (it says "speed unknown");
            # the heartbeat re-registers as soon as the benchmark is done.
            benching.add(asyncio.create_task(benchmark_in_background(bench, node.traffic)))
            tasks.append(asyncio.create_task(heartbeat(node, client, config.tracker_url, revoked, placement)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            bench.stop()
            if benching:
                await asyncio.wait(benching, timeout=10.0)  # it stops between steps; never close the shard under it
            await dialer.close()
            await client.aclose()
            await _release(node, shard)

    def hop_endpoint(verb: Verb) -> Any:
        async def endpoint(request: Request) -> Response:
            check_declared_length(request, config.max_body_bytes, "this node")
            # refused past the limit as it streams in too (a chunked upload declares no length)
            body = await read_body(request, config.max_body_bytes, "this node")
            sid = SessionId(request.path_params["session_id"])
            hop = http_binding.decode_request(verb, sid, request.headers, body, max_body_bytes=config.max_body_bytes)
            answer = await node.handle(hop, client=_quota_client(request.scope), caller=_caller(request.scope, config))
            assert answer is not None
            return JSONResponse(answer.to_json(), status_code=answer.status)

        return endpoint

    async def reroute(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        rerouting = http_binding.decode_reroute(sid, request.headers)
        answer = await node.reroute(rerouting, caller=_caller(request.scope, config))
        return JSONResponse(answer.to_json())

    async def session(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        member = scope_member(request.scope)
        admin = member is not None and member.role == "admin"  # operators read; only drivers drive
        return JSONResponse(node.session_state(sid, _caller(request.scope, config), admin=admin))

    async def delete_session(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        await node.delete(sid, request.headers.get(H.TICKET), _caller(request.scope, config))
        return JSONResponse({"deleted": sid})

    async def health(_: Request) -> Response:
        return JSONResponse(_health(node))

    async def metrics(_: Request) -> Response:
        node.metrics.sessions.set(len(shard.store))
        node.metrics.kv_bytes.set(shard.store.bytes_used())
        node.metrics.channels.set(len(peers))
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/v1/sessions/{session_id}/prefill", hop_endpoint(Verb.PREFILL), methods=["POST"]),
        Route("/v1/sessions/{session_id}/decode-step", hop_endpoint(Verb.DECODE), methods=["POST"]),
        Route("/v1/sessions/{session_id}/verify", hop_endpoint(Verb.VERIFY), methods=["POST"]),
        Route("/v1/sessions/{session_id}/reroute", reroute, methods=["POST"]),
        Route("/v1/sessions/{session_id}/prefix", _prefix_endpoint(node), methods=["POST"]),
        *_snapshot_routes(node),
        Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}", session, methods=["GET"]),
        *_audit_routes(node),
        WebSocketRoute(CHANNEL_PATH, _channel_endpoint(node, peers)),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)


async def _release(node: NodeService, shard: ShardBackend) -> None:
    """Free the shard's model once no grammar step of the tail reads its vocabulary any more."""
    if await node.sampling.stop(timeout_s=_GRAMMAR_STOP_S):
        shard.close()
    else:  # freeing the model would free the vocabulary under it: the process's end frees both
        log.warning("a grammar step still runs %.0f s after it was told to stop: the model stays loaded until "
                    "the process ends", _GRAMMAR_STOP_S)  # fmt: skip


def _channel_sender(dialer: channel.Dialer) -> ChannelSend:
    async def send(hop: str, request: HopRequest, direct: Direct, timeout_s: float) -> None:
        """Pass a decode-channel step on to the next hop over its channel, without waiting for anything."""
        await dialer.send(hop, step_frame(request, direct.seq, direct.returns), timeout_s)

    return send


def _channel_endpoint(node: NodeService, peers: dict[str, channel.Peer]) -> Any:
    """The decode channel: every ``STEP`` on it is driven by the member that opened the channel."""
    config = node.config

    async def decode_channel(websocket: WebSocket) -> None:
        caller = _caller(websocket.scope, config)

        async def on_step(hop: HopRequest, direct: Direct) -> tuple[dict[str, Any], int | None] | HopEntry:
            node.metrics.channel_steps.inc()
            answer = await node.handle(hop, direct, caller=caller)
            if not node.info.layers.is_tail:  # the step went on: this hop's entry goes to the gateway
                return answer.hops[0]
            return answer.to_json(), await node.relay(hop.session, direct, answer)  # the relayed step leaves first

        def on_credit(credit: Credit) -> None:
            node.take_credit(credit, caller)

        await channel.serve(
            websocket, node_id=config.node_id, peers=peers, max_body_bytes=config.max_body_bytes, on_step=on_step,
            on_credit=on_credit,
        )  # fmt: skip

    return decode_channel


def _prefix_endpoint(node: NodeService) -> Any:
    async def prefix(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        answer = await node.prefix(
            http_binding.decode_prefix(sid, request.headers),
            client=_quota_client(request.scope),
            caller=_caller(request.scope, node.config),
        )
        return JSONResponse(answer.to_json())

    return prefix


def _snapshot_routes(node: NodeService) -> list[Route]:
    """KV snapshots (node.snapshots): take one and push it to a standby, keep one, restore one."""

    async def snapshot(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        caller = _caller(request.scope, node.config)
        return JSONResponse(await node.snapshot(sid, request.headers.get(H.TICKET), caller), status_code=202)

    async def receive(request: Request) -> Response:
        check_declared_length(request, node.config.max_body_bytes, "this node")
        body = await read_body(request, node.config.max_body_bytes, "this node")
        sid = SessionId(request.path_params["session_id"])
        return JSONResponse(await node.receive_snapshot(sid, request.headers.get(H.TICKET), body))

    async def restore(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        restoring = http_binding.decode_restore(sid, request.headers)
        answer = await node.restore(
            restoring, client=_quota_client(request.scope), caller=_caller(request.scope, node.config)
        )
        return JSONResponse(answer.to_json())

    async def drop(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        await node.drop_snapshot(sid, request.headers.get(H.TICKET))
        return JSONResponse({"dropped": sid})

    return [
        Route("/v1/sessions/{session_id}/snapshot", snapshot, methods=["POST"]),
        Route("/v1/snapshots/{session_id}", drop, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}/restore", restore, methods=["POST"]),
        Route("/v1/snapshots/{session_id}", receive, methods=["POST"]),
    ]


def _audit_routes(node: NodeService) -> list[Route]:
    """Audit sampling (node.audit): a session's seam log for its gateway; an auditor's re-execution."""
    config = node.config

    async def seam_log(request: Request) -> Response:
        sid = SessionId(request.path_params["session_id"])
        frame, chunks = node.seam_log(sid, _caller(request.scope, config))
        headers = {H.SHAPE: format_shape(frame.shape), H.DTYPE: frame.dtype, H.CHUNKS: format_chunks(chunks)}
        return Response(frame.body, media_type="application/octet-stream", headers=headers)

    async def audit(request: Request) -> Response:
        _caller(request.scope, config)  # a private swarm's auditor serves members only
        check_declared_length(request, config.max_body_bytes, "this node")
        statement = await node.audit(await read_body(request, config.max_body_bytes, "this node"))
        return JSONResponse(statement.to_json())

    return [
        Route("/v1/sessions/{session_id}/seam", seam_log, methods=["GET"]),
        Route("/v1/audit", audit, methods=["POST"]),
    ]


def _health(node: NodeService) -> dict[str, Any]:
    store, info, config = node.shard.store, node.info, node.config
    return {
        "status": "ok",
        "node_id": config.node_id,
        "url": config.url,
        "hop_key": config.hop_key.public,  # the key its answer entries are signed with (protocol.signing)
        "auditor": config.auditor,
        "model": info.model_id,
        "architecture": info.architecture,
        "backend": info.backend,
        "layers": str(info.layers),
        "total_layers": info.layers.total,
        "sessions": len(store),
        "kv_bytes_used": store.bytes_used(),
        "kv_bytes_free": store.free_bytes(),
        "kv_bytes_parked": store.parked_bytes(),  # cached prefixes and snapshots in it, yielding to sessions
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
        "core_lease": _lease_path(node.shard),
        "prefix_cache": None if node.prefix_cache is None else node.prefix_cache.describe(),
        "started": node.started,
    }


def _lease_path(shard: ShardBackend) -> str | None:
    """The core lease this node shares the machine's cores by (meshnet.cores), if any."""
    lease = getattr(shard, "core_lease", None)
    return str(lease.path) if isinstance(lease, CoreLease) else None


async def _sweep(node: NodeService) -> None:
    """Expire idle sessions (frees their KV) and forget what the node kept beside them."""
    while True:
        await asyncio.sleep(node.config.sweep_interval_s)
        # off the event loop: freeing a session's KV waits for the compute lock
        await asyncio.get_running_loop().run_in_executor(None, node.sweep)


def _caller(scope: Any, config: NodeConfig) -> str | None:
    """The member id a request (or a decode channel) came from, by its TLS certificate: in a
    private swarm it must be one of the session's drivers (node.authority). A private swarm's node
    serves members only (``RequireMember``); one reached without a certificate refuses, rather
    than treat the caller as an in-process one."""
    member = scope_member(scope)
    if member is None and config.tickets is not None:
        raise Unauthorized(
            "this node of a private swarm serves its members only: connect with your swarm certificate",
            code="certificate_required",
        )
    return None if member is None else member.member_id


def _quota_client(scope: Any) -> str | None:
    """Whose quota a session opened by this request counts to: the calling member (from its TLS
    certificate), except a node: a node forwards a route a gateway asked the tracker for (its
    ticket says so), so it is no client of its own. ``None`` in an open swarm (no certificates)."""
    member = scope_member(scope)
    return None if member is None or member.role == "node" else member.member_id
