"""Who may drive a session on this node, and which sessions ended here (a private swarm).

A route ticket (``protocol.tickets``) is checked when a session opens; this module keeps what
the node learned from it so that every *later* request is checked too, not only the first:

- ``SessionAuthority``: per session, the newest ticket epoch this node verified, the token (the
  node passes it on to its next hop once per epoch, so a hop after a repaired run learns its new
  upstream), and the *drivers*: the member ids whose requests this node serves on the session —
  the gateway that opened it (the ticket's ``owner``) and, past the head, the hop before this
  node on the route. Every hop verb (prefill, decode-step, verify, a ``rewind``, replay, reroute,
  snapshot, ``GET``, ``DELETE``, decode-channel ``STEP`` frames) from anyone else is 403; a
  ticket older than the epoch the node holds is 401 ``route_ticket_superseded``. One exception:
  at the head, the route's tail (``relayer``) may send a plain decode step over the decode
  channel — the step a gateway's ``CREDIT`` let it relay — and nothing else. At the tail, the
  ticket's ``head`` is the only place a relayed step may go.
- ``ClosedSessions``: the sessions that ended here, for longer than any ticket of theirs lives, so
  a ticket replayed after the close cannot open the session again (401 ``route_ticket_closed``);
  only a later repair (a higher epoch, which the tracker signs only for an open session) can.

Who the caller is comes from its member certificate (the node app reads it from the TLS
connection); ``None`` is a caller the transport vouches for (``LocalTransport``, in process).
Pure records and checks: the node service owns the state, on its event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from meshnet.errors import Forbidden, Unauthorized
from meshnet.ids import SessionId
from meshnet.protocol import headers as H
from meshnet.protocol.tickets import CLOCK_SKEW_S, CODE_CLOSED, CODE_EXPIRED, CODE_SUPERSEDED, RouteTicket

__all__ = ["CLOSED_KEEP_S", "CODE_NOT_DRIVER", "ClosedSessions", "SessionAuthority"]

# How long a closed session stays refused: past the life of any ticket the tracker issued before the
# close (it issues 5-minute tickets, and none for a closed session), with room for clock skew.
CLOSED_KEEP_S = 900.0
MAX_CLOSED = 65_536  # closed sessions remembered at once; the oldest go first
CODE_NOT_DRIVER = "session_not_yours"  # 403: a member that neither opened the session nor forwards it


@dataclass(slots=True)
class SessionAuthority:
    """What this node holds of a session's newest verified ticket."""

    epoch: int
    token: str
    drivers: frozenset[str]
    expires_at: float
    sent_epoch: int = -1  # the newest epoch whose ticket went to the next hop
    relayer: str | None = None  # at the head: the route's tail, which may relay plain decode steps
    head: str | None = None  # at the tail: the route's head, the only place it relays steps to

    @classmethod
    def of(cls, ticket: RouteTicket, token: str, node_id: str, opener: str | None) -> SessionAuthority:
        """The authority a session opens with. A ticket that names no owner (an older tracker) binds
        the head to the member that opened it."""
        drivers = ticket.drivers(node_id)
        if not ticket.owner and ticket.index_of(node_id) == 0 and opener is not None:
            drivers = drivers | {opener}
        relayer, head = _relay_ends(ticket, node_id)
        return cls(ticket.epoch, token, drivers, ticket.expires_at, relayer=relayer, head=head)

    def check(self, caller: str | None, sid: SessionId, node_id: str, what: str, *, relay: bool = False) -> None:
        """``caller`` may ``what`` the session here: it is one of its drivers (``None``: in process);
        ``relay``: a plain decode step over the decode channel, which the head takes from the tail too."""
        if caller is None or caller in self.drivers or (relay and caller == self.relayer):
            return
        raise Forbidden(
            f"member {caller!r} may not {what} session {sid} on node {node_id}: only "
            f"{', '.join(sorted(self.drivers)) or 'its route'} drive it here (the gateway that opened it, and the "
            "hop before this one on its ticket's route)",
            param="session",
            code=CODE_NOT_DRIVER,
        )

    def learn(self, ticket: RouteTicket, token: str, node_id: str, *, now: float | None = None) -> bool:
        """Take a ticket of the session that a request carries; True when it is a newer epoch (a
        repair: its drivers replace the old ones). An older epoch is ``Unauthorized``; a newer one
        must be current (it changes who drives the session)."""
        if ticket.epoch < self.epoch:
            raise Unauthorized(
                f"this {ticket.kind} ticket of session {ticket.session_id} is of route epoch {ticket.epoch}, but "
                f"a repair superseded it (this node holds epoch {self.epoch}); send the newest repair ticket",
                param=H.TICKET,
                code=CODE_SUPERSEDED,
            )
        if ticket.epoch == self.epoch:
            return False
        if (time.time() if now is None else now) > ticket.expires_at + CLOCK_SKEW_S:
            raise Unauthorized(
                f"the repair ticket of session {ticket.session_id} (epoch {ticket.epoch}) expired; ask the tracker "
                "for a fresh repair",
                param=H.TICKET,
                code=CODE_EXPIRED,
            )
        self.epoch, self.token, self.drivers = ticket.epoch, token, ticket.drivers(node_id)
        self.relayer, self.head = _relay_ends(ticket, node_id)
        self.expires_at = max(self.expires_at, ticket.expires_at)
        return True

    def onward(self, carried: str | None) -> str | None:
        """The ticket a request this node forwards carries: its own, or this node's newest when the
        next hop has not had this epoch yet (after a repair, a hop past the replaced run learns its
        new upstream from it)."""
        token = carried if carried is not None else (self.token if self.sent_epoch < self.epoch else None)
        if token is not None:
            self.sent_epoch = self.epoch
        return token


def _relay_ends(ticket: RouteTicket, node_id: str) -> tuple[str | None, str | None]:
    """At the head of a route of several hops, its tail's id; at the tail, its head's URL."""
    i, hops = ticket.index_of(node_id), ticket.hops
    if len(hops) < 2:
        return None, None
    return (hops[-1].node_id if i == 0 else None), (hops[0].url if i == len(hops) - 1 else None)


class ClosedSessions:
    """Sessions that ended on this node, refused to every ticket of an epoch they had reached."""

    def __init__(self, keep_s: float = CLOSED_KEEP_S, limit: int = MAX_CLOSED) -> None:
        self.keep_s = keep_s
        self.limit = limit
        self._closed: OrderedDict[str, tuple[int, float]] = OrderedDict()  # sid -> (epoch, until)

    def __len__(self) -> int:
        return len(self._closed)

    def close(self, sid: SessionId, epoch: int, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._closed.pop(sid, None)
        self._closed[sid] = (epoch, now + self.keep_s)
        self._expire(now)

    def check(self, ticket: RouteTicket, *, now: float | None = None) -> None:
        """``Unauthorized`` for a ticket that would open a session closed here at its epoch or later."""
        now = time.time() if now is None else now
        self._expire(now)
        closed = self._closed.get(ticket.session_id)
        if closed is not None and ticket.epoch <= closed[0]:
            raise Unauthorized(
                f"session {ticket.session_id} was closed on this node (at route epoch {closed[0]}); its "
                f"{ticket.kind} ticket of epoch {ticket.epoch} cannot open it again: open a new session",
                param=H.TICKET,
                code=CODE_CLOSED,
            )

    def _expire(self, now: float) -> None:
        # every entry keeps the same time, so the oldest expire first
        while self._closed and (len(self._closed) > self.limit or next(iter(self._closed.values()))[1] < now):
            self._closed.popitem(last=False)
