"""Prefix caching, ``NodeService``'s part (``node.prefix_cache``).

A session's first request names its prompt's blocks; when the session ends, the blocks this hop
computed in canonical chunks stay in the prefix cache. A ``PrefixRequest`` opens a session that
adopts as many leading cached blocks as every hop of the route holds: each hop adopts what it can
(at most what the hop before it adopted), passes the count on, and drops back to what the tail
answers. A session that takes positions it did not compute takes their record too (``_resume``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from meshnet.errors import Conflict, HopFailed, MeshnetError
from meshnet.node.checks import check_model
from meshnet.node.prefix_cache import CachedPrefix
from meshnet.node.service_admission import AdmissionParts
from meshnet.node.session import NodeSession
from meshnet.protocol.messages import Cached, PrefixClaim, PrefixRequest

__all__ = ["PrefixParts"]

_log = logging.getLogger("meshnet.node")


class PrefixParts(AdmissionParts):
    """Prefix caching: sessions that adopt cached prompt blocks, and blocks kept when one ends."""

    async def prefix(self, request: PrefixRequest, *, client: str | None = None, caller: str | None = None) -> Cached:
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
                return Cached((self._entry(s),), count=blocks * claim.block)
            onward = request.onward(blocks, s.next_hops, model=self.info.model_id)
            answer = await self._forward(s, onward)
            if not isinstance(answer, Cached) or answer.count % claim.block or answer.count > blocks * claim.block:
                what = f"{answer.kind} {answer.count}" if isinstance(answer, Cached) else answer.kind
                error = HopFailed(
                    f"next hop {s.next_hops[0]} answered a prefix request of {blocks} blocks with {what}",
                    failed_hop=s.next_hops[0],
                )
                s.break_with(error)
                raise error
            await self.rewind(s, answer.count)  # the hops after this one hold fewer blocks: keep what they do
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
