"""KV snapshots for route repair: what a hop sends a standby, and how it travels.

A hop of a running session pushes a ``SessionSnapshot`` — its layers' KV at a chunk boundary
(``ShardBase.snapshot``), its ledger of those positions (protocol.ledger), its seam log and token
ids — to a *standby*: a trusted node the tracker chose, holding the same layers and computing them
bit-identically (``POST /v1/sessions/{id}/standbys``; the standby's signed repair ticket is the only
place the hop takes the standby's address from). When the hop dies, the standby becomes its
replacement: it restores the snapshot as the session (``POST /v1/sessions/{id}/restore``, with the
tracker's repair ticket) and the upstream replays only the positions after it
(``X-Meshnet-Replay-From``). Its ledger continues the dead hop's, so the gateway's digest check
after the repair covers the restored positions too. Snapshots never go to untrusted nodes: only a
private swarm's tracker names standbys, and only trusted ones.

Wire format (``encode`` / ``decode``)::

    b"MNSS" ‖ u32 LE header length ‖ JSON header ‖ KV snapshot ‖ seam log ‖ token-id log

The header names the session, the layers, the position, the ledger (chunk ends and hex digests),
the seam log's dtype and the three parts' lengths. ``decode`` refuses anything else with a 400.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from meshnet.errors import InvalidRequest
from meshnet.session.store import Parked

__all__ = ["SessionSnapshot"]

_MAGIC = b"MNSS"
_MAX_HEADER = 1 << 24


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    session: str
    layers: str
    position: int
    kv: bytes  # ShardBase.snapshot of exactly ``position`` positions
    ends: tuple[int, ...]  # the ledger: chunk ends, and the digests after each chunk
    inputs: tuple[bytes, ...]
    outputs: tuple[bytes, ...]
    log: bytes | None = None  # the seam log of those positions (None: none kept)
    log_dtype: str = ""
    ids_log: bytes = b""
    ids_seen: tuple[int, ...] = field(default=())  # a tail's token ids by position (penalties, grammar)
    expires_at: float = 0.0  # set by the holder: a snapshot nobody restored is dropped then
    # the holder's: ``kv`` loaded into a parked state of its shard (``ShardBase.park_snapshot``; then
    # ``kv`` is empty), never sent
    parked: Parked[Any] | None = None

    @property
    def nbytes(self) -> int:
        return len(self.kv) + len(self.log or b"") + len(self.ids_log) + 4 * len(self.ids_seen) + 40 * len(self.ends)

    def encode(self) -> bytes:
        header = json.dumps(
            {
                "session": self.session,
                "layers": self.layers,
                "position": self.position,
                "ends": list(self.ends),
                "inputs": [d.hex() for d in self.inputs],
                "outputs": [d.hex() for d in self.outputs],
                "log": None if self.log is None else len(self.log),
                "log_dtype": self.log_dtype,
                "ids_log": len(self.ids_log),
                "ids_seen": list(self.ids_seen),
                "kv": len(self.kv),
            },
            separators=(",", ":"),
        ).encode()
        return b"".join((_MAGIC, struct.pack("<I", len(header)), header, self.kv, self.log or b"", self.ids_log))

    @classmethod
    def decode(cls, body: bytes) -> SessionSnapshot:
        """The snapshot ``encode`` wrote; ``InvalidRequest`` saying what is wrong with anything else."""
        if len(body) < 8 or body[:4] != _MAGIC:
            raise InvalidRequest("not a Meshnet session snapshot (bad magic); send SessionSnapshot.encode() bytes")
        (size,) = struct.unpack_from("<I", body, 4)
        if size > _MAX_HEADER or 8 + size > len(body):
            raise InvalidRequest("the session snapshot's header is cut short")
        try:
            h = json.loads(body[8 : 8 + size])
            kv, log, ids = int(h["kv"]), h["log"], int(h["ids_log"])
            ends = tuple(int(e) for e in h["ends"])
            inputs = tuple(bytes.fromhex(d) for d in h["inputs"])
            outputs = tuple(bytes.fromhex(d) for d in h["outputs"])
            position, seen = int(h["position"]), tuple(int(t) for t in h["ids_seen"])
            session, layers, dtype = str(h["session"]), str(h["layers"]), str(h["log_dtype"])
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest("the session snapshot's header is not the JSON encode() writes") from None
        rest = body[8 + size :]
        log_len = 0 if log is None else int(log)
        if min(kv, log_len, ids) < 0 or kv + log_len + ids != len(rest):
            raise InvalidRequest("the session snapshot's parts do not add up to its body")
        if len(inputs) != len(ends) or (outputs and len(outputs) != len(ends)) or (ends and ends[-1] != position):
            raise InvalidRequest("the session snapshot's ledger does not describe its positions")
        return cls(
            session, layers, position, rest[:kv], ends, inputs, outputs,
            None if log is None else rest[kv : kv + log_len], dtype, rest[kv + log_len :], seen,
        )  # fmt: skip
