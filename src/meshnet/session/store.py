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

__all__ = ["Session", "SessionStore", "StoreLimits"]

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

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self, sid: SessionId, *, state: S | None = None, position: int = 0) -> Session[S]:
        """Create a session (or adopt a restored ``state`` already at ``position``)."""
        with self._lock:
            self._expire_locked()
            if sid in self._sessions:
                raise Conflict(f"session {sid} already exists on this shard")
            if len(self._sessions) >= self.limits.max_sessions:
                raise StoreFull(
                    f"this shard holds its maximum of {self.limits.max_sessions} sessions; retry later",
                    retry_after_s=5,
                )
            need = self.limits.bytes_at(position)
            if self._bytes_locked() + need > self.limits.budget_bytes:
                raise StoreFull(self._full_message(need), retry_after_s=5)
            now = self._clock()
            created = state if state is not None else self._new_state(sid)
            session = Session(sid, created, position=position, created_at=now, last_used=now)
            self._sessions[sid] = session
            self._ended.pop(sid, None)
            return session

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
            extra = self.limits.bytes_per_token * n
            if self._bytes_locked() + extra > self.limits.budget_bytes:
                raise StoreFull(self._full_message(extra), retry_after_s=5)
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
            extra = self.limits.bytes_per_token * position
            if self._bytes_locked() + extra > self.limits.budget_bytes:
                raise StoreFull(self._full_message(extra), retry_after_s=5)
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
        with self._lock:
            return self._bytes_locked()

    def free_bytes(self) -> int:
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

    def _bytes_locked(self) -> int:
        return sum(self.limits.bytes_at(s.position) for s in self._sessions.values())

    def _full_message(self, need: int) -> str:
        used = self._bytes_locked()
        return (
            f"KV store full: {used} of {self.limits.budget_bytes} bytes in use by {len(self._sessions)} "
            f"sessions, {need} more needed; retry later or close sessions"
        )

    def _end_locked(self, session: Session[S], reason: str) -> None:
        del self._sessions[session.session_id]
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
