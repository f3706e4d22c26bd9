"""Route repair, rewinds and the end of a session: ``NodeService``'s part (docs/protocol.md).

Every non-tail node keeps a seam log per session (``node.session.SeamLogs``). ``reroute`` points a
session at new next hops and replays the log into them (``replay``: they rebuild their KV without
answering a token), then resends the interrupted step with ``rewind`` so a hop that already
computed it drops it first. Nothing upstream recomputes, and no KV crosses the network.
``delete`` ends a session here and down the chain; ``seam_log`` and ``audit`` serve audit
sampling (protocol.audits).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from meshnet.errors import Conflict, Forbidden, InvalidRequest, SessionBusy, SessionGone, SessionNotFound, Unauthorized
from meshnet.ids import SessionId
from meshnet.node.audit import reexecute
from meshnet.node.checks import check_model, check_next_hops
from meshnet.node.service_snapshots import SnapshotParts
from meshnet.node.session import NodeSession
from meshnet.protocol.audits import AuditRequest, AuditStatement
from meshnet.protocol.ledger import pack_chunks
from meshnet.protocol.messages import HopAnswer, HopRequest, Payload, Replayed, Rerouted, RerouteRequest, Verb
from meshnet.protocol.tickets import REPAIR
from meshnet.protocol.wire import TensorFrame

__all__ = ["RepairParts"]


class RepairParts(SnapshotParts):
    """Route repair (reroute and replay), session ends, and what audits read."""

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
        s.next_hops, s.broken, s.broken_hop, s.broken_full, s.forward = hops, None, None, False, None
        keep = None if request.step is None else request.step + int(request.resend)
        if keep is not None and self.shard.store.get(sid).position > keep:
            await self.rewind(s, keep)
        position = self.shard.store.get(sid).position
        me = self._entry(s)
        if request.replay == 0:
            return Rerouted((me,), position=position, session=sid, next_hops=hops)
        sizes = s.ledger.sizes()
        resent = [1] if request.resend else []  # the newest position is the step, resent as one
        if s.log is None or not s.log_dtype or s.ledger.position != position or (resent and sizes[-1:] != resent):
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
        if since and (since not in s.ledger.ends or since > position - len(resent)):
            raise Conflict(
                f"session {sid} holds no chunk boundary at {since} below its newest position {position} here: "
                "the replacement must restore a snapshot of this session's own chunks",
                code="no_seam_log",
            )
        skip = s.ledger.ends.index(since) + 1 if since else 0
        answer: HopAnswer = Replayed((), count=0)
        for offset, chunks in pack_chunks(sizes[skip : len(sizes) - len(resent)], self.config.replay_chunk):
            begin = since + offset
            end = begin + sum(chunks)
            answer = await self._forward(
                s, replayed(Verb.PREFILL, begin, end, chunks=tuple(chunks) if len(chunks) > 1 else None)
            )
        if resent:
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

        ends: list[Coroutine[Any, Any, object]] = [end_here()]
        if s.next_hops:  # the next hops keep theirs meanwhile
            ends.append(self._delete_onward(s.next_hops[0], sid, ticket))
        if s.standby is not None:  # its snapshot is of no more use
            ends.append(self.transport.drop_snapshot(s.standby[0], sid, s.standby[1]))
        await asyncio.gather(*ends)

    async def _delete_onward(self, hop: str, sid: SessionId, ticket: str | None) -> None:
        """Pass a delete down the chain. A next hop may still be finishing the session's last step
        when the delete comes (a decode-channel step's token reaches the gateway straight from the
        tail, and the gateway closes at once, while a middle hop is still handing the step on): it
        answers 409, and the node's closer (``protocol.closer``) asks it again in the background,
        so no hop after this one keeps the session until its idle TTL. A refusal that will not
        change (a bad ticket) is not retried."""

        async def attempt() -> bool | None:
            return await self.transport.delete(hop, sid, ticket)

        await self.closer.close(attempt, f"{hop}/v1/sessions/{sid}", timeout_s=self.config.hop_timeout_s)

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
            "busy": s.busy,  # a request of it is in flight on this node
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
