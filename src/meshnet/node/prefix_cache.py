"""A node's prefix cache: the KV of finished sessions' prompt blocks, for the next session to reuse.

OpenAI-style clients resend the whole conversation every turn. When a session ends (the gateway's
``DELETE``), the node keeps the KV of the leading prompt blocks it computed (``protocol.prefix``:
``block`` tokens each, named by chained hashes the gateway sent with the session's first request)
as a ``CachedPrefix``: a shard snapshot of exactly those positions, the ledger digests after each
block, and the seam log of those positions (so a session that reuses them can still have its next
hop rebuilt by route repair). A new session whose prompt starts with cached blocks adopts their KV
(``ShardBase.adopt``) and prefills only the rest (``POST …/prefix``, ``node.service``).

Exact, not approximate: a block is cached only where the session computed it as exactly one chunk
of ``block`` positions starting at a multiple of ``block`` — the chunk a cold prefill computes it
in — so the adopted KV has the bits a cold prefill would give (a position's KV depends on its chunk,
protocol.ledger). Decode steps are never cached. The ledger digests travel with the entry, and the
gateway checks them against its own token ids before it streams a token: a wrong or poisoned entry
is a refused reuse and a cold prefill, never wrong text.

Bounded: entries live within ``budget_bytes`` (``--prefix-cache-mb``), least recently used evicted
first; an entry whose blocks another entry extends is dropped (the longer one serves both). The
same budget and the same LRU order hold the KV snapshots this node keeps as another hop's standby
(``node.snapshots``, ``hold`` / ``take``): all the KV a node keeps beside its live sessions. Not
thread-safe: the node uses it from its event loop only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from meshnet.node.snapshots import SessionSnapshot
from meshnet.protocol.prefix import PrefixFilter

__all__ = ["CachedPrefix", "PrefixCache"]


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    block: int
    hashes: tuple[bytes, ...]  # of its blocks, in order: it holds ``len(hashes) * block`` positions
    snapshot: bytes  # ``ShardBase.snapshot`` of exactly those positions
    inputs: tuple[bytes, ...]  # the hop's ledger digests after each block (protocol.ledger)
    outputs: tuple[bytes, ...]  # (empty on a tail)
    log: bytes | None  # the seam log of those positions (None: the session kept none)
    log_dtype: str = ""
    ids_log: bytes = b""  # token ids beside it, when they travelled

    @property
    def positions(self) -> int:
        return self.block * len(self.hashes)

    @property
    def nbytes(self) -> int:
        digests = 16 * (len(self.inputs) + len(self.outputs)) + 8 * len(self.hashes)
        return len(self.snapshot) + len(self.log or b"") + len(self.ids_log) + digests

    def log_prefix(self, positions: int) -> bytes | None:
        """The seam log of the first ``positions`` positions."""
        if self.log is None:
            return None
        return self.log[: positions * (len(self.log) // self.positions)]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    reused_positions: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("a prefix cache budget is never negative")
        self.budget_bytes = budget_bytes
        # prefix entries by their last block hash, standby snapshots by _snapshot_key; LRU first
        self._entries: collections.OrderedDict[bytes, CachedPrefix | SessionSnapshot] = collections.OrderedDict()
        self._where: dict[bytes, bytes] = {}  # block hash -> key of an entry holding it
        self._filter: PrefixFilter | None = None
        self.used = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        """Prefix entries held (snapshots not counted)."""
        return sum(isinstance(e, CachedPrefix) for e in self._entries.values())

    def lookup(self, block: int, hashes: tuple[bytes, ...], limit: int) -> tuple[CachedPrefix, int] | None:
        """The entry holding the most leading blocks of ``hashes`` (at most ``limit``), and how many."""
        count = 0
        for h in hashes[:limit]:
            if h not in self._where:
                break
            count += 1
        if count == 0:
            self.stats.misses += 1
            return None
        key = self._where[hashes[count - 1]]
        entry = self._entries[key]
        # a hash seeds its block size, so another size means a collision
        if not isinstance(entry, CachedPrefix) or entry.block != block:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.reused_positions += count * block
        return entry, count

    def touch(self, hashes: tuple[bytes, ...]) -> bool:
        """Whether some entry holds all of ``hashes`` (their last one: they are chained); it becomes
        the most recently used."""
        key = self._where.get(hashes[-1]) if hashes else None
        if key is None:
            return False
        self._entries.move_to_end(key)
        return True

    def agrees(self, hashes: tuple[bytes, ...], inputs: tuple[bytes, ...], outputs: tuple[bytes, ...]) -> bool:
        """Whether an entry holds all of ``hashes`` with these ledger digests after each block (it
        becomes the most recently used): a session that computed the blocks itself need not keep them
        again. A held entry whose digests differ is a bad one (``add`` replaces it)."""
        key = self._where.get(hashes[-1]) if hashes else None
        entry = None if key is None else self._entries.get(key)
        n = len(hashes)
        if not isinstance(entry, CachedPrefix) or entry.inputs[:n] != inputs or entry.outputs[:n] != outputs:
            return False
        return self.touch(hashes)

    def add(self, entry: CachedPrefix) -> bool:
        """Keep ``entry`` (evicting the least recently used ones to fit); False if it cannot fit at all."""
        if not entry.hashes or entry.nbytes > self.budget_bytes:
            return False
        for k, held in list(self._entries.items()):  # what was computed from other inputs is not these blocks
            if isinstance(held, CachedPrefix) and _disagree(held, entry):
                self._drop(k)
        key = entry.hashes[-1]
        if self._where.get(key, key) != key:  # a longer entry already holds all of it
            return self.touch(entry.hashes)
        covered = [k for k, e in self._entries.items() if k == key or k in entry.hashes]
        for k in covered:  # entries this one extends (or replaces): it serves their prefixes too
            self._drop(k)
        self._make_room(entry.nbytes)
        self._entries[key] = entry
        self.used += entry.nbytes
        for h in entry.hashes:
            self._where[h] = key
        self._filter = None
        self.stats.stored += 1
        return True

    def hold(self, snapshot: SessionSnapshot) -> bool:
        """Keep a standby snapshot (replacing an older one of its session); False if it cannot fit."""
        key = _snapshot_key(snapshot.session)
        if key in self._entries:
            self._drop(key)
        if snapshot.nbytes > self.budget_bytes:
            return False
        self._make_room(snapshot.nbytes)
        self._entries[key] = snapshot
        self.used += snapshot.nbytes
        return True

    def take(self, session: str) -> SessionSnapshot | None:
        """The snapshot held for ``session``, no longer held."""
        key = _snapshot_key(session)
        entry = self._entries.get(key)
        if not isinstance(entry, SessionSnapshot):
            return None
        self._drop(key)
        return entry

    def sweep(self, now: float) -> None:
        """Drop the snapshots nobody restored before they expired (their sessions ended whole)."""
        for key in [k for k, e in self._entries.items() if isinstance(e, SessionSnapshot) and e.expires_at < now]:
            self._drop(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def filter(self) -> PrefixFilter:
        """Every held block hash, as the compact filter the node advertises to the tracker."""
        if self._filter is None:
            self._filter = PrefixFilter.of(self._where)
        return self._filter

    def describe(self) -> dict[str, int]:
        s = self.stats
        return {
            "entries": len(self),
            "snapshots": len(self._entries) - len(self),
            "bytes": self.used,
            "budget_bytes": self.budget_bytes,
            "blocks": len(self._where),
            "hits": s.hits,
            "misses": s.misses,
            "reused_positions": s.reused_positions,
            "stored": s.stored,
            "evicted": s.evicted,
        }

    def _make_room(self, nbytes: int) -> None:
        while self.used + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.used -= entry.nbytes
        if not isinstance(entry, CachedPrefix):
            return
        for h in entry.hashes:
            if self._where.get(h) == key:
                del self._where[h]
        # a hash this entry shared with another (a common system prompt) now points at that one
        for other_key, other in self._entries.items():
            if isinstance(other, CachedPrefix):
                for h in other.hashes:
                    self._where.setdefault(h, other_key)
        self._filter = None


def _disagree(a: CachedPrefix, b: CachedPrefix) -> bool:
    """Whether two entries hold a common block (a common prefix) with different ledger digests: one
    of them was computed from other inputs than its hashes say (a member that named the wrong blocks)."""
    for i, (x, y) in enumerate(zip(a.hashes, b.hashes, strict=False)):
        if x != y:
            return False
        if a.inputs[i] != b.inputs[i] or a.outputs[i : i + 1] != b.outputs[i : i + 1]:
            return True
    return False


def _snapshot_key(session: str) -> bytes:
    return b"snapshot:" + session.encode()
