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

Where the KV lives: first in the shard's own memory, *parked* (``SessionStore.park``): the
finished session's llama.cpp sequence (or transformers cache) stays as it is, cut back to its
whole blocks, and costs nothing a live session would not otherwise have — live sessions, cached
prefixes and standby snapshots share the shard's one KV budget, and live sessions win it: a
session that needs room evicts the least recently used parked entry, whose KV the store writes
out (``SessionStore.demote``) and hands back here (``evicted``), to be kept in host memory within
``budget_bytes`` (``--prefix-cache-mb``) — or dropped when it does not fit there either.

Bounded: host-memory entries (their seam logs and digests, the KV of demoted ones) live within
``budget_bytes``, least recently used evicted first; an entry whose blocks another entry extends is
dropped (the longer one serves both). The same budget and the same LRU order hold the KV snapshots
this node keeps as another hop's standby (``node.snapshots``, ``hold`` / ``take``). The node uses
the cache from its event loop only; ``evicted`` alone may be called from any thread.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshnet.node.snapshots import SessionSnapshot
from meshnet.protocol.prefix import PrefixFilter
from meshnet.session.store import Parked

__all__ = ["CachedPrefix", "PrefixCache"]


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    block: int
    hashes: tuple[bytes, ...]  # of its blocks, in order: it holds ``len(hashes) * block`` positions
    snapshot: bytes  # ``ShardBase.snapshot`` of exactly those positions (empty while parked)
    inputs: tuple[bytes, ...]  # the hop's ledger digests after each block (protocol.ledger)
    outputs: tuple[bytes, ...]  # (empty on a tail)
    log: bytes | None  # the seam log of those positions (None: the session kept none)
    log_dtype: str = ""
    ids_log: bytes = b""  # token ids beside it, when they travelled
    parked: Parked[Any] | None = None  # the KV still in the shard (``ShardBase.park``), else ``snapshot``

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
    demoted: int = 0  # parked entries a live session took the room of, kept in host memory


