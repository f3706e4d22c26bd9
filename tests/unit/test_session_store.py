"""SessionStore: checks before compute, rollback on failure, byte budget, TTL, ended-session reasons."""

from __future__ import annotations

import pytest

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
from meshnet.session.store import SessionStore, StoreLimits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**limits: float) -> tuple[SessionStore[list[int]], Clock, list[str]]:
    log: list[str] = []
    clock = Clock()

    def truncate(state: list[int], position: int) -> None:
        log.append(f"truncate {position}")
        del state[position:]

    store: SessionStore[list[int]] = SessionStore(
        StoreLimits(**{"bytes_per_token": 10, "budget_bytes": 1000, "max_sessions": 3, "idle_ttl_s": 60, **limits}),
        new_state=lambda sid: [],
        free_state=lambda state: log.append(f"free {len(state)}"),
        truncate_state=truncate,
        clock=clock,
    )
    return store, clock, log


def advance(store: SessionStore[list[int]], sid: SessionId, start: int, n: int) -> None:
    with store.use(sid, start, n) as session:
        session.state.extend(range(start, start + n))


def test_positions_advance_and_are_counted() -> None:
    store, _, _ = make()
    sid = SessionId("a")
    store.open(sid)
    advance(store, sid, 0, 5)
    advance(store, sid, 5, 1)
    session = store.get(sid)
    assert (session.position, session.positions_processed, session.steps) == (6, 6, 2)
    assert store.session_bytes(sid) == 60 and store.bytes_used() == 60 and store.free_bytes() == 940


def test_gap_rewind_and_busy_are_refused_before_compute() -> None:
    store, _, log = make()
    sid = SessionId("a")
    store.open(sid)
    advance(store, sid, 0, 3)
    with pytest.raises(PositionMismatch, match="expects position 3, got 5 \\(a gap\\)"):
        advance(store, sid, 5, 1)
    with pytest.raises(PositionMismatch, match="rewind"):
        advance(store, sid, 1, 1)
    with store.use(sid, 3, 1) as session:
        with pytest.raises(SessionBusy):
            advance(store, sid, 3, 1)
        with pytest.raises(SessionBusy):
            store.close(sid)
        session.state.append(3)
    assert store.get(sid).position == 4 and store.get(sid).state == [0, 1, 2, 3]
    assert log == []


def test_a_failed_compute_rolls_back() -> None:
    store, _, log = make()
    sid = SessionId("a")
    store.open(sid)
    advance(store, sid, 0, 2)
    with pytest.raises(RuntimeError), store.use(sid, 2, 3) as session:
        session.state.extend([2, 3])
        raise RuntimeError("backend died")
    assert store.get(sid).position == 2 and store.get(sid).state == [0, 1] and log == ["truncate 2"]
    advance(store, sid, 2, 1)  # and it continues
    assert store.get(sid).position == 3


def test_budget_sessions_and_context_cap() -> None:
    store, _, _ = make(max_positions=60)
    a, b = SessionId("a"), SessionId("b")
    store.open(a)
    store.open(b)
    advance(store, a, 0, 50)
    with pytest.raises(ContextOverflow, match="capped at 60"):
        advance(store, a, 50, 11)
    advance(store, b, 0, 45)
    with pytest.raises(StoreFull, match="KV store full") as full:
        advance(store, b, 45, 10)  # 950 + 100 > 1000
    assert full.value.retry_after_s > 0
    assert store.get(b).position == 45
    store.open(SessionId("c"))
    with pytest.raises(StoreFull, match="maximum of 3 sessions"):
        store.open(SessionId("d"))
    with pytest.raises(Conflict):
        store.open(a)


def test_ended_sessions_say_why_and_unknown_ones_are_404() -> None:
    store, clock, log = make()
    a, b = SessionId("a"), SessionId("b")
    store.open(a)
    store.open(b)
    advance(store, b, 0, 4)
    store.close(a)
    with pytest.raises(SessionGone, match="closed"):
        store.get(a)
    clock.now = 61
    assert store.expire_idle() == [b]
    assert log == ["free 0", "free 4"]
    with pytest.raises(SessionGone, match="expired after 60s idle"):
        advance(store, b, 4, 1)
    with pytest.raises(SessionNotFound, match="node restarted"):
        store.get(SessionId("zzz"))
    assert len(store) == 0 and store.bytes_used() == 0
    store.open(a)  # an id may be reused after it ended
    assert store.get(a).position == 0


def test_a_busy_session_is_never_expired_and_restore_adopts_state() -> None:
    store, clock, _ = make()
    a = SessionId("a")
    store.open(a)
    with store.use(a, 0, 1) as session:
        clock.now = 1000
        assert store.expire_idle() == []
        session.state.append(0)
    restored = store.open(SessionId("r"), state=[0, 1, 2], position=3)
    assert restored.position == 3 and store.session_bytes(SessionId("r")) == 30


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        StoreLimits(bytes_per_token=-1)
    with pytest.raises(ValueError):
        StoreLimits(bytes_per_token=1, max_sessions=0)
    with pytest.raises(ValueError):
        StoreLimits(bytes_per_token=1, idle_ttl_s=0)
    assert StoreLimits(bytes_per_token=4, fixed_bytes=100).bytes_at(10) == 140


