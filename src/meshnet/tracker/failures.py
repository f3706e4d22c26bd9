"""Which failure reports count: once per (session, node), and once a window per (member, node).

A gateway reports a hop that failed (``POST /v1/nodes/{id}/failures`` during prefill, ``POST
/v1/sessions/{id}/repair`` during decode). A failure that counts lowers the node's reliability
and lets the tracker suspend it; so a member that could make failures count at will could keep any
node off the routes. Two rules bound it (docs/tracker.md, "Failure handling"):

- a failure counts **once per session and node**: a report and a repair of the same failure, or a
  repair retried after a 503, count once;
- one member's failures of one node count **at most once per** ``MEMBER_FAILURE_WINDOW_S``: a
  gateway that opens session after session to report the same node suspends it for one heartbeat a
  minute at most. A dead node needs no second word (it sends no heartbeat to come back).

Pure bookkeeping over a clock the caller passes in, bounded; not thread-safe (the event loop only).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["MEMBER_FAILURE_WINDOW_S", "FailureLedger"]

MEMBER_FAILURE_WINDOW_S = 60.0
_KEPT = 100_000  # (session, node) and (member, node) pairs remembered; the oldest go first


class FailureLedger:
    def __init__(self, window_s: float = MEMBER_FAILURE_WINDOW_S) -> None:
        self.window_s = window_s
        self._sessions: OrderedDict[tuple[str, str], bool] = OrderedDict()  # -> whether it counted
        self._members: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> when it last counted

    def count(self, session_id: str, node_id: str, member_id: str | None, now: float) -> tuple[bool, bool]:
        """A failure of ``node_id`` on ``session_id``'s route, reported by ``member_id`` (``None``: no
        member's window applies): whether this is the first word of it, and whether it counts (decided
        at the first word, and the same for every later one)."""
        key = (session_id, node_id)
        counts = self._sessions.get(key)
        if counts is not None:
            return False, counts
        counts = True
        if member_id is not None:
            pair = (member_id, node_id)
            last = self._members.pop(pair, None)
            counts = last is None or now - last >= self.window_s
            self._members[pair] = now if counts or last is None else last
            _trim(self._members)
        self._sessions[key] = counts
        _trim(self._sessions)
        return True, counts


def _trim(held: OrderedDict[tuple[str, str], bool] | OrderedDict[tuple[str, str], float]) -> None:
    while len(held) > _KEPT:
        held.popitem(last=False)
