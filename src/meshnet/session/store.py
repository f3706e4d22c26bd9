"""``SessionStore``: the one owner of every session's KV/state on a shard.

Ownership: a backend creates the state objects (a llama.cpp ``seq_id``, a transformers cache)
but never keeps them anywhere else; the store holds them, accounts their bytes, expires idle
ones and frees them through the backend's hooks.

Concurrency: one lock guards the table; a session being computed is marked busy, so a second
concurrent call on it fails with ``SessionBusy`` instead of interleaving KV writes. Calls on
*different* sessions may run concurrently as far as the store is concerned (a backend may still
serialize its compute).

Every check runs *before* compute, and a failed compute rolls the state back to where it was:
rejecting a request never changes a session.

One budget: besides live sessions the store holds *parked* states (``park``): the KV of finished
sessions a node keeps for reuse (its prefix cache, ``node.prefix_cache``), still in the backend's
own memory (a llama.cpp sequence's preallocated cells, a transformers cache). Parked states count
against the same sessions and bytes as live ones, and yield to them: a session that needs room
(``open``, ``use``, ``adopt``) evicts the least recently used unpinned parked states first, each
handed to ``on_evict`` with what ``demote`` made of it (host bytes to keep elsewhere, or None).
Only a store full of *live* sessions refuses a new one (``StoreFull``, with Retry-After).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshnet.errors import (
    Conflict,
    ContextOverflow,
    PositionMismatch,
    SessionBusy,
    SessionGone,
    SessionNotFound,
    StoreFull,
)
from meshnet.ids import SessionId

__all__ = ["Parked", "Session", "SessionStore", "StoreLimits"]

S = TypeVar("S")

# How many ended session ids to remember, so a late call gets 410 with the reason, not 404.
_REMEMBER_ENDED = 4096


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """``bytes_per_token`` and ``fixed_bytes`` describe one session's state on this shard."""

    bytes_per_token: int
    fixed_bytes: int = 0
    budget_bytes: int = 1 << 30
    max_sessions: int = 64
    max_positions: int = 131072
    idle_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.fixed_bytes < 0:
            raise ValueError("state sizes are never negative")
        if self.max_sessions < 1 or self.budget_bytes < 1 or self.max_positions < 1:
            raise ValueError("a store holds at least one session, one byte and one position")
        if self.idle_ttl_s <= 0:
            raise ValueError("idle_ttl_s must be positive")

    def bytes_at(self, positions: int) -> int:
        return self.fixed_bytes + self.bytes_per_token * positions


@dataclass
class Session(Generic[S]):
    session_id: SessionId
    state: S
    position: int = 0  # the next absolute position this session expects
    positions_processed: int = 0  # every position ever computed for it (recompute shows up here)
    created_at: float = 0.0
    last_used: float = 0.0
    busy: bool = False
    steps: int = field(default=0)
    # What the shard's owner keeps beside the KV (a node: its route binding and seam log,
    # ``node.session.NodeSession``), so a session is one record that ends as one.
    attached: object = None


@dataclass(eq=False)
class Parked(Generic[S]):
    """A finished session's state kept in the store at ``position`` positions (``SessionStore.park``).
    ``state`` is None once it is evicted or released; ``pins`` > 0 while someone copies from it."""

    state: S | None
    position: int
    pins: int = 0
    doomed: bool = False  # released while pinned: freed when the last pin goes

    @property
    def held(self) -> bool:
        return self.state is not None


