"""The tracker's placement surface around ``tracker.placement`` (docs/tracker.md, "Placement").

- ``POST /v1/placement``: a node started with ``--layers auto`` sends what it can hold (an
  ``Ask``) and gets the range to serve, *reserved* for it for ``RESERVE_S``: a reservation counts as
  coverage for every other ask, so two nodes joining at the same moment never take the same hole.
  Its registration with those layers ends the reservation.
- Each heartbeat of an auto-placed node repeats its ask (``placement`` in the registration body,
  so a restarted tracker knows it again at once). When layers have been served by nobody for
  ``HOLE_GRACE_S`` (their node left for good: it expired) and this node's layers are all served by
  other live nodes too, the answer says ``move``: the node drains (the tracker routes no new
  session to it), loads the new range and registers with it. One move per model at a time, one per
  node every ``MOVE_COOLDOWN_S``; a move not done within ``MOVE_TTL_S`` lapses. Every move is logged
  and listed in ``GET /v1/nodes`` (``placement``) and ``GET /v1/placement``.

State lives in memory only: nodes re-send their asks, reservations are minutes long.
Not thread-safe: called from the tracker's event loop, with no await between a decision and the
reservation it makes (that is what keeps concurrent asks apart).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import InvalidRequest
from meshnet.httputil import read_body
from meshnet.layers import LayerRange
from meshnet.security.membership import require_node
from meshnet.tracker.placement import (
    UNCOVERED,
    Ask,
    Holder,
    Placement,
    choose_move,
    choose_range,
    coverage,
    holes,
    node_throughput,
    reserved_throughput,
)
from meshnet.tracker.routing import NodeRecord
from meshnet.tracker.sessions import MAX_BODY_BYTES, NodeRegistry, parse_body

__all__ = [
    "HOLE_GRACE_S",
    "MOVE_COOLDOWN_S",
    "MOVE_TTL_S",
    "PLACEMENT_PATH",
    "RESERVE_S",
    "PlacementAdvert",
    "PlacementBook",
    "RoutableNodes",
    "check_advert",
]

PLACEMENT_PATH = "/v1/placement"
RESERVE_S = 900.0  # a fetch of a big range takes minutes; a node that never comes frees its range after this
HOLE_GRACE_S = 10.0  # a hole must outlast this before anyone moves (nodes already expire after 3 missed beats)
MOVE_COOLDOWN_S = 120.0  # a node moves at most once in this long: no flapping between two holes
MOVE_TTL_S = 900.0  # drain (its sessions end), fetch, load, register: or the move lapses
MAX_PLACEMENT_LAYERS = 4096
_MAX_BYTES = 2**50
_Bytes = Annotated[int, Field(ge=0, le=_MAX_BYTES)]
log = logging.getLogger("meshnet.tracker")


class PlacementAdvert(BaseModel):
    """What a node can hold (``tracker.placement.Ask``), as it sends it."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    layer_bytes: list[_Bytes] = Field(min_length=1, max_length=MAX_PLACEMENT_LAYERS)
    budget_bytes: _Bytes
    boundaries: list[Annotated[int, Field(ge=0, le=MAX_PLACEMENT_LAYERS)]] = Field(
        min_length=2, max_length=MAX_PLACEMENT_LAYERS + 1
    )
    head_bytes: _Bytes = 0
    tail_bytes: _Bytes = 0
    base_bytes: _Bytes = 0
    max_layers: int | None = Field(None, ge=1, le=MAX_PLACEMENT_LAYERS)

    def ask(self, total_layers: int) -> Ask:
        return Ask(
            total_layers=total_layers,
            layer_bytes=tuple(self.layer_bytes),
            budget_bytes=self.budget_bytes,
            boundaries=tuple(self.boundaries),
            head_bytes=self.head_bytes,
            tail_bytes=self.tail_bytes,
            base_bytes=self.base_bytes,
            max_layers=self.max_layers,
        )


class PlacementRequest(PlacementAdvert):
    node_id: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=512)
    total_layers: int = Field(ge=1, le=MAX_PLACEMENT_LAYERS)


@dataclass(frozen=True, slots=True)
class _Reservation:
    model: str
    layers: LayerRange
    expires: float
    reason: str


@dataclass(frozen=True, slots=True)
class _Move:
    model: str
    origin: LayerRange
    target: LayerRange
    started: float
    detail: str


@dataclass
class _AutoNode:
    """The tracker's record of an auto-placed node."""

    moves: int = 0
    last_move: float = -1e18
    reason: str | None = None  # why it got its current range
    events: list[str] = field(default_factory=list)  # its last few placement events, for /v1/nodes