def test_rewind_drops_the_newest_positions_and_frees_their_bytes() -> None:
    store, _, log = make()
    sid = SessionId("a")
    store.open(sid)
    advance(store, sid, 0, 6)
    store.rewind(sid, 6)  # nothing to drop: a no-op
    assert log == []
    store.rewind(sid, 4)
    session = store.get(sid)
    assert (session.position, session.state, log) == (4, [0, 1, 2, 3], ["truncate 4"])
    assert store.session_bytes(sid) == 40
    with pytest.raises(PositionMismatch, match="cannot rewind to 5"):
        store.rewind(sid, 5)  # forward is not a rewind
    advance(store, sid, 4, 1)  # and it continues from there
    assert store.get(sid).position == 5


def test_a_failed_rewind_leaves_the_session_where_it_was() -> None:
    def refuse(state: list[int], position: int) -> None:
        raise RuntimeError("this backend cannot rewind")

    store: SessionStore[list[int]] = SessionStore(
        StoreLimits(bytes_per_token=10, budget_bytes=1000, max_sessions=3, idle_ttl_s=60),
        new_state=lambda sid: [],
        free_state=lambda state: None,
        truncate_state=refuse,
    )
    sid = SessionId("a")
    store.open(sid)
    with store.use(sid, 0, 3) as session:
        session.state.extend([0, 1, 2])
    with pytest.raises(RuntimeError):
        store.rewind(sid, 1)
    assert store.get(sid).position == 3 and not store.get(sid).busy


# -- parked states (a node's prefix cache keeps finished sessions' KV in the store) ----------------
def parking(**limits: float) -> tuple[SessionStore[list[int]], list[str], list[tuple[int, bytes | None]]]:
    store, _, log = make(**limits)
    evicted: list[tuple[int, bytes | None]] = []
    store.demote = lambda state, position: bytes(state[:position])
    store.on_evict = lambda parked, blob: evicted.append((parked.position, blob))
    return store, log, evicted


def test_a_parked_state_shares_the_budget_and_yields_to_live_sessions() -> None:
    store, log, evicted = parking(max_sessions=2)
    a = SessionId("a")
    store.open(a)
    advance(store, a, 0, 6)
    parked = store.park(a, 4)  # its session ends, its first 4 positions stay
    assert parked.state == [0, 1, 2, 3] and log == ["truncate 4"]
    with pytest.raises(SessionGone, match="closed"):
        store.get(a)
    assert (len(store), store.parked_count(), store.parked_bytes(), store.bytes_used()) == (0, 1, 40, 0)
    store.open(SessionId("b"))
    assert evicted == []  # one parked and one live state: the store holds two
    store.open(SessionId("c"))  # a live session needs the room: the parked state is written out, then freed
    assert evicted == [(4, bytes([0, 1, 2, 3]))] and not parked.held and log[-1] == "free 4"
    with pytest.raises(StoreFull, match="maximum of 2 sessions") as full:
        store.open(SessionId("d"))  # live sessions are never evicted
    assert full.value.retry_after_s == 5


def test_a_parked_state_being_copied_is_never_evicted_and_a_release_waits_for_the_copy() -> None:
    store, log, evicted = parking(max_sessions=2)
    first, second = SessionId("a"), SessionId("b")
    for sid in (first, second):
        store.open(sid)
        advance(store, sid, 0, 3)
    p1, p2 = store.park(first, 3), store.park(second, 2)
    with store.pinned(p1) as state:  # p1 is now the most recently used, and pinned
        assert state == [0, 1, 2]
        store.open(SessionId("c"))
        assert [e[0] for e in evicted] == [2] and not p2.held  # the other one went
        with pytest.raises(StoreFull, match="being copied"):
            store.open(SessionId("d"))
        store.release(p1)  # its owner dropped it mid-copy: freed once the copy is done
        assert p1.held
    assert not p1.held and log[-1] == "free 3"
    with pytest.raises(SessionGone, match="evicted"), store.pinned(p1):
        pass
    store.open(SessionId("d"))  # the room is back


def test_a_growing_session_evicts_parked_bytes_and_a_failed_park_leaves_the_session() -> None:
    store, log, evicted = parking(budget_bytes=100)
    a, b = SessionId("a"), SessionId("b")
    store.open(a)
    advance(store, a, 0, 6)
    parked = store.park(a, 6)
    assert log == []  # nothing to cut
    store.open(b)
    advance(store, b, 0, 4)  # 40 + 60 parked: still fits
    assert parked.held
    advance(store, b, 4, 1)  # 50 + 60 does not: the parked bytes go
    assert evicted == [(6, bytes(range(6)))] and store.bytes_used() == 50
    with pytest.raises(PositionMismatch):
        store.park(b, 6)  # more than it holds

    def refuse(state: list[int], position: int) -> None:
        raise SessionBusy("cannot cut")

    store._truncate_state = refuse
    with pytest.raises(SessionBusy, match="cannot cut"):
        store.park(b, 2)
    assert store.get(b).position == 5 and not store.get(b).busy and store.parked_count() == 0
    store.close_all()
