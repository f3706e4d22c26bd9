"""KV snapshots, ``NodeService``'s part (``node.snapshots``).

``snapshot`` takes a session's KV, ledger and seam log here and pushes them to the standby a
tracker-signed ticket names; ``receive_snapshot`` keeps one as a standby (parked in the shard, in
room only parked KV yields, like a kept prefix); ``restore`` opens a repair's session from it, and
``reroute`` with ``replay_from`` then replays only the positions after it. Only a private swarm has
the trusted nodes snapshots go to.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from meshnet.errors import Conflict, InvalidRequest, MeshnetError, SessionBusy, SessionNotFound, StoreFull, Unauthorized
from meshnet.ids import SessionId
from meshnet.node.checks import check_model
from meshnet.node.service_prefix import PrefixParts
from meshnet.node.session import NodeSession
from meshnet.node.snapshots import SessionSnapshot
from meshnet.protocol import headers as H
from meshnet.protocol.messages import Restored, RestoreRequest
from meshnet.protocol.tickets import CODE_MISMATCH, REPAIR, TicketVerifier

__all__ = ["SnapshotParts"]

_log = logging.getLogger("meshnet.node")


class SnapshotParts(PrefixParts):
    """KV snapshots: taken and pushed to a standby, kept as one, restored by a repair."""

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
    ) -> Restored:
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
        return Restored((self._entry(s),), count=taken.position)

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