class PlacementBook:
    """Reservations, moves and the auto-placed nodes' records."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self.reservations: dict[str, _Reservation] = {}
        self.moves: dict[str, _Move] = {}
        self.auto: dict[str, _AutoNode] = {}
        self._holes_since: dict[tuple[str, int], float] = {}

    def clock(self) -> float:
        # the module's clock, looked up per call (tests move it), unless one was given
        return self._clock() if self._clock is not None else time.time()

    # -- the snapshot ---------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for node_id in [k for k, r in self.reservations.items() if r.expires <= now]:
            del self.reservations[node_id]
            move = self.moves.pop(node_id, None)
            if move is not None:
                self._event(node_id, f"move to {move.target} lapsed (not registered within {MOVE_TTL_S:g} s)")
                log.warning("placement: node %s did not complete its move to %s in time", node_id, move.target)

    def holders(self, model: str, total: int, live: Sequence[NodeRecord], *, but: str | None = None) -> list[Holder]:
        """Who serves (or is reserved to serve) each layer of ``model``; a moving node counts at its
        target (where it is reserved), not where it still drains."""
        out = [
            Holder(n.node_id, n.layers, node_throughput(n))
            for n in live
            if n.model == model
            and n.layers.total == total
            and n.node_id != but
            and n.node_id not in self.moves
            and n.routable  # an auditor or a suspended node covers nothing routes could use
        ]
        out += [
            Holder(node_id, r.layers, reserved_throughput(r.layers), live=False)
            for node_id, r in self.reservations.items()
            if r.model == model and r.layers.total == total and node_id != but
        ]
        return out

    # -- POST /v1/placement ---------------------------------------------------------------------
    def assign(self, req: PlacementRequest, live: Sequence[NodeRecord]) -> tuple[Placement, float]:
        """The range for a joining node, reserved for it; and the reservation's seconds."""
        now = self.clock()
        self._expire(now)
        ask = req.ask(req.total_layers)
        self.moves.pop(req.node_id, None)  # a node asking afresh restarted: whatever it was doing is over
        chosen = choose_range(ask, self.holders(req.model, req.total_layers, live, but=req.node_id))
        self.reservations[req.node_id] = _Reservation(req.model, chosen.layers, now + RESERVE_S, chosen.reason)
        record = self.auto.setdefault(req.node_id, _AutoNode())
        record.reason = chosen.detail
        self._event(req.node_id, f"assigned {chosen.layers}: {chosen.detail}")
        log.info("placement: node %s gets layers %s of %s: %s", req.node_id, chosen.layers, req.model, chosen.detail)
        return chosen, RESERVE_S

    # -- each heartbeat -------------------------------------------------------------------------
    def heartbeat(self, node: NodeRecord, advert: PlacementAdvert | None, live: Sequence[NodeRecord]) -> dict[str, Any]:
        """Fields for the registration answer: ``move`` when this node should move now (repeated on
        every heartbeat until it registers at the target, or the move lapses)."""
        now = self.clock()
        self._expire(now)
        reservation = self.reservations.get(node.node_id)
        move = self.moves.get(node.node_id)
        if move is not None and node.layers == move.target:
            self._complete(node, move, now)
            return {}
        if reservation is not None and move is None:
            del self.reservations[node.node_id]  # it registered: its live record covers what it reserved
        if move is not None:
            if node.layers != move.origin:  # registered some third range: the move is over either way
                del self.moves[node.node_id]
                self.reservations.pop(node.node_id, None)
                return {}
            return {"move": _move_json(move)}
        if advert is None:
            self.auto.pop(node.node_id, None)  # a node restarted with explicit --layers
            return {}
        self.auto.setdefault(node.node_id, _AutoNode())
        found = self._consider_move(node, advert, live, now)
        return {} if found is None else {"move": _move_json(found)}

    def _consider_move(
        self, node: NodeRecord, advert: PlacementAdvert, live: Sequence[NodeRecord], now: float
    ) -> _Move | None:
        model, total = node.model, node.layers.total
        holders = self.holders(model, total, live)
        key = (model, total)
        if not holes(coverage(holders, total)):
            self._holes_since.pop(key, None)
            return None
        since = self._holes_since.setdefault(key, now)
        record = self.auto[node.node_id]
        if (
            now - since < HOLE_GRACE_S
            or now - record.last_move < MOVE_COOLDOWN_S
            or any(m.model == model and m.origin.total == total for m in self.moves.values())
        ):
            return None
        me = Holder(node.node_id, node.layers, node_throughput(node))
        try:
            target = choose_move(advert.ask(total), me, holders)
        except InvalidRequest:
            return None
        if target is None:
            return None
        move = _Move(model, node.layers, target.layers, now, target.detail)
        self.moves[node.node_id] = move
        self.reservations[node.node_id] = _Reservation(model, target.layers, now + MOVE_TTL_S, UNCOVERED)
        record.reason = target.detail
        self._event(node.node_id, f"told to move {node.layers} -> {target.layers}: {target.detail}")
        log.warning(
            "placement: node %s moves from layers %s to %s of %s: %s",
            node.node_id,
            node.layers,
            target.layers,
            model,
            target.detail,
        )
        return move

    def _complete(self, node: NodeRecord, move: _Move, now: float) -> None:
        del self.moves[node.node_id]
        self.reservations.pop(node.node_id, None)
        record = self.auto.setdefault(node.node_id, _AutoNode())
        record.moves += 1
        record.last_move = now
        self._event(node.node_id, f"moved {move.origin} -> {move.target} in {now - move.started:.1f} s")
        log.warning(
            "placement: node %s now serves layers %s (moved from %s in %.1f s)",
            node.node_id,
            move.target,
            move.origin,
            now - move.started,
        )

    def _event(self, node_id: str, text: str) -> None:
        events = self.auto.setdefault(node_id, _AutoNode()).events
        events.append(text)
        del events[:-5]

    # -- what the lists show --------------------------------------------------------------------
    def draining(self) -> frozenset[str]:
        """Nodes told to move: routes take no new session through them."""
        return frozenset(self.moves)

    def describe(self, node_id: str) -> dict[str, Any] | None:
        """``placement`` of a node in ``GET /v1/nodes``: null for a node placed by hand."""
        record = self.auto.get(node_id)
        if record is None:
            return None
        move = self.moves.get(node_id)
        return {
            "mode": "auto",
            "moves": record.moves,
            "moving_to": None if move is None else str(move.target),
            "reason": record.reason,
            "events": list(record.events),
        }

    def listing(self) -> dict[str, Any]:
        now = self.clock()
        self._expire(now)
        return {
            "reservations": [
                {"node_id": k, "model": r.model, "layers": str(r.layers), "reason": r.reason,
                 "expires_in_s": round(r.expires - now, 3)}
                for k, r in sorted(self.reservations.items())
            ],
            "moves": [
                {"node_id": k, "model": m.model, "from": str(m.origin), "to": str(m.target),
                 "for_s": round(now - m.started, 3), "reason": m.detail}
                for k, m in sorted(self.moves.items())
            ],
        }  # fmt: skip

    # -- HTTP -----------------------------------------------------------------------------------
    def routes(self, live: Callable[[], list[NodeRecord]], *, members: bool) -> list[Route]:
        """``members``: a private swarm, where a node asks only as itself (its certificate)."""

        async def place(request: Request) -> Response:
            req = parse_body(PlacementRequest, await read_body(request, MAX_BODY_BYTES, "the tracker"))
            if members:
                require_node(request.scope, req.node_id)
            chosen, reserved_s = self.assign(req, live())
            return JSONResponse(
                {
                    "node_id": req.node_id,
                    "layers": str(chosen.layers),
                    "reason": chosen.reason,
                    "detail": chosen.detail,
                    "reserved_s": reserved_s,
                }
            )

        async def listing(_: Request) -> Response:
            return JSONResponse(self.listing())

        return [Route(PLACEMENT_PATH, place, methods=["POST"]), Route(PLACEMENT_PATH, listing, methods=["GET"])]


def _move_json(move: _Move) -> dict[str, Any]:
    return {"layers": str(move.target), "from": str(move.origin), "reason": move.detail}


class RoutableNodes:
    """The registry the sessions API routes over: the live nodes but those draining for a move, auditors
    and nodes a failed audit suspended (tracker.audits)."""

    def __init__(self, registry: NodeRegistry, book: PlacementBook) -> None:
        self.registry = registry
        self.book = book

    def live_nodes(self) -> list[NodeRecord]:
        """Live nodes that may serve routes: not draining, no auditor, not suspended by an audit."""
        draining = self.book.draining()
        return [n for n in self.registry.live_nodes() if n.node_id not in draining and n.routable]

    def record_failure(self, node_id: str, reason: str) -> None:
        self.registry.record_failure(node_id, reason)

    def suspend(self, node_id: str) -> None:
        self.registry.suspend(node_id)


def check_advert(advert: PlacementAdvert | None, total_layers: int) -> None:
    """A registration's ``placement`` must describe the model it registers (400 naming the field)."""
    if advert is None:
        return
    try:
        advert.ask(total_layers)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=f"placement.{exc.param}") from None
