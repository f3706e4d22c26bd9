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

Route repair (docs/protocol.md): every non-tail node keeps a seam log per session
(``node.session.SeamLogs``). ``reroute`` points a session at new next hops and replays the log
into them (``replay``: they rebuild their KV without answering a token), then resends the
interrupted step with ``rewind`` so a hop that already computed it drops it first. Nothing
upstream recomputes, and no KV crosses the network.

Speculative decoding (``verify``): a decode step with drafted tokens after it computes every
position as a one-position step would (``shard.verify_chunk``); the tail keeps the drafts its
sampler agrees with plus one token of its own, and every hop drops the rejected positions as the
answer passes it back.

Penalties and grammars: when the session's sampling parameters set a presence or frequency
penalty or a grammar, the token ids travel beside the activations to the tail (and into the seam
logs), which counts the generated ones and brings its grammar state up to them before each choice.

Decode channel (``node.channel``): a step may come with a ``Direct`` (it came over a kept-open
WebSocket); a hop passes it on over its own channel without waiting, the tail sends its answer
straight to the gateway, and a failure goes to the gateway from the hop that met it. After a
verify chunk there, the hops before the tail drop the rejected drafts when the next step says so
(``rewind``).

Prefix caching (``node.prefix_cache``): a session's first request names its prompt's blocks; when
the session ends, the blocks this hop computed in canonical chunks stay in the prefix cache. A
``PrefixRequest`` opens a session that adopts as many leading cached blocks as every hop of the
route holds: each hop adopts what it can (at most what the hop before it adopted), passes the
count on, and drops back to what the tail answers.

KV snapshots (``node.snapshots``): ``snapshot`` takes a session's KV, ledger and seam log here and
pushes them to the standby a tracker-signed ticket names; ``receive_snapshot`` keeps one as a
standby; ``restore`` opens a repair's session from it, and ``reroute`` with ``replay_from`` then
replays only the positions after it.

