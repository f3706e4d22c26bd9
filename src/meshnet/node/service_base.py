"""The core of a node's logic (``NodeService``, ``node.service``): its state, and what every part
builds on — forward to the next hop, record what was computed (the ledger), rewind, and this hop's
signed entry in an answer.

The service is layered, each part on the ones below it: this core < admission (bindings, tickets,
quotas) < prefix caching < KV snapshots < route repair and session ends < the tail's answer < the
request flow (``node.service.NodeService``). No part reaches up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from meshnet.backends.shard import ShardBackend
from meshnet.errors import HopFailed, MeshnetError, SessionGone, SessionNotFound
from meshnet.ids import SessionId
from meshnet.node.advert import Traffic
from meshnet.node.audit import AuditLane
from meshnet.node.authority import ClosedSessions
from meshnet.node.batcher import DecodeBatcher
from meshnet.node.metrics import NodeMetrics
from meshnet.node.offload import ShardCalls
from meshnet.node.prefix_cache import PrefixCache
from meshnet.node.sampling_lane import DEFAULT_SAMPLE_DEADLINE_S, SamplingLane
from meshnet.node.session import NodeSession, SeamLogs
from meshnet.protocol.channel import Direct
from meshnet.protocol.closer import SessionCloser
from meshnet.protocol.hops import HopTransport
from meshnet.protocol.messages import HopAnswer, HopEntry, HopRequest, PrefixRequest, Verb
from meshnet.protocol.signing import HopKey
from meshnet.protocol.tickets import TicketVerifier
from meshnet.protocol.wire import TensorFrame, frame_values
from meshnet.routes import hop_timeout_s
from meshnet.session.store import Session

__all__ = ["ChannelSend", "NodeConfig", "Recorded", "ServiceBase"]

T = TypeVar("T")

# (next hop, request, its decode-channel routing, timeout) -> sent; raises HopFailed naming the hop
ChannelSend = Callable[[str, HopRequest, Direct, float], Awaitable[None]]


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
    # A private swarm's tracker keys: a session opens only with a route ticket naming this node, its
    # next hops are the ticket's, and a reroute needs a repair ticket (protocol.tickets).
    tickets: TicketVerifier | None = None
    # Sessions one client (a swarm member, by its certificate's id) may hold open here at once;
    # None: no per-client limit (an open swarm knows no clients).
    max_sessions_per_client: int | None = None
    # The KV of finished sessions' prompt blocks kept for later sessions to reuse (node.prefix_cache); 0: off.
    prefix_cache_bytes: int = 128 * 2**20
    # The manifest and torrent it serves from (``--manifest``): handed to a tracker that asks for it
    # (``manifest_wanted``), so gateways learn the model from the tracker (tracker.models).
    publication: tuple[bytes, bytes] | None = None
    # The longest a tail's sampling of one token may take (node.sampling_lane): past it, that generation fails.
    sample_deadline_s: float = DEFAULT_SAMPLE_DEADLINE_S
    # Signs every entry this node puts in an answer (protocol.signing); its public half is advertised.
    hop_key: HopKey = field(default_factory=HopKey.generate)
    # An auditor (``--auditor``, node.audit): re-executes audited sessions' hops, is never on a route.
    auditor: bool = False


class Recorded:
    """A computed request's record in its session's ledger and seam log, made on the first call (the
    caller makes it once the request has gone on, where that comes first, and in any case before
    the request ends); every call returns this hop's entry for it."""

    __slots__ = ("_entry", "_record")

    def __init__(self, record: Callable[[], HopEntry]) -> None:
        self._record = record
        self._entry: HopEntry | None = None

    def __call__(self) -> HopEntry:
        if self._entry is None:
            self._entry = self._record()
        return self._entry


