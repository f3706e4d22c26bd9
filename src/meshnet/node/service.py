"""A shard node's logic, independent of any transport: ``NodeService``.

Flow of one request (a ``protocol.messages.HopRequest``, whichever transport brought it): check
the session's route binding → compute this shard's layers on a worker thread → pass the output on
to the next hop through a ``node.transport.HopTransport`` → answer. The tail samples the next
token (``meshnet.sampling``) and its answer (token, logprob, per-hop entries) travels back up the
chain. ``node.app`` drives it over HTTP and the decode channel; tests drive chains of services
over ``LocalTransport`` with fake shards.

Pipelined prefill: a non-final prefill chunk is answered ``ACCEPTED`` as soon as this node has
computed it and queued the forward; forwards of one session leave in position order. A forward
that fails marks the session *broken* on this node: every later request on it gets the reason,
so a session is either advanced on every hop or reported broken — never silently diverged.
Every failure names the innermost hop that failed (``failed_hop``), which is what route repair
replaces.

Its parts (``node.service_*``): admission (bindings, tickets, quotas), the tail's answer (sampling,
verify chunks), prefix caching, KV snapshots, and route repair with rewinds and session ends.
Speculative decoding (``verify``): a decode step with drafted tokens after it computes every
position as a one-position step would (``shard.verify_chunk``). Penalties and grammars: the token
ids travel beside the activations to the tail, which counts them. Decode channel
(``node.channel``): a step may come with a ``Direct``; a hop passes it on over its own channel
without waiting, and the tail sends its answer straight to the gateway.

Concurrency: one request per session at a time (a second gets 409); compute is serialized by
the shard backend; the tail's sampling runs on worker threads under a per-token deadline
(``node.sampling_lane``: a costly grammar fails its generation, never the node's loop); everything
else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from meshnet.backends.shard import DecodeStep, ShardBackend, ShardOutput, compute_chunks, verify_chunk
from meshnet.errors import (
    HopFailed,
    InvalidRequest,
    MeshnetError,
    SessionBusy,
)
from meshnet.ids import SessionId
from meshnet.node.advert import Traffic
from meshnet.node.audit import AuditLane
from meshnet.node.authority import ClosedSessions
from meshnet.node.batcher import DecodeBatcher
from meshnet.node.channel import Direct
from meshnet.node.checks import check_drafts, check_model, shard_inputs
from meshnet.node.metrics import NodeMetrics
from meshnet.node.prefix_cache import PrefixCache
from meshnet.node.sampling_lane import DEFAULT_SAMPLE_DEADLINE_S, SamplingLane
from meshnet.node.service_admission import AdmissionParts
from meshnet.node.service_prefix import PrefixParts
from meshnet.node.service_repair import RepairParts
from meshnet.node.service_snapshots import SnapshotParts
from meshnet.node.service_tail import TailParts
from meshnet.node.session import NodeSession, SeamLogs
from meshnet.node.transport import HopTransport
from meshnet.protocol import headers as H
from meshnet.protocol.messages import (
    AnswerKind,
    HopAnswer,
    HopEntry,
    HopRequest,
    Payload,
    PrefixRequest,
    Verb,
)
from meshnet.protocol.signing import HopKey
from meshnet.protocol.tickets import TicketVerifier
from meshnet.protocol.wire import TensorFrame, encode_tensor, frame_values
from meshnet.routes import hop_timeout_s
from meshnet.session.store import Session

T = TypeVar("T")

__all__ = ["ChannelSend", "NodeConfig", "NodeService"]

_log = logging.getLogger("meshnet.node")

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


class NodeService(AdmissionParts, TailParts, PrefixParts, SnapshotParts, RepairParts):
    """A shard node's logic: the core here (a request computed, recorded and passed on), its parts in
    ``node.service_*`` (admission, the tail's answer, prefix caching, KV snapshots, repair)."""

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
        # Decode steps of different sessions that arrive together compute as one batch, where
        # the shard measured that a batch keeps every session's bits (node.batcher).
        self.batcher = DecodeBatcher(shard, self.metrics.batch) if shard.info.decode_batch > 1 else None
        self.traffic = Traffic()  # queue depth and measured speed, for the tracker (node.advert)
        self.logs = SeamLogs(config.seam_log_bytes)
        self.audits = AuditLane()  # an auditor's re-executions, one at a time
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache_bytes > 0:
            # kept blocks stay parked in the shard until a live session needs their room (node.prefix_cache)
            self.prefix_cache = PrefixCache(config.prefix_cache_bytes, release=shard.release)
            shard.store.on_evict = self.prefix_cache.evicted
        self._pushes: set[asyncio.Task[None]] = set()  # snapshots on their way to standbys
        self.closed = ClosedSessions()  # a private swarm's ended sessions: no ticket re-opens them (node.authority)
        self.sampling = SamplingLane(config.sample_deadline_s)  # the tail samples off the event loop
        # One record per session: the store's, with this node's binding attached (``_bound``); a
        # session that ends in the store (closed, expired) gives back its seam log with it.
        shard.store.on_end = self._ended
        self.started = time.time()

    # -- requests ------------------------------------------------------------------------------
    async def handle(
        self, request: HopRequest, direct: Direct | None = None, *, client: str | None = None,
        caller: str | None = None,
    ) -> HopAnswer | None:  # fmt: skip
        """Compute a request's positions and pass them on; the answer. A ``direct`` step goes on
        over the decode channel and answers nothing here (``None``) but on the tail, whose answer
        goes straight to the gateway with every hop's entry. ``client``: who sent it, when the
        transport knows (a private swarm's member id): a session it opens counts to its quota.
        ``caller``: the sending member's id (any role; ``None``: in process), which in a private
        swarm must be one of the session's drivers here (node.authority)."""
        check_model(self.info, request.model)
        if request.drafts:
            check_drafts(self.info, self.config.node_id, request.drafts)
        if direct is not None and request.replay:
            raise InvalidRequest(f"a decode-channel step is never replayed: drop {H.REPLAY}")
        began = time.perf_counter()
        tokens, hidden = shard_inputs(self.info, request)
        s = await self._session(request, client, caller)
        if s.busy:
            raise SessionBusy(
                f"session {request.session} already has a request in flight on this node; send one at a time"
            )
        s.busy = True
        try:
            return await self._compute_and_pass(s, request, tokens, hidden, direct, began=began)
        finally:
            s.busy = False

    async def _compute_and_pass(
        self, s: NodeSession, request: HopRequest, tokens: np.ndarray | None, hidden: np.ndarray | None,
        direct: Direct | None, *, began: float,
    ) -> HopAnswer | None:  # fmt: skip
        sid, start, n = request.session, request.start, request.n
        if request.rewind:
            await self.rewind(s, start)
        own = self._carried_ids(s, tokens, start)
        with self.traffic.measure(n, decode=request.decode):
            out_hidden, logits, compute_ms = await self._run(
                sid, start=start, tokens=own, hidden=hidden, sizes=request.sizes, verify=bool(request.drafts)
            )
        self.metrics.positions.inc(n)
        frame = None
        if out_hidden is not None:
            frame = encode_tensor(out_hidden.reshape(1, *out_hidden.shape), self.config.wire_dtype)
        self._record(s, request.sizes, tokens, hidden, frame)
        if direct is not None:
            s.seq = direct.seq
        answers = self.info.layers.is_tail and request.final and not request.replay  # signed with its answer
        me = self._entry(s, compute_ms, positions=n, sign=not answers)
        if self.info.layers.is_tail:
            if request.replay:
                return HopAnswer(AnswerKind.REPLAYED, (me,), count=n)
            if not request.final:
                return HopAnswer(AnswerKind.ACCEPTED, (me,), count=n)
            assert logits is not None
            answer = await self._sampled(s, request, logits, me, direct=direct is not None)
            if direct is not None:
                answer = answer.after(*_entries(direct.hops))
            self._handed_on(request, began, compute_ms)
            return answer
        assert frame is not None
        return await self._pass_on(
            s, request=request, frame=frame, tokens=tokens, me=me, direct=direct, began=began
        )  # fmt: skip

    async def _pass_on(
        self, s: NodeSession, *, request: HopRequest, frame: TensorFrame, tokens: np.ndarray | None, me: HopEntry,
        direct: Direct | None, began: float,
    ) -> HopAnswer | None:  # fmt: skip
        """Log and forward what this hop computed; the answer (``None`` for a ``direct`` step)."""
        ids = self._ids_onward(s, tokens)
        self.logs.append(s, request.start, frame, ids)
        if request.replay == 1:
            return HopAnswer(AnswerKind.REPLAYED, (me,), count=request.n)  # the hops after this one already hold it
        onward = request.onward(Payload(frame, ids), s.next_hops, model=self.info.model_id, route_id=s.route_id)
        self.metrics.seam_bytes.inc(len(frame.body) + len(ids or b""))
        previous = s.forward
        if direct is not None:  # fire and forget: the tail answers the gateway, a failure is reported there
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous  # its outcome is the session's break reason, checked below
            s.check_open()
            assert self.channel_send is not None, "a decode-channel step came to a node without channels"
            onward = self._with_ticket(s, onward)
            try:
                timeout = hop_timeout_s(self.config.hop_timeout_s, len(s.next_hops))
                await self.channel_send(s.next_hops[0], onward, direct.onward(me.to_json()), timeout)
            except MeshnetError as exc:
                s.break_with(exc)
                raise
            self._handed_on(request, began, me.compute_ms)
            return None

        async def send() -> HopAnswer:
            if previous is not None:
                await previous  # forwards leave in position order
            return await self._forward(s, onward)

        self._handed_on(request, began, me.compute_ms)  # what this hop took; the rest is the hops after it
        task: asyncio.Task[HopAnswer] = asyncio.ensure_future(send())
        s.forward = task
        if not request.final and not request.replay:
            task.add_done_callback(_consume)
            return HopAnswer(AnswerKind.ACCEPTED, (me,), count=request.n)
        answer = await task
        if request.drafts:  # the rejected drafts go here too, as the answer passes back up
            await self._drop_rejected(s, answer, start=request.start, n=request.n)
            me = self._entry(s, me.compute_ms, positions=me.positions)
        return answer.after(me)

    def _handed_on(self, request: HopRequest, began: float, compute_ms: float) -> None:
        """A decode step left this hop (sent on, or answered at the tail): count its time here,
        compute and the rest (checks, bookkeeping, thread hand-offs, encoding, the send)."""
        if request.verb is Verb.DECODE and not request.replay:
            self.metrics.decode_step(compute_ms / 1000, time.perf_counter() - began)

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

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on a worker thread: shard calls that take its compute lock never stall the
        event loop (every other session's requests, decode channels, heartbeats) while a chunk runs."""
        return await asyncio.get_running_loop().run_in_executor(None, work, *args)

    # -- compute ---------------------------------------------------------------------------------
    async def _run(
        self, sid: SessionId, *, start: int, tokens: np.ndarray | None, hidden: np.ndarray | None,
        sizes: tuple[int, ...], verify: bool,
    ) -> tuple[np.ndarray | None, np.ndarray | None, float]:  # fmt: skip
        began = time.perf_counter()
        if self.batcher is not None and sizes == (1,) and not verify:
            token = None if tokens is None else int(tokens[0])
            out = await self.batcher.step(DecodeStep(sid, start, token=token, hidden=hidden))
        else:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(
                None, lambda: self._compute(sid, start=start, tokens=tokens, hidden=hidden, sizes=sizes, verify=verify)
            )
        return out.hidden, out.logits, 1000 * (time.perf_counter() - began)

    def _compute(
        self, sid: SessionId, *, start: int, tokens: np.ndarray | None, hidden: np.ndarray | None,
        sizes: tuple[int, ...], verify: bool,
    ) -> ShardOutput:  # fmt: skip
        """One compute call per chunk of ``sizes`` (``shard.compute_chunks``); a verify chunk (``sizes``
        all ones) computes every position to a one-position step's bits, and the tail returns the
        logits of every position (``shard.verify_chunk``)."""
        if verify:
            return verify_chunk(self.shard, sid, start, tokens=tokens, hidden=hidden)
        return compute_chunks(self.shard, sid, start, sizes, tokens=tokens, hidden=hidden)

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


def _entries(raw: tuple[dict[str, Any], ...]) -> tuple[HopEntry, ...]:
    try:
        return tuple(HopEntry.from_json(h) for h in raw)
    except ValueError as exc:
        raise InvalidRequest(f'a STEP frame\'s "hops" must be hop entries: {exc}') from None


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the failure is recorded as the session's break reason