Concurrency: one request per session at a time (a second gets 409); compute is serialized by
the shard backend; the tail's sampling runs on worker threads under a per-token deadline
(``node.sampling_lane``: a costly grammar fails its generation, never the node's loop); everything
else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from meshnet.backends.shard import DecodeStep, ShardBackend, ShardOutput, compute_chunks, verify_chunk
from meshnet.errors import (
    Conflict,
    Forbidden,
    HopFailed,
    InvalidRequest,
    MeshnetError,
    RateLimited,
    SeamMismatch,
    SessionBusy,
    SessionGone,
    SessionNotFound,
    StoreFull,
    Unauthorized,
)
from meshnet.ids import SessionId
from meshnet.node.advert import Traffic
from meshnet.node.audit import AuditLane, reexecute
from meshnet.node.authority import ClosedSessions, SessionAuthority
from meshnet.node.batcher import DecodeBatcher
from meshnet.node.channel import Direct
from meshnet.node.checks import check_drafts, check_model, check_next_hops, sampling_params, shard_inputs
from meshnet.node.metrics import NodeMetrics
from meshnet.node.prefix_cache import CachedPrefix, PrefixCache
from meshnet.node.sampling_lane import DEFAULT_SAMPLE_DEADLINE_S, SamplingLane, SamplingTooSlow
from meshnet.node.session import NodeSession, SeamLogs
from meshnet.node.snapshots import SessionSnapshot
from meshnet.node.transport import HopTransport
from meshnet.protocol import headers as H
from meshnet.protocol.audits import AuditRequest, AuditStatement
from meshnet.protocol.ledger import ChunkLedger, pack_chunks
from meshnet.protocol.messages import (
    AnswerKind,
    HopAnswer,
    HopEntry,
    HopRequest,
    Payload,
    PrefixClaim,
    PrefixRequest,
    RerouteRequest,
    RestoreRequest,
    Verb,
)
from meshnet.protocol.signing import HopKey
from meshnet.protocol.tickets import CODE_MISMATCH, REPAIR, RouteTicket, TicketKind, TicketVerifier
from meshnet.protocol.wire import TensorFrame, encode_tensor, frame_values
from meshnet.routes import hop_timeout_s
from meshnet.sampling import Alternatives, Draw, Sampler
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


class NodeService:
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

    async def _sampled(
        self, s: NodeSession, request: HopRequest, logits: np.ndarray, me: HopEntry, *, direct: bool
    ) -> HopAnswer:
        """The tail's answer: the token after the chunk; for a verify chunk, the drafts it keeps and one
        token of its own (``Sampler.verify``), with the rejected drafts' positions dropped first. Its
        entry (``me``) says what it held before: after a ``direct`` verify chunk, the hops before
        it drop the rejected drafts only when the next step tells them (``rewind``), so every
        entry of the answer describes the whole chunk."""
        assert s.sampler is not None
        sampler, start, n, drafts = s.sampler, request.start, request.n, request.drafts
        history = s.ids_seen[sampler.params.generated_from : start + n - len(drafts)] if s.carry_ids else None
        try:  # off the event loop, under a deadline: a costly grammar fails this generation, not the node
            chosen = await self.sampling.run(
                lambda: _choose(sampler, logits, history, drafts, at=start + n if not drafts else start + 1),
                tokens=1 + len(drafts), grammar=sampler.grammar is not None,
                cancel=sampler.grammar.cancel if sampler.grammar is not None else None,
            )  # fmt: skip
        except SamplingTooSlow as exc:
            s.break_with(exc)  # its sampler is still busy on a worker thread: nothing may use it again
            raise
        if not drafts:
            (token,), (logprob,) = chosen.tokens, chosen.logprobs
            top = chosen.tops[0] if chosen.tops is not None else None
            answer = HopAnswer(AnswerKind.TOKEN, (me,), position=start + n, token=token, logprob=logprob, top=top,
                               draw=chosen.draw)  # fmt: skip
            return self.config.hop_key.sign_answer(s.session, answer)  # the tail vouches for its token and draw
        tokens, logprobs, tops = list(chosen.tokens), list(chosen.logprobs), chosen.tops
        kept = start + len(tokens)
        await self.rewind(s, kept)
        if not direct:
            me = self._entry(s, me.compute_ms, positions=me.positions, sign=False)
        answer = HopAnswer(
            AnswerKind.TOKENS, (me,), position=kept, tokens=tuple(tokens), logprobs=tuple(logprobs), tops=tops,
            drafted=len(drafts), accepted=len(tokens) - 1,
        )  # fmt: skip
        return self.config.hop_key.sign_answer(s.session, answer)

    async def _drop_rejected(self, s: NodeSession, answer: HopAnswer, *, start: int, n: int) -> None:
        """Keep what the verify ``answer`` kept (up to its ``position``) of the chunk of ``n`` at ``start``."""
        kept, hop = answer.position, s.next_hops[0]
        if answer.kind is not AnswerKind.TOKENS or kept is None or not start < kept <= start + n:
            error = HopFailed(
                f"next hop {hop} answered a verify chunk at {start} with position {kept!r}", failed_hop=hop
            )
            s.break_with(error)
            raise error
        await self.rewind(s, kept)

    # -- prefix caching --------------------------------------------------------------------------
    async def prefix(
        self, request: PrefixRequest, *, client: str | None = None, caller: str | None = None
    ) -> HopAnswer:
        """Open a session that adopts the KV of its prompt's leading cached blocks (at most
        ``request.reuse``, and no more than every hop after this one holds): answers ``CACHED``
        with the positions every hop now holds, from 0 (nothing cached) on."""
        check_model(self.info, request.model)
        sid = request.session
        if self._bound(sid) is not None:
            raise Conflict(f"session {sid} is already open here; a prefix request is a session's first request")
        claim = request.prefix
        s = await self._open(sid, route_id=request.route_id, sampling=request.sampling, next_hops=request.next_hops,
                             ticket=request.ticket, client=client, prefix=claim, caller=caller)  # fmt: skip
        s.busy = True
        try:
            blocks = await self._adopt(s, claim, request.reuse)
            if self.info.layers.is_tail:
                return HopAnswer(AnswerKind.CACHED, (self._entry(s),), count=blocks * claim.block)
            onward = request.onward(blocks, s.next_hops, model=self.info.model_id)
            answer = await self._forward(s, onward)
            held = answer.count
            if answer.kind is not AnswerKind.CACHED or held % claim.block or held > blocks * claim.block:
                error = HopFailed(
                    f"next hop {s.next_hops[0]} answered a prefix request of {blocks} blocks with {answer.kind} {held}",
                    failed_hop=s.next_hops[0],
                )
                s.break_with(error)
                raise error
            await self.rewind(s, held)  # the hops after this one hold fewer blocks: keep what they do
            return answer.after(self._entry(s))
        finally:
            s.busy = False

    async def _adopt(self, s: NodeSession, claim: PrefixClaim, limit: int) -> int:
        """Adopt the cached KV (and ledger, seam log) of the most leading blocks of ``claim`` this
        node holds, at most ``limit``; how many. A hit that cannot be adopted counts as none."""
        cache = self.prefix_cache
        hit = cache.lookup(claim.block, claim.hashes, limit) if cache is not None and limit > 0 else None
        if hit is None:
            if cache is not None and limit > 0:
                self.metrics.prefix_misses.inc()
            return 0
        entry, blocks = hit
        positions = blocks * claim.block
        loop = asyncio.get_running_loop()
        parked = entry.parked

        def adopt() -> None:
            if parked is not None:
                self.shard.adopt_parked(s.session, parked, positions)
            else:
                self.shard.adopt(s.session, entry.snapshot, positions)

        try:
            await loop.run_in_executor(None, adopt)
        except MeshnetError as exc:
            _log.warning("prefix cache: session %s could not adopt %d cached positions: %s", s.session, positions,
                         exc.message)  # fmt: skip
            return 0
        ends = [claim.block * (i + 1) for i in range(blocks)]
        with_ids = self.info.seam.carries_token_ids or s.carry_ids
        log = entry.log_prefix(positions)
        if with_ids and len(entry.ids_log) < 4 * positions:
            log = None  # no complete record of these positions: a repair will need a fresh prefill
        ids = entry.ids_log[: 4 * positions] if with_ids else b""
        self._resume(
            s, ends, entry.inputs[:blocks], entry.outputs[:blocks], log=log, log_dtype=entry.log_dtype, ids=ids
        )
        if s.carry_ids and self.info.layers.is_tail:
            s.ids_seen = [0] * positions  # prompt positions: before generated_from, never counted
        self.metrics.prefix_hits.inc()
        self.metrics.prefix_reused.inc(positions)
        return blocks

    def _resume(
        self, s: NodeSession, ends: Sequence[int], inputs: Sequence[bytes], outputs: Sequence[bytes], *,
        log: bytes | None, log_dtype: str, ids: bytes,
    ) -> None:  # fmt: skip
        """A session that took positions it did not compute (a prefix cache hit, a snapshot) takes their
        record with them: the ledger (chunk ends, digests) and the seam log (``None``: none kept)."""
        s.ledger.ends, s.ledger.inputs = list(ends), list(inputs)
        s.ledger.outputs = list(outputs) if s.ledger.sends else []
        if log is not None:
            self.logs.adopt(s, log, log_dtype, ids)
        else:
            self.logs.drop(s)

    async def _keep_prefix(self, s: NodeSession) -> None:
        """Put the session's canonically computed prompt blocks into the prefix cache (it is ending)."""
        cache, claim = self.prefix_cache, s.prefix
        if cache is None or claim is None or s.broken:
            return
        blocks = 0
        for i, end in enumerate(s.ledger.ends[: len(claim.hashes)]):
            if end != claim.block * (i + 1):
                break  # not the chunk a cold prefill computes this block in
            blocks += 1
        hashes = claim.hashes[:blocks]
        inputs, outputs = tuple(s.ledger.inputs[:blocks]), tuple(s.ledger.outputs[:blocks])
        if not hashes or cache.agrees(hashes, inputs, outputs):
            return
        sid, positions = s.session, blocks * claim.block
        held = self.shard.store.get(sid).position
        row = len(s.log) // held if s.log and held else 0
        log = None if s.log is None or not s.log_dtype else bytes(s.log[: positions * row])
        ids = bytes(s.ids_log[: 4 * positions])

        loop = asyncio.get_running_loop()
        try:  # the session ends here, its first blocks parked in the shard (node.prefix_cache)
            parked = await loop.run_in_executor(None, lambda: self.shard.park(sid, positions))
        except MeshnetError as exc:  # a recurrent state cannot go back: kept whole or not at all
            _log.info("prefix cache: session %s not kept: %s", sid, exc.message)
            return
        cache.add(CachedPrefix(claim.block, hashes, b"", inputs, outputs, log, s.log_dtype, ids, parked))
        self.metrics.prefix_bytes.set(cache.used)

    # -- KV snapshots (node.snapshots) -----------------------------------------------------------
    async def snapshot(self, sid: SessionId, ticket: str | None, caller: str | None = None) -> dict[str, Any]:
        """Take this hop's KV of a session and push it to the standby that ``ticket`` names: a
        tracker-signed repair ticket of the contingency "this hop fails and the standby replaces
        it" (``POST /v1/sessions/{id}/standbys``: the tracker names trusted, same-layer,
        bit-identical nodes only). Answered once the snapshot is taken; it travels in the background."""
        verifier = self._snapshot_tickets()
        s = self._existing(sid)
        self._check_driver(s, caller, None, "snapshot")
        signed = verifier.verify(ticket, session_id=sid, route_id=s.route_id, kind=REPAIR)
        assert signed.repair_from is not None  # a repair ticket names its replaced hop
        standby = signed.hops[signed.repair_from]
        if standby.layers != str(self.info.layers) or standby.node_id == self.config.node_id:
            raise Unauthorized(
                f"the ticket's standby {standby.node_id} (layers {standby.layers}) cannot hold this node's layers "
                f"{self.info.layers}; ask the tracker for this hop's standby (POST /v1/sessions/{sid}/standbys)",
                param=H.TICKET,
                code=CODE_MISMATCH,
            )
        if s.busy:
            raise SessionBusy(f"session {sid} has a request in flight on this node; snapshot it between steps")
        s.check_open()
        s.busy = True
        try:
            taken = await self._take_snapshot(s)
        finally:
            s.busy = False
        assert ticket is not None
        s.standby = (standby.url, ticket)
        task = asyncio.ensure_future(self._push(standby.url, sid, ticket, taken))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        return {"snapshot": taken.position, "to": standby.node_id}

    async def _take_snapshot(self, s: NodeSession) -> SessionSnapshot:
        sid = s.session
        loop = asyncio.get_running_loop()
        position = self.shard.store.get(sid).position
        if s.ledger.position != position or position == 0:
            raise Conflict(f"session {sid} has no complete record of its {position} positions here to snapshot")
        kv = await loop.run_in_executor(None, lambda: self.shard.snapshot(sid))
        complete = s.log is not None and bool(s.log_dtype)
        return SessionSnapshot(
            sid, str(self.info.layers), position, kv, tuple(s.ledger.ends), tuple(s.ledger.inputs),
            tuple(s.ledger.outputs), bytes(s.log) if complete and s.log is not None else None, s.log_dtype,
            bytes(s.ids_log), tuple(s.ids_seen),
        )  # fmt: skip

    async def _push(self, url: str, sid: SessionId, ticket: str, taken: SessionSnapshot) -> None:
        try:
            await self.transport.push_snapshot(url, sid, ticket, taken.encode(), timeout_s=self.config.hop_timeout_s)
        except MeshnetError as exc:
            _log.warning("KV snapshot of session %s at %d positions did not reach standby %s: %s", sid,
                         taken.position, url, exc.message)  # fmt: skip

    async def receive_snapshot(self, sid: SessionId, ticket: str | None, body: bytes) -> dict[str, Any]:
        """Keep a KV snapshot as the standby ``ticket`` names this node as (its replaced hop)."""
        verifier = self._snapshot_tickets()
        me = self.config.node_id
        signed = verifier.verify(ticket, session_id=sid, node_id=me, kind=REPAIR)
        if signed.index_of(me) != signed.repair_from:
            raise Unauthorized(f"the ticket does not name node {me} as the standby of session {sid}",
                               param=H.TICKET, code=CODE_MISMATCH)  # fmt: skip
        taken = SessionSnapshot.decode(body)
        if taken.session != sid or taken.layers != str(self.info.layers):
            raise InvalidRequest(
                f"the snapshot is of session {taken.session}, layers {taken.layers}; this is session {sid} on a "
                f"node of layers {self.info.layers}"
            )
        cache = self.prefix_cache
        expires = time.time() + self.shard.store.limits.idle_ttl_s
        kept = dataclasses.replace(taken, expires_at=expires)
        if cache is not None:
            cache.discard(sid)  # the session's older snapshot: this one supersedes it
            loop = asyncio.get_running_loop()
            try:  # into the shard's own memory, in room only parked KV yields (node.prefix_cache)
                parked = await loop.run_in_executor(None, lambda: self.shard.park_snapshot(taken.kv))
                kept = dataclasses.replace(kept, kv=b"", parked=parked)
            except StoreFull:
                pass  # live sessions fill the shard: host memory, within --prefix-cache-mb
        if cache is None or not cache.hold(kept):
            raise StoreFull(
                f"this node keeps {0 if cache is None else cache.budget_bytes} bytes of KV beside its sessions "
                f"(--prefix-cache-mb); a {taken.nbytes}-byte snapshot does not fit",
                retry_after_s=5,
            )
        return {"held": taken.position, "session": sid}

    async def restore(
        self, request: RestoreRequest, *, client: str | None = None, caller: str | None = None
    ) -> HopAnswer:
        """Open a route repair's session here from the snapshot this node holds as the failed hop's
        standby; the positions it holds (``RESTORED``). The upstream then replays only the rest."""
        verifier = self._snapshot_tickets()
        check_model(self.info, request.model)
        sid, me = request.session, self.config.node_id
        if self._bound(sid) is not None:
            raise Conflict(f"session {sid} is already open here")
        signed = verifier.verify(request.ticket, session_id=sid, route_id=request.route_id, node_id=me, kind=REPAIR)
        assert request.ticket is not None
        auth = self._admit(signed, request.ticket, caller)
        self._check_quota(client)
        s = self._binding(sid, request.route_id, request.sampling, signed.onward_urls(me), client)
        s.auth = auth
        cache = self.prefix_cache
        taken = cache.take(sid) if cache is not None else None
        if taken is None:
            raise SessionNotFound(f"no KV snapshot of session {sid} on this node (never pushed here, or expired)")
        loop = asyncio.get_running_loop()
        parked = taken.parked

        def restore() -> None:
            if parked is not None:
                self.shard.restore_parked(sid, parked)  # the session opens on the parked state itself
            else:
                self.shard.restore(sid, taken.kv)

        try:
            await loop.run_in_executor(None, restore)
        except MeshnetError:
            if cache is not None and (parked is None or parked.held):
                cache.hold(taken)  # still this session's, for a retry
            raise
        self.shard.store.get(sid).attached = s
        self._resume(s, taken.ends, taken.inputs, taken.outputs, log=taken.log, log_dtype=taken.log_dtype,
                     ids=taken.ids_log)  # fmt: skip
        s.ids_seen = list(taken.ids_seen)
        return HopAnswer(AnswerKind.RESTORED, (self._entry(s),), count=taken.position)

    async def drop_snapshot(self, sid: SessionId, ticket: str | None) -> None:
        """The session ended whole: forget the snapshot this node holds as its standby."""
        verifier = self._snapshot_tickets()
        verifier.verify(ticket, session_id=sid, node_id=self.config.node_id, kind=REPAIR, current=False)
        if self.prefix_cache is not None:
            self.prefix_cache.discard(sid)

    def _snapshot_tickets(self) -> TicketVerifier:
        if self.config.tickets is None:
            raise Conflict(
                "KV snapshots go only to trusted nodes, and only a private swarm has them (meshnet swarm init; "
                "nodes invited with --trusted): this node serves an open swarm",
                code="no_trusted_nodes",
            )
        return self.config.tickets

    # -- repair, rewind, delete ------------------------------------------------------------------
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

    async def reroute(self, request: RerouteRequest, *, caller: str | None = None) -> HopAnswer:
        """Point the session at new next hops; with ``replay`` > 0, rebuild them from the seam log.

        Every position but the newest is replayed in exactly the chunks it was first computed in
        (a position's KV depends on its chunk, protocol.ledger), packed into prefill requests
        that the first ``replay`` hops compute without answering a token; the newest position —
        the interrupted decode step — is then resent through the whole chain (``rewind`` lets a
        hop that already has it drop it first), and its answer — the next token — is returned,
        with this hop's own entry first.

        ``step``: the interrupted step's position. A hop that holds more (the drafts of an
        interrupted verify chunk) drops them first: the step is resent without drafts.
        """
        sid = request.session
        check_model(self.info, request.model)
        s = self._existing(sid)
        if request.route_id != s.route_id:
            raise Conflict(f"session {sid} is pinned to route {s.route_id}, not {request.route_id}")
        hops, signed = self._ticketed_hops(request.ticket, sid, s.route_id, request.next_hops, kind=REPAIR)
        self._check_driver(s, caller, None, "reroute")  # even with the session's genuine repair ticket
        hops = check_next_hops(self.info, self.config.node_id, hops)
        if s.busy:
            raise SessionBusy(f"session {sid} has a request in flight on this node; reroute it after that")
        if signed is not None and s.auth is not None and request.ticket is not None:
            s.auth.learn(signed, request.ticket, self.config.node_id)  # a superseded repair is refused here
            s.auth.sent_epoch = -1  # the new next hops get it on the replay (and the others on the resent step)
        s.busy = True
        try:
            return await self._reroute(s, hops, request)
        finally:
            s.busy = False

    async def _reroute(self, s: NodeSession, hops: tuple[str, ...], request: RerouteRequest) -> HopAnswer:
        sid = s.session
        if s.forward is not None:
            with contextlib.suppress(Exception):
                await s.forward  # the failed forward: its outcome is why we are here
        s.next_hops, s.broken, s.broken_hop, s.forward = hops, None, None, None
        if request.step is not None and self.shard.store.get(sid).position > request.step + 1:
            await self.rewind(s, request.step + 1)
        position = self.shard.store.get(sid).position
        me = self._entry(s)
        if request.replay == 0:
            return HopAnswer(AnswerKind.REROUTED, (me,), position=position, session=sid, next_hops=hops)
        sizes = s.ledger.sizes()
        if s.log is None or not s.log_dtype or s.ledger.position != position or sizes[-1:] != [1]:
            raise Conflict(
                f"session {sid} cannot be replayed from this node (no complete seam log, or its newest "
                "position is not a decode step); it needs a fresh prefill",
                code="no_seam_log",
            )
        with_ids = self.info.seam.carries_token_ids or s.carry_ids
        if with_ids and len(s.ids_log) != 4 * position:
            raise Conflict(f"session {sid} has no complete token-id log on this node; it needs a fresh prefill",
                           code="no_seam_log")  # fmt: skip

        def payload(a: int, b: int) -> Payload:
            ids = bytes(s.ids_log[4 * a : 4 * b]) if with_ids else None
            return Payload(self.logs.replay_frame(s, a, b, self.info.seam.shape, position), ids)

        def replayed(verb: Verb, a: int, b: int, *, chunks: tuple[int, ...] | None = None) -> HopRequest:
            first = a == 0  # the new hops learn the route from the first position on
            return HopRequest(
                verb, sid, a, b - a, payload(a, b), model=self.info.model_id, route_id=s.route_id,
                next_hops=hops[1:] if first else None, sampling=request.sampling if first else None,
                chunks=chunks, replay=request.replay if verb is Verb.PREFILL else 0, rewind=verb is Verb.DECODE,
                ticket=request.ticket if first else None,
            )  # fmt: skip

        since = request.replay_from
        if since and (since not in s.ledger.ends or since >= position):
            raise Conflict(
                f"session {sid} holds no chunk boundary at {since} below its newest position {position} here: "
                "the replacement must restore a snapshot of this session's own chunks",
                code="no_seam_log",
            )
        skip = s.ledger.ends.index(since) + 1 if since else 0
        for offset, chunks in pack_chunks(sizes[skip:-1], self.config.replay_chunk):
            begin = since + offset
            end = begin + sum(chunks)
            await self._forward(
                s, replayed(Verb.PREFILL, begin, end, chunks=tuple(chunks) if len(chunks) > 1 else None)
            )
        answer = await self._forward(s, replayed(Verb.DECODE, position - 1, position))
        return answer.after(me)

    async def delete(self, sid: SessionId, ticket: str | None = None, caller: str | None = None) -> None:
        """Free a session here, then on the next hop (the delete travels down the chain).

        In a private swarm only a holder of the session's ticket may: a genuine tracker ticket for
        this session and its pinned route (route or repair; expired ones too, a session outlives
        its ticket), which only the gateway that opened it and the route's hops ever see. A member
        that merely learns a session id cannot end it (401 ``route_ticket_*``)."""
        s = self._existing(sid)
        if self.config.tickets is not None:
            signed = self.config.tickets.verify(ticket, session_id=sid, route_id=s.route_id, current=False)
            if s.auth is not None and ticket is not None and any(h.node_id == self.config.node_id for h in signed.hops):
                with contextlib.suppress(Unauthorized):  # a repair's new upstream may end it too; older: as before
                    s.auth.learn(signed, ticket, self.config.node_id)
        self._check_driver(s, caller, None, "close")  # the ticket alone does not do: every hop sees it
        if s.forward is not None:
            with contextlib.suppress(Exception):
                await s.forward  # its outcome was already recorded; only the order matters
        if s.busy:  # still computing: it stays, KV and all
            raise SessionBusy(f"session {sid} is computing; close it after the call returns")

        async def end_here() -> None:
            s.busy = True  # nothing else runs on it while its prompt blocks go into the prefix cache
            try:
                with contextlib.suppress(SessionGone, SessionNotFound):  # expired meanwhile: nothing to keep
                    await self._keep_prefix(s)
            finally:
                s.busy = False
            # expired meanwhile: the delete still travels down the chain
            with contextlib.suppress(SessionGone, SessionNotFound):
                await self._off_loop(self.shard.close_session, sid)

        ends = [end_here()]
        if s.next_hops:  # the next hops keep theirs meanwhile
            ends.append(self.transport.delete(s.next_hops[0], sid, ticket))
        if s.standby is not None:  # its snapshot is of no more use
            ends.append(self.transport.drop_snapshot(s.standby[0], sid, s.standby[1]))
        await asyncio.gather(*ends)

    def session_state(self, sid: SessionId, caller: str | None = None, *, admin: bool = False) -> dict[str, Any]:
        """``GET /v1/sessions/{id}``: what this node holds of a session (a gateway asks it to find
        where a decode-channel step stopped); in a private swarm only for its drivers and, read
        only, the swarm's admins (``admin``: the caller's certificate is of that role)."""
        s = self._existing(sid)
        if not admin:
            self._check_driver(s, caller, None, "read")
        return {
            "session": sid,
            "node": self.config.node_id,
            "position": self.shard.store.get(sid).position,
            "seq": s.seq,
            "broken": s.broken,
            **s.ledger.describe(),
        }

    def seam_log(self, sid: SessionId, caller: str | None = None) -> tuple[TensorFrame, tuple[int, ...]]:
        """``GET /v1/sessions/{id}/seam``: what this hop sent on of positions ``0..held - 1`` (its
        seam log) and the chunks it computed them in, for a gateway auditing the session
        (protocol.audits: they are the next hop's inputs, and its signed output digest covers them)."""
        s = self._existing(sid)
        self._check_driver(s, caller, None, "read")
        held = s.ledger.position
        if self.info.layers.is_tail:
            raise Conflict(f"node {self.config.node_id} is the tail of session {sid}: it sends nothing on",
                           code="no_seam_log")  # fmt: skip
        if s.busy:
            raise SessionBusy(f"session {sid} has a request in flight on this node; read its seam log between steps")
        if s.log is None or not s.log_dtype or held == 0 or len(s.log) % held:
            raise Conflict(f"session {sid} has no complete seam log on this node (--seam-log-mb)", code="no_seam_log")
        return self.logs.replay_frame(s, 0, held, self.info.seam.shape, held), tuple(s.ledger.sizes())

    async def audit(self, body: bytes) -> AuditStatement:
        """``POST /v1/audit`` on an auditor: re-execute another hop's work (node.audit)."""
        if not self.config.auditor:
            raise Forbidden(f"node {self.config.node_id} is not an auditor (start one with meshnet node --auditor)")
        request = AuditRequest.decode(body)
        if request.held > self.info.max_positions > 0:
            raise InvalidRequest(
                f"the audit covers {request.held} positions; this auditor holds {self.info.max_positions}"
            )
        grammar_of = self.shard.grammar if self.info.layers.is_tail else None
        statement = await self.audits.run(
            lambda: reexecute(self.shard, self.config.hop_key, self.config.node_id, request, grammar_of)
        )
        self.metrics.audits.inc()
        return statement

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

    # -- validation ------------------------------------------------------------------------------
    def _ticketed_hops(
        self,
        ticket: str | None,
        sid: SessionId,
        route_id: str | None,
        hops: tuple[str, ...],
        *,
        kind: TicketKind | None,
    ) -> tuple[tuple[str, ...], RouteTicket | None]:
        """The next hops a session may use: in a private swarm, those of its tracker-signed ticket
        (which must name this node; a request naming other hops is refused), else the request's;
        and the verified ticket (``None`` in an open swarm)."""
        verifier = self.config.tickets
        if verifier is None:
            return hops, None
        node = self.config.node_id
        signed = verifier.verify(ticket, session_id=sid, route_id=route_id, node_id=node, kind=kind)
        onward = signed.onward_urls(node)
        if hops and hops != onward:
            raise Unauthorized(
                f"{H.NEXT_HOPS} names {', '.join(hops)}, but the session's ticket routes it to "
                f"{', '.join(onward) or 'nothing (this node is its tail)'}; a node forwards only along its ticket",
                param=H.NEXT_HOPS,
                code=CODE_MISMATCH,
            )
        return onward, signed

    def _admit(self, signed: RouteTicket, token: str, caller: str | None) -> SessionAuthority:
        """Who drives a session this ticket opens here; refused when it was closed here at the
        ticket's epoch, or when ``caller`` is not one of its drivers."""
        self.closed.check(signed)
        auth = SessionAuthority.of(signed, token, self.config.node_id, caller)
        auth.check(caller, signed.session_id, self.config.node_id, "open")
        return auth

    def _check_driver(self, s: NodeSession, caller: str | None, ticket: str | None, what: str) -> None:
        """In a private swarm, ``caller`` may ``what`` the session here. A ticket the request carries
        is taken first: a newer epoch (a repair) names this hop's new upstream, an older one is refused."""
        auth, verifier = s.auth, self.config.tickets
        if auth is None or verifier is None:
            return
        if ticket is not None:
            node = self.config.node_id
            signed = verifier.verify(ticket, session_id=s.session, route_id=s.route_id, node_id=node, current=False)
            auth.learn(signed, ticket, node)
        auth.check(caller, s.session, self.config.node_id, what)

    def _with_ticket(self, s: NodeSession, request: HopRequest) -> HopRequest:
        """``request`` as it goes to the next hop: with the session's newest ticket, once per epoch."""
        if s.auth is None:
            return request
        token = s.auth.onward(request.ticket)
        return request if token == request.ticket else dataclasses.replace(request, ticket=token)

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

    async def _session(self, request: HopRequest, client: str | None = None, caller: str | None = None) -> NodeSession:
        sid = request.session
        s = self._bound(sid)
        if s is None:
            if request.start != 0:
                # A session that is past position 0 existed once: this node lost it.
                self._check_quota(client)
                raise SessionGone(
                    f"session {sid} is unknown at position {request.start}: this node restarted or the session "
                    "expired; start a fresh prefill"
                )
            return await self._open(
                sid, route_id=request.route_id, sampling=request.sampling, next_hops=request.next_hops or (),
                ticket=request.ticket, client=client, prefix=request.prefix, caller=caller,
            )  # fmt: skip
        if request.route_id is not None and request.route_id != s.route_id:
            raise Conflict(f"session {sid} is pinned to route {s.route_id}, not {request.route_id}")
        self._check_driver(s, caller, request.ticket, "drive")
        s.check_open()
        return s

    async def _open(
        self, sid: SessionId, *, route_id: str | None, sampling: str | None, next_hops: tuple[str, ...],
        ticket: str | None, client: str | None, prefix: PrefixClaim | None, caller: str | None = None,
    ) -> NodeSession:  # fmt: skip
        """Open a session here from its first request's binding (route, next hops, the tail's sampling).
        The shard's part runs off the event loop: it waits for the compute lock (another session's
        chunk may hold it for seconds) and a tail compiles the request's grammar."""
        self._check_quota(client)
        if not route_id:
            raise InvalidRequest(f"header {H.ROUTE_ID} is required on a session's first request")
        hops, signed = self._ticketed_hops(ticket, sid, route_id, next_hops, kind=None)
        auth = None if signed is None or ticket is None else self._admit(signed, ticket, caller)

        def bind() -> NodeSession:
            s = self._binding(sid, route_id, sampling, hops, client)
            s.prefix, s.auth = prefix, auth
            self.shard.open_session(sid)
            self.shard.store.get(sid).attached = s
            return s

        return await self._off_loop(bind)

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on a worker thread: shard calls that take its compute lock never stall the
        event loop (every other session's requests, decode channels, heartbeats) while a chunk runs."""
        return await asyncio.get_running_loop().run_in_executor(None, work, *args)

    def _binding(
        self, sid: SessionId, route_id: str, sampling: str | None, hops: tuple[str, ...], client: str | None
    ) -> NodeSession:
        """A new session's record here: its route, next hops (checked) and the tail's sampler."""
        tail = self.info.layers.is_tail
        params = sampling_params(sampling)
        hops = check_next_hops(self.info, self.config.node_id, hops)
        sampler = Sampler(params, self.shard.grammar(params.grammar) if params.grammar else None) if tail else None
        s = NodeSession(sid, route_id, hops, sampler, ChunkLedger(not tail), carry_ids=params.needs_history)
        s.client = client
        if tail or self.config.seam_log_bytes <= 0:
            s.log = None
        return s

    def _check_quota(self, client: str | None) -> None:
        """A client may hold ``max_sessions_per_client`` sessions here: one more is a 429."""
        limit = self.config.max_sessions_per_client
        if client is None or limit is None:
            return
        bound = (self._bound(sid) for sid in self.shard.store.ids())
        held = sum(1 for s in bound if s is not None and s.client == client)
        if held >= limit:
            raise RateLimited(
                f"member {client!r} holds {held} sessions on node {self.config.node_id}, its limit "
                f"(--max-sessions-per-client {limit}); close one (DELETE) or retry when one ends",
                retry_after_s=5,
            )

    def _carried_ids(self, s: NodeSession, tokens: np.ndarray | None, start: int) -> np.ndarray | None:
        """Check that a session whose ids travel got them; the ids the shard itself computes from."""
        info = self.info
        if s.carry_ids and tokens is None and not info.layers.is_head:
            raise SeamMismatch(
                "this session's token ids travel to the tail (penalties, grammar): send the chunk's ids first in "
                f"the body, with {H.TOKEN_IDS}"
            )
        if s.carry_ids and info.layers.is_tail and tokens is not None:
            del s.ids_seen[start:]
            s.ids_seen.extend(int(t) for t in tokens)
        return tokens if info.layers.is_head or info.seam.carries_token_ids else None

    def _ids_onward(self, s: NodeSession, tokens: np.ndarray | None) -> bytes | None:
        """The chunk's token ids for the next hop, when this model's every hop reads them or the
        session's tail counts them (``carry_ids``)."""
        if not (self.info.seam.carries_token_ids or s.carry_ids):
            return None
        assert tokens is not None  # _inputs required them
        return np.ascontiguousarray(tokens, dtype="<i4").reshape(-1).tobytes()

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


@dataclass(frozen=True, slots=True)
class _Chosen:
    """What the tail's sampler decided for one answer: its tokens, their logprobs and alternatives, and
    (one sampled token) the distribution it was drawn from."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tops: tuple[Alternatives, ...] | None
    draw: Draw | None = None


def _choose(
    sampler: Sampler, logits: np.ndarray, history: Sequence[int] | None, drafts: Sequence[int], *, at: int
) -> _Chosen:
    """The sampler's work for one answer, on a worker thread: bring it up to ``history`` (the generated
    tokens before this answer), then the token at ``at`` — or, after ``drafts``, the drafts it keeps and
    one token of its own from ``at`` on."""
    if history is not None:
        sampler.set_history(history)
    wants_top = bool(sampler.params.top_logprobs)
    if not drafts:
        token, logprob, draw = sampler.sample_committed(logits, position=at)
        return _Chosen((token,), (logprob,), (sampler.alternatives(logits),) if wants_top else None, draw)
    tokens, logprobs = sampler.verify(logits, drafts, position=at)
    tops = tuple(sampler.alternatives(row) for row in logits[: len(tokens)]) if wants_top else None
    return _Chosen(tuple(tokens), tuple(logprobs), tops)


def _entries(raw: tuple[dict[str, Any], ...]) -> tuple[HopEntry, ...]:
    try:
        return tuple(HopEntry.from_json(h) for h in raw)
    except ValueError as exc:
        raise InvalidRequest(f'a STEP frame\'s "hops" must be hop entries: {exc}') from None


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the failure is recorded as the session's break reason