class ServiceBase:
    """A node's state and the core every part of ``NodeService`` builds on."""

    def __init__(
        self,
        shard: ShardBackend,
        config: NodeConfig,
        transport: HopTransport,
        *,
        channel_send: ChannelSend | None = None,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.shard = shard
        self.config = config
        self.info = shard.info
        self.transport = transport
        self.channel_send = channel_send
        self.metrics = metrics or NodeMetrics()
        self.calls = ShardCalls()  # where decode steps compute: a worker thread or the loop (node.offload)
        # Decode steps of different sessions that arrive together compute as one batch, where
        # the shard measured that a batch keeps every session's bits (node.batcher).
        batches = shard.info.decode_batch > 1
        self.batcher = DecodeBatcher(shard, self.metrics.batch, self.calls) if batches else None
        self.traffic = Traffic()  # queue depth and measured speed, for the tracker (node.advert)
        self.logs = SeamLogs(config.seam_log_bytes)
        self.audits = AuditLane()  # an auditor's re-executions, one at a time
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache_bytes > 0:
            # kept blocks stay parked in the shard until a live session needs their room (node.prefix_cache)
            self.prefix_cache = PrefixCache(config.prefix_cache_bytes, release=shard.release)
            shard.store.on_evict = self.prefix_cache.evicted
        self._pushes: set[asyncio.Task[None]] = set()  # snapshots on their way to standbys
        # deletes a next hop did not acknowledge yet (still finishing a step), asked again: 50 ms
        # doubling, 10 attempts (about 26 s in all)
        self.closer = SessionCloser(first_retry_s=0.05, attempts=10, timeout_s=config.hop_timeout_s, log="meshnet.node")
        self.closed = ClosedSessions()  # a private swarm's ended sessions: no ticket re-opens them (node.authority)
        self.sampling = SamplingLane(config.sample_deadline_s)  # the tail's grammars sample off the event loop
        # One record per session: the store's, with this node's binding attached (``_bound``); a
        # session that ends in the store (closed, expired) gives back its seam log with it.
        shard.store.on_end = self._ended
        self.started = time.time()

    async def _forward(self, s: NodeSession, request: HopRequest | PrefixRequest) -> HopAnswer:
        """Send ``request`` to the session's next hop; a failure breaks the session here."""
        if isinstance(request, HopRequest):
            request = self._with_ticket(s, request)
        try:
            timeout = hop_timeout_s(self.config.hop_timeout_s, len(s.next_hops))
            return await self.transport.send(s.next_hops[0], request, timeout_s=timeout)
        except MeshnetError as exc:
            if exc.failed_hop is not None and exc.failed_hop not in s.next_hops:
                # The hops after this one can know only of their own failures: blaming this hop,
                # one before it or a node off the route (relayed up as if this hop said so) is the
                # next hop's own failure.
                lie = HopFailed(f"{exc.message} (it blamed {exc.failed_hop}, not a hop after {self.config.node_id})",
                                failed_hop=s.next_hops[0])  # fmt: skip
                s.break_with(lie)
                raise lie from None
            s.break_with(exc)
            raise

    def _handed_on(self, request: HopRequest, began: float, compute_ms: float) -> None:
        """A decode step left this hop (sent on; at the tail answered, or its next step relayed): count
        its time here, compute and the rest (checks, bookkeeping, thread hand-offs, encoding, the send)."""
        if request.verb is Verb.DECODE and not request.replay:
            self.metrics.decode_step(compute_ms / 1000, time.perf_counter() - began)

    def _with_ticket(self, s: NodeSession, request: HopRequest) -> HopRequest:
        """``request`` as it goes to the next hop: with the session's newest ticket, once per epoch."""
        if s.auth is None:
            return request
        token = s.auth.onward(request.ticket)
        return request if token == request.ticket else dataclasses.replace(request, ticket=token)

    async def rewind(self, s: NodeSession, position: int) -> None:
        """Drop this node's positions from ``position`` on (KV, ledger, seam log)."""
        before = self.shard.store.get(s.session).position
        if before <= position:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: self.shard.rewind(s.session, position))
        s.ledger.rewind(position)
        self.logs.trim(s, position, before)
        del s.ids_seen[position:]

    def _record(
        self, s: NodeSession, sizes: tuple[int, ...], tokens: np.ndarray | None, hidden: np.ndarray | None,
        frame: TensorFrame | None,
    ) -> None:  # fmt: skip
        """Add the computed chunks to the session's ledger: what each was computed from and what went onward."""
        # past the head the ledger covers the activations, whatever token ids came beside them
        inputs = np.ascontiguousarray(hidden) if hidden is not None else np.ascontiguousarray(tokens, dtype="<i4")
        sent = None if frame is None else frame_values(frame).reshape(inputs.shape[0], -1)
        at = 0
        for size in sizes:
            out = b"" if sent is None else sent[at : at + size].tobytes()
            s.ledger.record(size, inputs[at : at + size].tobytes(), out)
            at += size

    def _entry(
        self, s: NodeSession, compute_ms: float = 0.0, positions: int | None = None, *, sign: bool = True
    ) -> HopEntry:
        """This hop's entry in an answer: who computed what, and its ledger (protocol.ledger), signed
        (protocol.signing) unless the caller signs it with its answer (``sign=False``)."""
        ledger = s.ledger.describe()
        out = ledger.get("output_digest")
        entry = HopEntry(
            node=self.config.node_id,
            layers=str(self.info.layers),
            compute_ms=round(compute_ms, 3),
            held=int(ledger["held"]),  # type: ignore[call-overload]
            input_digest=str(ledger["input_digest"]),
            output_digest=None if out is None else str(out),
            positions=positions,
        )
        return self.config.hop_key.sign(s.session, entry) if sign else entry

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on a worker thread: shard calls that take its compute lock never stall the
        event loop (every other session's requests, decode channels, heartbeats) while a chunk runs."""
        return await asyncio.get_running_loop().run_in_executor(None, work, *args)

    def _bound(self, sid: SessionId) -> NodeSession | None:
        """This node's record of a session it serves on a route (None: it serves no such session)."""
        try:
            attached = self.shard.store.get(sid).attached
        except (SessionNotFound, SessionGone):
            return None
        return attached if isinstance(attached, NodeSession) else None

    def _existing(self, sid: SessionId) -> NodeSession:
        s = self._bound(sid)
        if s is None:
            self.shard.store.get(sid)  # 404/410 with the reason
            raise SessionNotFound(f"no session {sid} on this node")
        return s

    def sweep(self) -> None:
        """Expire idle sessions: their KV, and with it what this node kept beside it (``_ended``); and
        the standby snapshots nobody restored."""
        self.shard.store.expire_idle()
        if self.prefix_cache is not None:
            self.prefix_cache.sweep(time.time())

    def _ended(self, session: Session[Any]) -> None:
        s = session.attached
        if isinstance(s, NodeSession):
            self.logs.drop(s)
            if s.auth is not None:  # no ticket of an epoch it reached opens it again (node.authority)
                self.closed.close(s.session, s.auth.epoch)
