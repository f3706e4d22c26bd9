"""A shard node's logic, independent of any transport: ``NodeService``.

Flow of one request (a ``protocol.messages.HopRequest``, whichever transport brought it): check
the session's route binding → compute this shard's layers on a worker thread → pass the output on
to the next hop through a ``protocol.hops.HopTransport`` → answer. The tail samples the next
token (``meshnet.sampling``) and its answer (token, logprob, per-hop entries) travels back up the
chain. ``node.app`` drives it over HTTP and the decode channel; tests drive chains of services
over ``LocalTransport`` with fake shards.

Pipelined prefill: a non-final prefill chunk is answered ``ACCEPTED`` as soon as this node has
computed it and queued the forward; forwards of one session leave in position order. A forward
that fails marks the session *broken* on this node: every later request on it gets the reason,
so a session is either advanced on every hop or reported broken — never silently diverged.
Every failure names the innermost hop that failed (``failed_hop``), which is what route repair
replaces.

It stands on its parts, each built on the ones below it and none reaching up: ``node.service_base``
(the state; forward, record, rewind, this hop's signed entry) < ``service_admission`` (bindings,
tickets, quotas) < ``service_prefix`` (prefix caching) < ``service_snapshots`` (KV snapshots) <
``service_repair`` (reroute and replay, session ends, audit reads) < ``service_tail`` (the tail's
answer: sampling, verify chunks) < this module (the request flow).
Speculative decoding (``verify``): a decode step with drafted tokens after it computes every
position as a one-position step would (``shard.verify_chunk``). Penalties and grammars: the token
ids travel beside the activations to the tail, which counts them. Decode channel
(``node.channel``): a step may come with a ``Direct``; a hop passes it on over its own channel
without waiting, and the tail sends its answer straight to the gateway — and, where the gateway
gave it leave (a ``CREDIT``), first sends the next step to the route's head itself (``relay``), so
the token's loop through the route skips the gateway.

Concurrency: one request per session at a time (a second gets 409); compute is serialized by
the shard backend; the tail's sampling under a grammar runs on worker threads under a per-token
deadline (``node.sampling_lane``: a costly grammar fails its generation, never the node's loop);
everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from meshnet.backends.shard import DecodeStep, ShardOutput, compute_chunks, verify_chunk
from meshnet.errors import Conflict, Forbidden, InvalidRequest, MeshnetError, SessionBusy
from meshnet.ids import SessionId
from meshnet.node.checks import check_drafts, check_model, shard_inputs
from meshnet.node.offload import timed_off_loop
from meshnet.node.service_base import ChannelSend, NodeConfig, Recorded
from meshnet.node.service_tail import TailParts
from meshnet.node.session import NodeSession
from meshnet.protocol import headers as H
from meshnet.protocol.channel import Credit, Direct
from meshnet.protocol.messages import (
    Accepted,
    HopAnswer,
    HopEntry,
    HopRequest,
    Payload,
    Replayed,
    TokenAnswer,
    Verb,
    Voided,
)
from meshnet.protocol.wire import TensorFrame, encode_tensor
from meshnet.routes import hop_timeout_s

__all__ = ["ChannelSend", "NodeConfig", "NodeService"]


class NodeService(TailParts):
    """A shard node's logic: a request checked, computed, recorded and passed on (its parts below)."""

    async def handle(
        self, request: HopRequest, direct: Direct | None = None, *, client: str | None = None,
        caller: str | None = None,
    ) -> HopAnswer:  # fmt: skip
        """Compute a request's positions and pass them on; the answer. A ``direct`` step goes on
        over the decode channel without waiting for the hops after this one: a hop before the tail
        answers ``Accepted`` with its own entry, signed once the step has gone on (the channel
        sends that entry to the gateway), and the tail's answer goes straight to the gateway.
        ``client``: who sent it, when the transport knows (a private swarm's member id): a session
        it opens counts to its quota. ``caller``: the sending member's id (any role; ``None``: in
        process), which in a private swarm must be one of the session's drivers here (node.authority)."""
        check_model(self.info, request.model)
        if request.drafts:
            check_drafts(self.info, self.config.node_id, request.drafts)
        if direct is not None and request.replay:
            raise InvalidRequest(f"a decode-channel step is never replayed: drop {H.REPLAY}")
        began = time.perf_counter()
        tokens, hidden = shard_inputs(self.info, request)
        plain = request.verb is Verb.DECODE and not request.rewind and request.start > 0
        s = await self._session(request, client, caller, relay=direct is not None and plain)
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
    ) -> HopAnswer:  # fmt: skip
        sid, start, n = request.session, request.start, request.n
        if request.rewind:
            await self.rewind(s, start)
        if request.guess is not None and self.info.layers.is_tail and not _continues(s, request):
            return self._voided(s, request, direct)  # nothing computed: the round before it ended elsewhere
        own = self._carried_ids(s, tokens, start)
        with self.traffic.measure(n, decode=request.decode):
            out_hidden, logits, compute_ms = await self._run(
                sid, start=start, tokens=own, hidden=hidden, sizes=request.sizes, verify=bool(request.drafts)
            )
        self.metrics.positions.inc(n)
        frame = None
        if out_hidden is not None:
            frame = encode_tensor(out_hidden.reshape(1, *out_hidden.shape), self.config.wire_dtype)
        if direct is not None:
            s.seq = direct.seq
        tail = self.info.layers.is_tail
        ids = None if tail else self._ids_onward(s, tokens)
        # the tail signs its entry with its answer; a hop before it, a channel step's once the step went on
        sign = not (tail and request.final and not request.replay) and direct is None
        entry = Recorded(lambda: self._recorded(s, request, tokens=tokens, hidden=hidden, frame=frame, ids=ids,
                                                compute_ms=compute_ms, sign=sign))  # fmt: skip
        try:
            if tail:
                if request.replay:
                    return Replayed((entry(),), count=n)
                if not request.final:
                    return Accepted((entry(),), count=n)
                assert logits is not None
                return await self._sampled(s, request, logits, entry, compute_ms, direct=direct, began=began)
            assert frame is not None
            return await self._pass_on(
                s, request=request, frame=frame, ids=ids, entry=entry, compute_ms=compute_ms, direct=direct,
                began=began,
            )  # fmt: skip
        finally:
            entry()  # whatever happened after the compute, the ledger and seam log hold what the KV holds

    def _recorded(
        self, s: NodeSession, request: HopRequest, *, tokens: np.ndarray | None, hidden: np.ndarray | None,
        frame: TensorFrame | None, ids: bytes | None, compute_ms: float, sign: bool,
    ) -> HopEntry:  # fmt: skip
        """Record a computed request in the session's ledger and (a hop before the tail) its seam log;
        this hop's entry for it (``_entry``)."""
        self._record(s, request.sizes, tokens, hidden, frame)
        if frame is not None:
            self.logs.append(s, request.start, frame, ids)
        return self._entry(s, compute_ms, positions=request.n, sign=sign)

    async def _pass_on(
        self, s: NodeSession, *, request: HopRequest, frame: TensorFrame, ids: bytes | None, entry: Recorded,
        compute_ms: float, direct: Direct | None, began: float,
    ) -> HopAnswer:  # fmt: skip
        """Forward what this hop computed; the answer (for a ``direct`` step: ``Accepted`` with this
        hop's entry). A ``direct`` step is recorded (``entry``) and its entry signed once it has gone
        on: they are off the token's path through the route (~0.05 ms of a decode step's hop on a
        2-core machine); anything else is recorded first."""
        if direct is None:
            entry()
        if request.replay == 1:
            return Replayed((entry(),), count=request.n)  # the hops after this one already hold it
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
                await self.channel_send(s.next_hops[0], onward, direct.onward(), timeout)
            except MeshnetError as exc:
                s.break_with(exc)
                raise
            self._handed_on(request, began, compute_ms)
            return Accepted((self.config.hop_key.sign(s.session, entry()),), count=request.n)
        me = entry()

        async def send() -> HopAnswer:
            if previous is not None:
                await previous  # forwards leave in position order
            return await self._forward(s, onward)

        self._handed_on(request, began, compute_ms)  # what this hop took; the rest is the hops after it
        task: asyncio.Task[HopAnswer] = asyncio.ensure_future(send())
        s.forward = task
        if not request.final and not request.replay:
            task.add_done_callback(_consume)
            return Accepted((me,), count=request.n)
        answer = await task
        if isinstance(answer, Voided) and request.guess is not None:  # the tail dropped the round: so does this hop
            await self.rewind(s, request.start)
            me = self._entry(s, me.compute_ms, positions=me.positions)
        elif request.drafts:  # the rejected drafts go here too, as the answer passes back up
            await self._drop_rejected(s, answer, start=request.start, n=request.n)
            me = self._entry(s, me.compute_ms, positions=me.positions)
        return answer.after(me)

    def take_credit(self, credit: Credit, caller: str | None = None) -> None:
        """Keep a gateway's leave to relay the step after step ``credit.after`` (a ``CREDIT`` frame):
        one per session, until this tail answers its next step (``relay``). Only a tail takes one,
        from one of the session's drivers, for the session's own route and, in a private swarm,
        naming the head its ticket names (the only place a relayed step may go)."""
        sid = SessionId(credit.session)
        s = self._existing(sid)
        if not self.info.layers.is_tail:
            raise InvalidRequest(f"node {self.config.node_id} is not a tail (layers {self.info.layers}): only a "
                                 f"route's tail relays steps, so it takes no CREDIT for session {sid}")  # fmt: skip
        self._check_driver(s, caller, None, "give leave to relay steps of")
        if credit.route_id is not None and credit.route_id != s.route_id:
            raise Conflict(f"session {sid} is pinned to route {s.route_id}, not {credit.route_id}")
        if credit.model is not None:
            check_model(self.info, credit.model)
        head = s.auth.head if s.auth is not None else None
        if head is not None and credit.head != head:
            raise Forbidden(f"a CREDIT for session {sid} names {credit.head} as its head, but its ticket's route "
                            f"starts at {head}: a tail relays steps only to its route's head")  # fmt: skip
        s.credit = credit

    async def relay(self, sid: SessionId, direct: Direct, answer: HopAnswer) -> int | None:
        """The number of the step the tail sent to the route's head after ``answer`` — the step it
        answered (``direct.seq``) — itself, or ``None`` (the gateway sends it). The tail sends it
        as soon as it chose the token, before it works out and signs the answer
        (``TailParts._relay_next``); here it only reports that, and any credit still held is used
        up: a credit never outlives the step it follows."""
        s = self._bound(sid)
        if s is None:
            return None
        done, s.relayed, s.credit = s.relayed, None, None
        if done is None or done[0] != direct.seq or not isinstance(answer, TokenAnswer):
            return None
        return done[1]

    def _voided(self, s: NodeSession, request: HopRequest, direct: Direct | None) -> Voided:
        """The tail's answer to a pipelined round it drops unseen: the positions it holds."""
        if direct is not None:
            s.seq = direct.seq
        self.metrics.voided.inc()
        return Voided((self._entry(s, positions=0),), count=s.ledger.position)

    async def _run(
        self, sid: SessionId, *, start: int, tokens: np.ndarray | None, hidden: np.ndarray | None,
        sizes: tuple[int, ...], verify: bool,
    ) -> tuple[np.ndarray | None, np.ndarray | None, float]:  # fmt: skip
        """The chunk's output and its compute in ms: the shard call's own time, not the hand-offs
        to and from a worker thread (``node.offload``: a decode step may skip them)."""

        def compute() -> ShardOutput:
            return self._compute(sid, start=start, tokens=tokens, hidden=hidden, sizes=sizes, verify=verify)

        if sizes != (1,) or verify:
            out, seconds = await timed_off_loop(compute)
        elif self.batcher is not None:
            token = None if tokens is None else int(tokens[0])
            out, seconds = await self.batcher.step(DecodeStep(sid, start, token=token, hidden=hidden))
        else:
            out, seconds = await self.calls.step(compute)
        return out.hidden, out.logits, 1000 * seconds

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


def _continues(s: NodeSession, request: HopRequest) -> bool:
    """Whether a pipelined round starts where the tail's newest token is, with that token."""
    return s.sampled == (request.start, request.guess) and s.ledger.position == request.start


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the failure is recorded as the session's break reason