class PrefixCache:
    def __init__(self, budget_bytes: int, release: Callable[[Parked[Any]], None] | None = None) -> None:
        """``release`` frees a parked entry's KV in the shard (``ShardBase.release``) when the cache drops it."""
        if budget_bytes < 0:
            raise ValueError("a prefix cache budget is never negative")
        self.budget_bytes = budget_bytes
        self._release = release
        # (parked, its KV written out or None) from SessionStore.on_evict, any thread; applied by _settle
        self._evictions: collections.deque[tuple[Parked[Any], bytes | None]] = collections.deque()
        # prefix entries by their last block hash, standby snapshots by _snapshot_key; LRU first
        self._entries: collections.OrderedDict[bytes, CachedPrefix | SessionSnapshot] = collections.OrderedDict()
        self._where: dict[bytes, bytes] = {}  # block hash -> key of an entry holding it
        self._filter: PrefixFilter | None = None
        self.used = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        """Prefix entries held (snapshots not counted)."""
        self._settle()
        return sum(isinstance(e, CachedPrefix) for e in self._entries.values())

    def evicted(self, parked: Parked[Any], blob: bytes | None) -> None:
        """``SessionStore.on_evict``: a live session took the room of a parked entry; ``blob`` is its KV
        written out (None: lost). Any thread; applied on the cache's next use."""
        self._evictions.append((parked, blob))

    def _settle(self) -> None:
        """Apply evictions: a demoted entry moves to host memory if it fits there, else it is dropped."""
        while self._evictions:
            parked, blob = self._evictions.popleft()
            key = next((k for k, e in self._entries.items() if e.parked is parked), None)
            if key is None:  # dropped meanwhile
                continue
            entry = self._entries[key]
            self._drop(key, let_go=False)  # the store freed it already
            self.stats.evicted += 1
            if blob is None:
                continue
            if isinstance(entry, CachedPrefix):
                demoted_prefix = dataclasses.replace(entry, snapshot=blob, parked=None)
                if demoted_prefix.nbytes <= self.budget_bytes:
                    self._store(demoted_prefix)
                    self.stats.demoted += 1
            elif self._hold(dataclasses.replace(entry, kv=blob, parked=None)):
                self.stats.demoted += 1

    def lookup(self, block: int, hashes: tuple[bytes, ...], limit: int) -> tuple[CachedPrefix, int] | None:
        """The entry holding the most leading blocks of ``hashes`` (at most ``limit``), and how many."""
        self._settle()
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
        self._settle()
        key = self._where.get(hashes[-1]) if hashes else None
        if key is None:
            return False
        self._entries.move_to_end(key)
        return True

    def agrees(self, hashes: tuple[bytes, ...], inputs: tuple[bytes, ...], outputs: tuple[bytes, ...]) -> bool:
        """Whether an entry holds all of ``hashes`` with these ledger digests after each block (it
        becomes the most recently used): a session that computed the blocks itself need not keep them
        again. A held entry whose digests differ is a bad one (``add`` replaces it)."""
        self._settle()
        key = self._where.get(hashes[-1]) if hashes else None
        entry = None if key is None else self._entries.get(key)
        n = len(hashes)
        if not isinstance(entry, CachedPrefix) or entry.inputs[:n] != inputs or entry.outputs[:n] != outputs:
            return False
        return self.touch(hashes)

    def add(self, entry: CachedPrefix) -> bool:
        """Keep ``entry`` (evicting the least recently used ones to fit); False if it cannot fit at all.
        A parked entry not kept is released."""
        self._settle()
        if not entry.hashes or entry.nbytes > self.budget_bytes:
            self._let_go(entry)
            return False
        for k, held in list(self._entries.items()):  # what was computed from other inputs is not these blocks
            if isinstance(held, CachedPrefix) and _disagree(held, entry):
                self._drop(k)
        key = entry.hashes[-1]
        if self._where.get(key, key) != key:  # a longer entry already holds all of it
            self._let_go(entry)
            return self.touch(entry.hashes)
        self._store(entry)
        self.stats.stored += 1
        return True

    def _store(self, entry: CachedPrefix) -> None:
        key = entry.hashes[-1]
        covered = [k for k, e in self._entries.items() if k == key or k in entry.hashes]
        for k in covered:  # entries this one extends (or replaces): it serves their prefixes too
            self._drop(k)
        self._make_room(entry.nbytes)
        self._entries[key] = entry
        self.used += entry.nbytes
        for h in entry.hashes:
            self._where[h] = key
        self._filter = None

    def _let_go(self, entry: CachedPrefix | SessionSnapshot) -> None:
        if entry.parked is not None and self._release is not None:
            self._release(entry.parked)

    def hold(self, snapshot: SessionSnapshot) -> bool:
        """Keep a standby snapshot (replacing an older one of its session); False if it cannot fit
        (a parked one is then released)."""
        self._settle()
        return self._hold(snapshot)

    def _hold(self, snapshot: SessionSnapshot) -> bool:
        key = _snapshot_key(snapshot.session)
        if key in self._entries:
            self._drop(key)
        if snapshot.nbytes > self.budget_bytes:
            self._let_go(snapshot)
            return False
        self._make_room(snapshot.nbytes)
        self._entries[key] = snapshot
        self.used += snapshot.nbytes
        return True

    def take(self, session: str) -> SessionSnapshot | None:
        """The snapshot held for ``session``, no longer held (a parked one is now the caller's to
        restore or release)."""
        self._settle()
        key = _snapshot_key(session)
        entry = self._entries.get(key)
        if not isinstance(entry, SessionSnapshot):
            return None
        self._drop(key, let_go=False)
        return entry

    def discard(self, session: str) -> None:
        """Forget the snapshot held for ``session``, if any."""
        self._settle()
        if isinstance(self._entries.get(key := _snapshot_key(session)), SessionSnapshot):
            self._drop(key)

    def sweep(self, now: float) -> None:
        """Drop the snapshots nobody restored before they expired (their sessions ended whole)."""
        self._settle()
        for key in [k for k, e in self._entries.items() if isinstance(e, SessionSnapshot) and e.expires_at < now]:
            self._drop(key)

    def clear(self) -> None:
        self._settle()
        for key in list(self._entries):
            self._drop(key)

    def filter(self) -> PrefixFilter:
        """Every held block hash, as the compact filter the node advertises to the tracker."""
        self._settle()
        if self._filter is None:
            self._filter = PrefixFilter.of(self._where)
        return self._filter

    def describe(self) -> dict[str, int]:
        self._settle()
        s = self.stats
        parked = [e for e in self._entries.values() if e.parked is not None]
        return {
            "entries": len(self),
            # of the entries and snapshots, those with their KV still in the shard's own memory
            "parked": sum(isinstance(e, CachedPrefix) for e in parked),
            "parked_snapshots": sum(isinstance(e, SessionSnapshot) for e in parked),
            "parked_positions": sum(e.parked.position for e in parked if e.parked is not None),
            "snapshots": len(self._entries) - len(self),
            "bytes": self.used,
            "budget_bytes": self.budget_bytes,
            "blocks": len(self._where),
            "hits": s.hits,
            "misses": s.misses,
            "reused_positions": s.reused_positions,
            "stored": s.stored,
            "evicted": s.evicted,
            "demoted": s.demoted,
        }

    def _make_room(self, nbytes: int) -> None:
        while self.used + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: bytes, *, let_go: bool = True) -> None:
        entry = self._entries.pop(key)
        self.used -= entry.nbytes
        if let_go:
            self._let_go(entry)
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
