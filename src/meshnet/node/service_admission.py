"""Admission, ``NodeService``'s part: which requests open or drive a session here.

A session opens from its first request's binding (route, next hops, the tail's sampling); in a
private swarm only with a tracker-signed route ticket naming this node, its next hops the
ticket's, and only its drivers may drive it (``node.authority``); a member holds at most
``max_sessions_per_client`` sessions. The token ids travel beside the activations when every hop
reads them or the session's tail counts them (penalties, grammars).
"""

from __future__ import annotations

import numpy as np

from meshnet.errors import Conflict, InvalidRequest, RateLimited, SeamMismatch, SessionGone, Unauthorized
from meshnet.ids import SessionId
from meshnet.node.authority import SessionAuthority
from meshnet.node.checks import check_next_hops, sampling_params
from meshnet.node.service_base import ServiceBase
from meshnet.node.session import NodeSession
from meshnet.protocol import headers as H
from meshnet.protocol.ledger import ChunkLedger
from meshnet.protocol.messages import HopRequest, PrefixClaim
from meshnet.protocol.tickets import CODE_MISMATCH, RouteTicket, TicketKind
from meshnet.sampling import Sampler

__all__ = ["AdmissionParts"]


class AdmissionParts(ServiceBase):
    """Which requests open or drive a session here."""

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

    def _check_driver(
        self, s: NodeSession, caller: str | None, ticket: str | None, what: str, *, relay: bool = False
    ) -> None:
        """In a private swarm, ``caller`` may ``what`` the session here (``relay``: a plain decode step
        over the decode channel, which the head also takes from the route's tail). A ticket the request
        carries is taken first: a newer epoch (a repair) names this hop's new upstream, an older one is
        refused."""
        auth, verifier = s.auth, self.config.tickets
        if auth is None or verifier is None:
            return
        if ticket is not None:
            node = self.config.node_id
            signed = verifier.verify(ticket, session_id=s.session, route_id=s.route_id, node_id=node, current=False)
            auth.learn(signed, ticket, node)
        auth.check(caller, s.session, self.config.node_id, what, relay=relay)

    async def _session(
        self, request: HopRequest, client: str | None = None, caller: str | None = None, *, relay: bool = False
    ) -> NodeSession:
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
        self._check_driver(s, caller, request.ticket, "drive", relay=relay)
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

    def _binding(
        self,
        sid: SessionId,
        route_id: str,
        sampling: str | None,
        hops: tuple[str, ...],
        client: str | None,
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