class SessionStore(Generic[S]):
    def __init__(
        self,
        limits: StoreLimits,
        *,
        new_state: Callable[[SessionId], S],
        free_state: Callable[[S], None],
        truncate_state: Callable[[S, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._new_state = new_state
        self._free_state = free_state
        self._truncate_state = truncate_state
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[SessionId, Session[S]] = {}
        self._ended: collections.OrderedDict[SessionId, str] = collections.OrderedDict()
        # Called (under the store's lock) for every session that ends, however it ends: closed,
        # expired, or the shard shutting down. It must not call back into the store.
        self.on_end: Callable[[Session[S]], None] | None = None
        self._parked: collections.OrderedDict[int, Parked[S]] = collections.OrderedDict()  # LRU first
        # Eviction of a parked state (under the store's lock, from any thread; neither may call back
        # into the store): ``demote`` may turn it into host bytes first (None: it is dropped), and
        # ``on_evict`` learns of it with those bytes.
        self.demote: Callable[[S, int], bytes | None] | None = None
        self.on_evict: Callable[[Parked[S], bytes | None], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self, sid: SessionId, *, state: S | None = None, position: int = 0) -> Session[S]:
        """Create a session (or adopt a restored ``state`` already at ``position``)."""
        with self._lock:
            return self._open_locked(sid, state, position)

    def close(self, sid: SessionId, reason: str = "closed") -> None:
        with self._lock:
            session = self._lookup_locked(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} is computing; close it after the call returns")
            self._end_locked(session, reason)

    def expire_idle(self) -> list[SessionId]:
        with self._lock:
            return self._expire_locked()

    def close_all(self) -> None:
        with self._lock:
            for session in list(self._sessions.values()):
                self._end_locked(session, "the shard shut down")
            for parked in list(self._parked.values()):
                self._release_locked(parked)

    # -- parked states -----------------------------------------------------------------------
    def park(self, sid: SessionId, position: int) -> Parked[S]:
        """End session ``sid`` (as ``close`` does) but keep its state, cut back to its first
        ``position`` positions, as a ``Parked`` state. If the backend cannot cut it back, the
        session is as it was."""
        with self._lock:
            session = self._lookup_locked(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} is computing; park it after the call returns")
            if not 0 < position <= session.position:
                raise PositionMismatch(f"session {sid} is at position {session.position}; cannot keep {position}")
            session.busy = True
        try:
            if position < session.position:
                self._truncate_state(session.state, position)
        except BaseException:
            with self._lock:
                session.busy = False
            raise
        with self._lock:
            session.busy = False
            session.position = position
            self._end_locked(session, "closed", keep=True)
            parked = Parked(session.state, position)
            self._parked[id(parked)] = parked
            return parked

    def park_new(self, create: Callable[[], S], position: int) -> Parked[S]:
        """A parked state of ``position`` positions made by ``create`` (a snapshot loaded for later),
        in room parked states yield and live sessions never do (``StoreFull`` if they fill the store)."""
        with self._lock:
            self._room_locked(1, self.limits.bytes_at(position))
            parked = Parked(create(), position)
            self._parked[id(parked)] = parked
            return parked

    def open_parked(self, sid: SessionId, parked: Parked[S]) -> Session[S]:
        """Open session ``sid`` on a parked state itself (no copy): it is parked no more. ``SessionGone``
        if it was evicted or is being copied; ``StoreFull`` (and it stays parked) if there is no room."""
        with self._lock:
            if self._parked.get(id(parked)) is not parked or parked.pins or parked.doomed or parked.state is None:
                raise SessionGone("the parked state was evicted for a live session (or is in use)")
            del self._parked[id(parked)]  # no longer counted as parked: it is the new session's room
            try:
                session = self._open_locked(sid, parked.state, parked.position)
            except BaseException:
                self._parked[id(parked)] = parked
                raise
            parked.state = None
            return session

    def make_room(self, states: int = 1, nbytes: int = 0) -> None:
        """Evict parked states until ``states`` more states and ``nbytes`` more bytes fit (before a
        backend creates a state outside ``open``, e.g. to restore a snapshot); ``StoreFull`` if
        live sessions fill the store."""
        with self._lock:
            self._room_locked(states, nbytes)

    def release(self, parked: Parked[S]) -> None:
        """Free a parked state (its owner no longer wants it); nothing if it is gone already."""
        with self._lock:
            self._release_locked(parked)

    @contextlib.contextmanager
    def pinned(self, parked: Parked[S]) -> Iterator[S]:
        """Hold a parked state still (no eviction) while copying from it; it becomes the most
        recently used. Raises ``SessionGone`` if it was evicted or released meanwhile."""
        with self._lock:
            if parked.state is None or parked.doomed or self._parked.get(id(parked)) is not parked:
                raise SessionGone("the parked state was evicted for a live session (or is not this shard's)")
            parked.pins += 1
            self._parked.move_to_end(id(parked))
            state = parked.state
        try:
            yield state
        finally:
            with self._lock:
                parked.pins -= 1
                if not parked.pins and parked.doomed:
                    self._release_locked(parked)

    def parked_bytes(self) -> int:
        with self._lock:
            return sum(self.limits.bytes_at(p.position) for p in self._parked.values())

    def parked_count(self) -> int:
        with self._lock:
            return len(self._parked)

    # -- compute -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, sid: SessionId, start: int, n: int) -> Iterator[Session[S]]:
        """Reserve ``n`` new positions from ``start`` for one compute call.

        Raises before compute if the session is unknown, ended, busy, not at ``start``, or the
        positions do not fit. On success the session advances by ``n``; if the body raises,
        the state is truncated back to ``start`` and the position is unchanged.
        """
        with self._lock:
            session = self._lookup_locked(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} is already computing; send one request at a time")
            if start != session.position:
                raise PositionMismatch(
                    f"session {sid} expects position {session.position}, got {start}"
                    + (" (a rewind)" if start < session.position else " (a gap)")
                )
            end = start + n
            if end > self.limits.max_positions:
                raise ContextOverflow(
                    f"session {sid} would reach {end} positions but a session's context on this shard is "
                    f"capped at {self.limits.max_positions}"
                )
            self._room_locked(0, self.limits.bytes_per_token * n)
            session.busy = True
        ok = False
        try:
            yield session
            ok = True
        finally:
            if not ok:
                self._truncate_state(session.state, start)
            with self._lock:
                session.busy = False
                session.last_used = self._clock()
                if ok:
                    session.position = end
                    session.positions_processed += n
                    session.steps += 1

    def adopt(self, sid: SessionId, position: int, swap: Callable[[S], S]) -> None:
        """Give a fresh session (position 0) a state already holding ``position`` positions: ``swap``
        takes its state and returns the new one (a prefix cache hit). Checked first like ``use``;
        if ``swap`` raises, the session is as it was."""
        with self._lock:
            session = self._lookup_locked(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} is computing; it adopts cached state only when fresh")
            if session.position != 0:
                raise PositionMismatch(
                    f"session {sid} is at position {session.position}; only a fresh one adopts state"
                )
            if position > self.limits.max_positions:
                raise ContextOverflow(
                    f"{position} cached positions exceed a session's cap of {self.limits.max_positions} on this shard"
                )
            self._room_locked(0, self.limits.bytes_per_token * position)
            session.busy = True
        new: S | None = None
        try:
            new = swap(session.state)
        finally:
            with self._lock:
                session.busy = False
                session.last_used = self._clock()
                if new is not None:
                    session.state, session.position = new, position

    def rewind(self, sid: SessionId, position: int) -> None:
        """Drop positions ``>= position`` (route repair resends a step a downstream hop may already hold)."""
        with self._lock:
            session = self._lookup_locked(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} is computing; rewind it after the call returns")
            if not 0 <= position <= session.position:
                raise PositionMismatch(f"session {sid} is at position {session.position}; cannot rewind to {position}")
            if position == session.position:
                return
            session.busy = True
        done = False
        try:
            self._truncate_state(session.state, position)
            done = True
        finally:
            with self._lock:
                session.busy = False
                if done:
                    session.position = position
                    session.last_used = self._clock()

    # -- reading -----------------------------------------------------------------------------
    def get(self, sid: SessionId) -> Session[S]:
        with self._lock:
            return self._lookup_locked(sid)

    def session_bytes(self, sid: SessionId) -> int:
        return self.limits.bytes_at(self.get(sid).position)

    def bytes_used(self) -> int:
        """Bytes of live sessions (parked states yield to them and are not counted)."""
        with self._lock:
            return self._live_bytes_locked()

    def free_bytes(self) -> int:
        """Bytes a new session may still take (parked states included: they yield)."""
        return self.limits.budget_bytes - self.bytes_used()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def ids(self) -> list[SessionId]:
        with self._lock:
            return list(self._sessions)

    # -- internals (lock held) ---------------------------------------------------------------
    def _lookup_locked(self, sid: SessionId) -> Session[S]:
        session = self._sessions.get(sid)
        if session is not None:
            return session
        reason = self._ended.get(sid)
        if reason is not None:
            raise SessionGone(f"session {sid} is gone: {reason}")
        raise SessionNotFound(f"no session {sid} on this shard (never opened here, or the node restarted)")

    def _live_bytes_locked(self) -> int:
        return sum(self.limits.bytes_at(s.position) for s in self._sessions.values())

    def _room_locked(self, states: int, nbytes: int) -> None:
        """Make room for ``states`` more states and ``nbytes`` more bytes, evicting parked states
        (least recently used first, pinned ones never); ``StoreFull`` if live sessions fill it."""
        limits = self.limits
        live = self._live_bytes_locked()
        if len(self._sessions) + states > limits.max_sessions:
            raise StoreFull(f"this shard holds its maximum of {limits.max_sessions} sessions; retry later",
                            retry_after_s=5)  # fmt: skip
        if live + nbytes > limits.budget_bytes:
            raise StoreFull(
                f"KV store full: {live} of {limits.budget_bytes} bytes in use by {len(self._sessions)} "
                f"sessions, {nbytes} more needed; retry later or close sessions",
                retry_after_s=5,
            )

        def short() -> bool:
            parked = sum(limits.bytes_at(p.position) for p in self._parked.values())
            return (len(self._sessions) + len(self._parked) + states > limits.max_sessions
                    or live + parked + nbytes > limits.budget_bytes)  # fmt: skip

        while short():
            victim = next((p for p in self._parked.values() if not p.pins), None)
            if victim is None:
                raise StoreFull("this shard's KV is held by sessions and by cached state being copied; retry later",
                                retry_after_s=1)  # fmt: skip
            self._evict_locked(victim)

    def _evict_locked(self, parked: Parked[S]) -> None:
        assert parked.state is not None
        blob = None
        if self.demote is not None and self.on_evict is not None:
            try:
                blob = self.demote(parked.state, parked.position)
            except Exception:  # a state that cannot be written out is dropped, as without demote
                blob = None
        self._release_locked(parked)
        if self.on_evict is not None:
            self.on_evict(parked, blob)

    def _release_locked(self, parked: Parked[S]) -> None:
        if parked.pins:
            parked.doomed = True
            return
        if self._parked.pop(id(parked), None) is None or parked.state is None:
            return
        state, parked.state = parked.state, None
        self._free_state(state)

    def _open_locked(self, sid: SessionId, state: S | None, position: int) -> Session[S]:
        self._expire_locked()
        if sid in self._sessions:
            raise Conflict(f"session {sid} already exists on this shard")
        self._room_locked(1, self.limits.bytes_at(position))  # a restored state is one more too
        now = self._clock()
        created = state if state is not None else self._new_state(sid)
        session = Session(sid, created, position=position, created_at=now, last_used=now)
        self._sessions[sid] = session
        self._ended.pop(sid, None)
        return session

    def _end_locked(self, session: Session[S], reason: str, *, keep: bool = False) -> None:
        """End ``session``; its state is freed unless the caller ``keep``s it (``park``)."""
        del self._sessions[session.session_id]
        if not keep:
            self._free_state(session.state)
        if self.on_end is not None:
            self.on_end(session)
        self._ended[session.session_id] = reason
        while len(self._ended) > _REMEMBER_ENDED:
            self._ended.popitem(last=False)

    def _expire_locked(self) -> list[SessionId]:
        cutoff = self._clock() - self.limits.idle_ttl_s
        stale = [s for s in self._sessions.values() if not s.busy and s.last_used < cutoff]
        for session in stale:
            self._end_locked(session, f"expired after {self.limits.idle_ttl_s:g}s idle")
        return [s.session_id for s in stale]
