"""What a node keeps per session beside the shard's KV, and the seam logs route repair replays.

``NodeSession``: the route binding (route id, next hops), the tail's sampler, the ledger of the
chunks computed here (protocol.ledger), whether the session is busy or broken, the forwards in
flight, and the *seam log* — every activation this node sent onward, wire-encoded, positions 0..
in order, so that a repair can rebuild a replacement next hop without recomputing anything
upstream (docs/protocol.md, "Route repair"). ``SeamLogs`` holds all sessions' logs within one
node-wide byte budget: a log that would not fit, or that stops being a gapless record, is dropped
(its session can then only be repaired by a fresh prefill).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from meshnet.errors import HopFull, MeshnetError, SessionBroken
from meshnet.ids import SessionId
from meshnet.node.authority import SessionAuthority
from meshnet.protocol.channel import Credit
from meshnet.protocol.ledger import ChunkLedger
from meshnet.protocol.messages import PrefixClaim
from meshnet.protocol.wire import TensorFrame
from meshnet.sampling import Sampler

__all__ = ["NodeSession", "SeamLogs"]


@dataclass
class NodeSession:
    session: SessionId
    route_id: str
    next_hops: tuple[str, ...]
    sampler: Sampler | None
    ledger: ChunkLedger
    busy: bool = False
    broken: str | None = None
    broken_hop: str | None = None
    broken_full: bool = False  # it broke on a hop without room (HopFull): said so to the gateway, which waits
    forward: asyncio.Task[Any] | None = None
    # The seam log (``SeamLogs``); ``None`` once dropped (budget) or on the tail.
    log: bytearray | None = field(default_factory=bytearray)
    log_dtype: str = ""
    # beside it, for a model whose every hop reads the token ids: the ids of positions 0.., int32
    ids_log: bytearray = field(default_factory=bytearray)
    # Token ids travel beside the activations to the tail (``carry_ids``) when its choices depend
    # on the tokens generated so far (presence/frequency penalties, a grammar); the tail keeps them by position.
    carry_ids: bool = False
    ids_seen: list[int] = field(default_factory=list)
    seq: int | None = None  # the newest decode-channel step this node computed for the session
    # the tail's newest token and its position (where the next step starts): a pipelined round
    # (``guess``) is kept only if it starts there with this token
    sampled: tuple[int, int] | None = None
    client: str | None = None  # the swarm member that opened it here (per-client quotas), if known
    prefix: PrefixClaim | None = None  # its prompt's blocks, for the prefix cache (node.prefix_cache)
    standby: tuple[str, str] | None = None  # (URL, ticket) of the standby its KV snapshot went to
    auth: SessionAuthority | None = None  # a private swarm's: who drives it here, its ticket's epoch
    credit: Credit | None = None  # at the tail: a gateway's leave to relay the step after one (NodeService.relay)
    # at the tail: (the decode-channel step, the step it relayed after it or None), once it chose its token
    relayed: tuple[int, int | None] | None = None

    def check_open(self) -> None:
        if self.broken:
            code = HopFull.code if self.broken_full else None
            raise SessionBroken(f"session {self.session} is broken on this node: {self.broken}",
                                failed_hop=self.broken_hop, code=code)  # fmt: skip

    def break_with(self, error: MeshnetError) -> None:
        """Every later request on the session gets this reason (the first one stays). A hop without
        room for the session stays one (``hop_full``): a pipelined prefill learns of it on its next
        chunk, and the gateway must wait for room then, not report a failure."""
        if not self.broken:
            self.broken, self.broken_hop = error.message, error.failed_hop
            self.broken_full = isinstance(error, HopFull)


class SeamLogs:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used = 0

    def append(self, s: NodeSession, start: int, frame: TensorFrame, ids: bytes | None = None) -> None:
        """Append the activations of positions ``start..`` (and their token ids, for a session
        whose ids travel) to the session's log, within budget."""
        log = s.log
        if log is None:
            return
        row = len(frame.body) // frame.shape[1]
        gapless = len(log) == start * row and (ids is None or len(s.ids_log) == start * 4)
        if (s.log_dtype and s.log_dtype != frame.dtype) or not gapless:
            self.drop(s)  # not a gapless record of this session any more: useless for a replay
            return
        size = len(frame.body) + len(ids or b"")
        if self.used + size > self.budget_bytes:
            self.drop(s)
            return
        s.log_dtype = frame.dtype
        log += frame.body
        if ids is not None:
            s.ids_log += ids
        self.used += size

    def adopt(self, s: NodeSession, log: bytes, dtype: str, ids: bytes) -> None:
        """Start the (empty) log of a session that adopted cached positions with their log, within budget."""
        if s.log is None or s.log or s.ids_log:
            return
        if self.used + len(log) + len(ids) > self.budget_bytes:
            self.drop(s)
            return
        s.log += log
        s.ids_log += ids
        s.log_dtype = dtype
        self.used += len(log) + len(ids)

    def drop(self, s: NodeSession) -> None:
        if s.log is not None:
            self.used -= len(s.log) + len(s.ids_log)
            s.log = None
            s.ids_log = bytearray()

    def trim(self, s: NodeSession, position: int, before: int) -> None:
        """Keep positions ``0..position - 1`` of a log that held ``before`` positions."""
        if s.log:
            keep = position * (len(s.log) // before)
            self.used -= len(s.log) - keep
            del s.log[keep:]
        if s.ids_log:
            self.used -= len(s.ids_log) - 4 * position
            del s.ids_log[4 * position :]

    def replay_frame(self, s: NodeSession, begin: int, end: int, seam: tuple[int, ...], held: int) -> TensorFrame:
        """The logged activations of positions ``begin..end - 1`` of a log of ``held`` positions."""
        assert s.log is not None
        row = len(s.log) // held
        return TensorFrame((1, end - begin, *seam), s.log_dtype, bytes(s.log[begin * row : end * row]))
