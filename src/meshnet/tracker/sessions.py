"""The tracker's session, repair, failure and billing endpoints (docs/tracker.md).

- ``POST /v1/sessions`` pins the best route (``exclude`` avoids nodes that just failed);
  ``GET``/``DELETE /v1/sessions/{id}``; ``GET /v1/sessions`` lists the open ones.
- ``POST /v1/sessions/{id}/repair`` — a hop failed mid-decode: records the failure (once per
  session and node), picks the replacement run of hops (``tracker.repair``, or the standby the
  gateway names in ``prefer`` when it qualifies), re-pins the session to the repaired route and only
  then suspends the failed node: a repair that cannot proceed suspends nothing.
- ``POST /v1/sessions/{id}/standbys`` — a private swarm's KV snapshot standbys: per hop, a trusted
  node off the route that holds the same layers and computes them bit-identically, with the signed
  repair ticket of the contingency "that hop fails and the standby replaces it".
- ``POST /v1/nodes/{id}/failures`` — a hop failed outside a repair (e.g. during prefill): once per
  session and node it records the failure, suspends the node and floors its speed
  (``SpeedChecks.failed``).

Failure reports and repairs are rate-limited per member (``tracker.limits``).
- ``POST /v1/billing`` records a finished session's per-node work in one transaction
  (idempotent), and judges the speeds its route's nodes advertised by the decode time the gateway
  observed (``tracker.plausibility``); ``GET /v1/billing`` reads records and totals.

A node reported failed is dropped from the live set at once (a dead node must not be handed to
the next session while its heartbeat TTL runs out); if it is alive, its next heartbeat brings it
back, with the failure in its reliability record.

Cache-warm routing: a session opened with its prompt's ``prefix`` (protocol.prefix) is routed to
the nodes that hold the most of it, and when the gateway closes it, its nodes count as holding
those blocks (``PrefixHints``) until their own heartbeats advertise them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.config import PRODUCT_CONTEXT_CAP
from meshnet.errors import Conflict, ContextOverflow, Forbidden, InvalidRequest, NotFound, Overloaded, RateLimited
from meshnet.httputil import read_body
from meshnet.ids import RouteId, SessionId, new_route_id, new_session_id
from meshnet.layers import LayerRange
from meshnet.protocol.prefix import HASH_BYTES, MAX_PREFIX_BLOCKS
from meshnet.protocol.signing import COUNTERSIGNATURE, HOP_KEY_CHARS, check_public_key, countersigned_by
from meshnet.protocol.tickets import RouteTicket, TicketHop, TicketSigner, repair_ticket, route_ticket
from meshnet.security.identity import Member
from meshnet.security.membership import scope_member
from meshnet.tracker.billing import FORMULA, MAX_DECODE_S
from meshnet.tracker.db import BillingRow, TrackerDB, member
from meshnet.tracker.failures import FailureLedger
from meshnet.tracker.limits import FAILURES, REPAIRS, RateLimits
from meshnet.tracker.plausibility import SpeedChecks
from meshnet.tracker.receipts import Receipt, check_receipts
from meshnet.tracker.repair import PinnedHop, Repair, equivalent_nodes, plan_repair
from meshnet.tracker.routing import NodeRecord, RouteChoice, RouteRequest, select_routes

__all__ = ["NodeRegistry", "PrefixHints", "SessionsApi", "check_owner", "limited_caller", "parse_body", "total_layers"]

NO_TRUSTED_ROUTE = "no_trusted_route"  # the 503's code when trusted nodes alone cannot make the route
NO_TRUSTED_NODES = "no_trusted_nodes"  # the 409's code when an open swarm is asked for standbys
SESSION_IDLE_S = 3600.0  # an open session nobody repaired, billed or closed for this long is expired


class NodeRegistry(Protocol):
    def live_nodes(self) -> list[NodeRecord]: ...

    def record_failure(self, node_id: str, reason: str) -> None: ...

    def suspend(self, node_id: str) -> None: ...


class PromptPrefix(BaseModel):
    """The chained hashes of a prompt's leading blocks (protocol.prefix ``block_hashes``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    block: int = Field(ge=1, le=1 << 16)  # tokens per block: the gateway's prefill chunk
    hashes: list[Annotated[str, Field(pattern=rf"^[0-9a-fA-F]{{{2 * HASH_BYTES}}}$")]] = Field(
        max_length=MAX_PREFIX_BLOCKS
    )


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    model: str = Field(min_length=1)
    total_layers: int | None = Field(None, ge=1)
    prefill_tokens: int | None = Field(None, ge=0)  # the expected request, for route selection
    max_tokens: int | None = Field(None, ge=0)
    exclude: list[str] = Field(default_factory=list, max_length=1000)
    # A fresh route that must compute exactly what this (earlier) session's route did: the gateway
    # re-prefills a generation that already streamed text, which must go on unchanged.
    like_session: str | None = Field(None, min_length=1, max_length=64)
    # Only nodes whose certificate grants the trusted tier, on the route and in every repair of it.
    trusted_only: bool = Field(False, strict=True)
    # The prompt's blocks: the route that holds the most of them prefills the least.
    prefix: PromptPrefix | None = None
    # The gateway's key (protocol.signing): pinned with the session, its billing must be countersigned by it.
    gateway_key: str | None = Field(None, min_length=HOP_KEY_CHARS, max_length=HOP_KEY_CHARS)


class RepairRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    failed_node: str = Field(min_length=1, max_length=128)
    reason: str = Field("", max_length=4096)
    position: int = Field(0, ge=0)  # positions the session holds: what the replacements must replay
    # The standby that holds a KV snapshot of the failed hop (POST /v1/sessions/{id}/standbys): it
    # replaces exactly that hop when it still qualifies, and replays only the positions after the
    # snapshot; a stale preference is not an error, the repair searches as without one.
    prefer: str | None = Field(None, min_length=1, max_length=128)


class StandbyRequest(BaseModel):
    """No fields yet: the standbys of a session follow from its pinned route alone."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class FailureReport(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    reason: str = Field("", max_length=4096)
    # The open session whose route the node failed on: a report about any other node is refused.
    session_id: str = Field(min_length=1, max_length=64)


# Positions one node may bill for one session: a 1M-token context recomputed by 15 repairs fits.
MAX_BILLED_TOKENS = 2**24
BILLING_GRACE_S = 3600.0  # a session's work may be billed this long after it closed (the outbox retries)


class NodeWork(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    node_id: str = Field(min_length=1, max_length=128)
    layers: str = Field(min_length=3, max_length=32)
    prefill_tokens: int = Field(ge=0, le=MAX_BILLED_TOKENS)
    decode_tokens: int = Field(ge=0, le=MAX_BILLED_TOKENS)


class BillingReport(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    session_id: str = Field(min_length=1, max_length=64)
    route_id: str = Field(min_length=1, max_length=64)
    outcome: str = Field("completed", pattern=r"^(completed|failed|cancelled)$")
    records: list[NodeWork] = Field(min_length=1, max_length=1000)
    # Seconds the gateway spent in the session's decode steps (tracker.plausibility judges the route's
    # advertised speeds by it); None: not measured (an older gateway), nothing is judged.
    decode_s: float | None = Field(None, ge=0, le=MAX_DECODE_S, allow_inf_nan=False, strict=True)
    # One signed receipt per billed node (tracker.receipts); None: an older gateway sent none, which a
    # private swarm refuses.
    receipts: list[Receipt] | None = Field(None, max_length=1000)


SchemaT = TypeVar("SchemaT", bound=BaseModel)
MAX_BODY_BYTES = 8 * 2**20  # a registration with 100,000 file names fits; anything past it is refused


def parse_body(schema: type[SchemaT], raw: bytes) -> SchemaT:
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"invalid '{where}': {first['msg']}", param=where) from None


def hops_json(chain: Sequence[NodeRecord]) -> list[dict[str, Any]]:
    """A pinned route's hops; ``numerics`` and ``wire_dtype`` let a repair stay exact after the node died."""
    return [
        {
            "node_id": n.node_id,
            "url": n.url,
            "layers": str(n.layers),
            "numerics": n.numerics,
            "wire_dtype": n.wire_dtype,
            "max_verify": n.max_verify,
            **_runs(n),
        }
        for n in chain
    ]


def _runs(node: NodeRecord) -> dict[str, Any]:
    """What a hop runs (one identity per route), the positions a session may hold on it and the key
    its entries are signed with, as far as the node said (an older node says none of it)."""
    said = {"identity": node.identity, "quantization": node.quantization, "max_positions": node.max_positions,
            "hop_key": node.hop_key}  # fmt: skip
    return {k: v for k, v in said.items() if v}


def pinned_hops(session: dict[str, Any]) -> list[PinnedHop]:
    total = total_layers(session)
    return [
        PinnedHop(
            h["node_id"],
            LayerRange.parse(h["layers"], total),
            h.get("numerics"),
            h.get("wire_dtype", "float32"),
            h.get("identity"),
        )
        for h in session["hops"]
    ]


def _caller(request: Request) -> str | None:
    """The member id of a private swarm's caller (``None`` in an open swarm)."""
    member = scope_member(request.scope)
    return None if member is None else member.member_id


def limited_caller(request: Request) -> str | None:
    """The member id whose rate limits a request counts against (``tracker.limits``): ``None`` for the
    admin (the operator's own tools) and in an open swarm, which know no limits."""
    member = scope_member(request.scope)
    return None if member is None or member.role == "admin" else member.member_id


def _may_see(who: Member | None, session: dict[str, Any]) -> bool:
    """Whether ``who`` may see ``session``: its owner, an admin, anyone in an open swarm."""
    owner = session.get("owner")
    return who is None or owner is None or who.role == "admin" or who.member_id == owner


def check_owner(request: Request, session: dict[str, Any], what: str) -> None:
    """In a private swarm, only the member that opened a session (or an admin) may ``what`` it:
    another gateway that learns its id cannot repair it, report its nodes, bill it or close it."""
    member = scope_member(request.scope)
    owner = session.get("owner")
    if member is None or owner is None or member.role == "admin" or member.member_id == owner:
        return
    raise Forbidden(
        f"session {session['session_id']} was opened by {owner!r}; {member.role} {member.member_id!r} may not "
        f"{what} it",
        param="session_id",
    )


def _preferred_repair(
    pinned: Sequence[PinnedHop], failed: str, prefer: str | None, live: Sequence[NodeRecord], model: str
) -> Repair | None:
    """The repair that puts the gateway's standby ``prefer`` in place of exactly the failed hop, or
    ``None`` when it does not qualify (gone, suspended, on the route, other layers or numerics).

    The standby holds a snapshot of the failed hop's KV, so it replays only the positions after the
    snapshot instead of all of them. It qualifies only as a replacement ``plan_repair`` itself could
    pick: a live, eligible node of the model, off the route, holding exactly the failed hop's layers
    and computing them bit-identically. The preference only chooses among valid repairs.
    """
    if prefer is None or prefer == failed or prefer in {h.node_id for h in pinned}:
        return None
    index = next(i for i, hop in enumerate(pinned) if hop.node_id == failed)
    hop = pinned[index]
    node = next((n for n in live if n.node_id == prefer), None)
    if node is None or node.model != model or node.layers != hop.layers or not equivalent_nodes([hop], [node]):
        return None
    return Repair(first=index, removed=1, nodes=(node,))


def _why_no_standby(hop: PinnedHop, same: Sequence[NodeRecord], trusted: Sequence[NodeRecord]) -> str:
    """Why hop ``hop`` has no standby, given the live off-route nodes holding exactly its layers
    (``same``) and the trusted ones among them."""
    if not same:
        return f"no other live node serves exactly layers {hop.layers} (hop {hop.node_id})"
    if not trusted:
        return (
            f"none of the {len(same)} other live nodes serving layers {hop.layers} (hop {hop.node_id}) is trusted "
            "(meshnet swarm invite --trusted)"
        )
    return (
        f"none of the {len(trusted)} other trusted nodes serving layers {hop.layers} (hop {hop.node_id}) computes "
        "them bit-identically (same library, processor, threads and wire dtype)"
    )


def _positions(req: SessionRequest) -> int:
    """Positions the session will hold: its prompt plus what it may generate (at least one token).
    0 when the gateway did not say how long its prompt is: then nothing is checked."""
    if req.prefill_tokens is None:
        return 0
    return req.prefill_tokens + max(1, req.max_tokens or 0)


def _check_context(positions: int, req: SessionRequest, live: Sequence[NodeRecord]) -> None:
    """A 400 before any route is chosen for a request no route could ever hold: past the product's
    cap, or past the trained context the model's nodes advertise (positions past it give garbage)."""
    if positions <= PRODUCT_CONTEXT_CAP:
        trained = [n.trained_context for n in live if n.model == req.model and n.trained_context > 0]
        if not trained or positions <= min(trained):
            return
        limit, what = min(trained), f"the trained context of {req.model!r}"
    else:
        limit, what = PRODUCT_CONTEXT_CAP, "the product's context cap"
    raise ContextOverflow(
        f"the prompt ({req.prefill_tokens:,} tokens) plus max_tokens ({max(1, req.max_tokens or 0):,}) is "
        f"{positions:,} positions, past {what} ({limit:,}); lower max_tokens or shorten the prompt",
        param="max_tokens",
    )


def total_layers(session: dict[str, Any]) -> int:
    """A pinned route ends at the model's last layer: its tail's stop is the layer count."""
    return int(session["hops"][-1]["layers"].partition(":")[2])


# A closed session's blocks count as held by its nodes this long: by then their heartbeats (every 5 s)
# advertise them in their own filters, or they evicted them.
PREFIX_HINT_S = 60.0
_HINTS_PER_NODE = 4096  # block hashes remembered per node; the oldest go first
_PREFIXES_KEPT = 10_000  # open sessions whose prompt blocks are remembered (at most 4 KiB each)


class PrefixHints:
    """Prompt blocks nodes took since their last heartbeat, in memory only (a restart loses hints).

    A node puts a session's prompt blocks into its prefix cache when the gateway closes the session;
    its filter advertises them only with its next heartbeat. A conversation's next turn, asked for
    right after the previous answer, would miss its warm route in between: so the tracker remembers
    each open session's blocks, and on close counts them as held by the session's nodes for
    ``PREFIX_HINT_S``. Block hashes are seeded with the block size, so blocks of different sizes
    never match and the size need not be kept.
    """

    def __init__(self) -> None:
        self._open: OrderedDict[str, bytes] = OrderedDict()  # session id -> its block hashes, concatenated
        self._held: dict[str, OrderedDict[bytes, float]] = {}  # node id -> block hash -> held until

    def opened(self, session_id: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        self._open[session_id] = b"".join(hashes)
        while len(self._open) > _PREFIXES_KEPT:
            self._open.popitem(last=False)

    def closed(self, session_id: str, node_ids: Iterable[str]) -> None:
        """The session ended normally: each of ``node_ids`` now holds its blocks."""
        joined = self._open.pop(session_id, None)
        if joined is None:
            return
        self._expire()
        hashes = [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
        until = time.time() + PREFIX_HINT_S
        for node_id in node_ids:
            held = self._held.setdefault(node_id, OrderedDict())
            for h in hashes:
                held[h] = until
                held.move_to_end(h)  # kept in expiry order: the oldest are dropped first
            while len(held) > _HINTS_PER_NODE:
                held.popitem(last=False)

    def apply(self, nodes: Sequence[NodeRecord], prefix: Sequence[bytes]) -> list[NodeRecord]:
        """``nodes``, each with ``prefix_held`` set to the blocks of ``prefix`` it took lately."""
        self._expire()
        if not prefix or not self._held:
            return list(nodes)
        now = time.time()
        out = []
        for node in nodes:
            held = self._held.get(node.node_id)
            mine = frozenset(h for h in prefix if held.get(h, now) > now) if held else frozenset()
            out.append(replace(node, prefix_held=mine) if mine else node)
        return out

    def _expire(self) -> None:
        now = time.time()
        for node_id in list(self._held):
            held = self._held[node_id]
            while held and next(iter(held.values())) <= now:
                held.popitem(last=False)
            if not held:
                del self._held[node_id]


# How long a route or repair ticket opens sessions for: a node checks it when the session opens
# (and on a reroute), never per token, so a short life costs nothing.
TICKET_TTL_S = 300.0


class SessionsApi:
    """The handlers; ``routes()`` mounts them."""

    def __init__(
        self,
        registry: NodeRegistry,
        db: TrackerDB,
        *,
        signer: TicketSigner | None = None,
        max_sessions_per_client: int | None = None,
        speeds: SpeedChecks | None = None,
        limits: RateLimits | None = None,
    ) -> None:
        self.registry = registry
        self.db = db
        self.signer = signer  # a private swarm's tracker signs every route it pins (protocol.tickets)
        # Open sessions one member (a private swarm's gateway, by its certificate) may hold; None: no limit.
        self.max_sessions_per_client = max_sessions_per_client
        self.failures = FailureLedger()  # which failure reports count (once per session and node, ...)
        self.hints = PrefixHints()
        # Route claims and observed speed floors; the tracker's node list shares them.
        self.speeds = speeds if speeds is not None else SpeedChecks()
        self.limits = limits if limits is not None else RateLimits()  # per member: reports, repairs

    def load(self, session_id: str) -> dict[str, Any]:
        session = self.db.load_session(session_id)
        if session is None:
            raise NotFound(f"no session {session_id} on this tracker")
        return session

    async def open_session(self, request: Request) -> Response:
        req = parse_body(SessionRequest, await read_body(request, MAX_BODY_BYTES, "the tracker"))
        self.db.expire_sessions(SESSION_IDLE_S)
        self._check_quota(_caller(request))
        defaults = RouteRequest()
        expected = RouteRequest(
            prefill_tokens=defaults.prefill_tokens if req.prefill_tokens is None else req.prefill_tokens,
            decode_tokens=defaults.decode_tokens if req.max_tokens is None else req.max_tokens,
            prefix_block=0 if req.prefix is None else req.prefix.block,
            prefix=() if req.prefix is None else tuple(bytes.fromhex(h) for h in req.prefix.hashes),
            positions=_positions(req),
        )
        live, why_not = self._eligible(req.trusted_only, req.model)
        _check_context(expected.positions, req, live)
        live = self.hints.apply(live, expected.prefix)
        try:
            choices = self._choose(req, expected, live)
        except Overloaded as exc:
            if not why_not:
                raise
            raise Overloaded(f"{exc.message}; {why_not}", retry_after_s=5, code=NO_TRUSTED_ROUTE) from None
        session: dict[str, Any] = {
            "session_id": new_session_id(),
            "route_id": new_route_id(),
            "model": req.model,
            "hops": hops_json(choices[0].nodes),
            "created": time.time(),
            "trusted_only": req.trusted_only,
        }
        self.db.save_session({**session, "owner": _caller(request), "gateway_key": _gateway_key(req)})
        self.hints.opened(session["session_id"], expected.prefix)
        self.speeds.route_chosen(session["session_id"], choices[0].nodes)
        # Not persisted: the alternatives are a snapshot for the caller to fall back on right away.
        extra = {
            "alternatives": [hops_json(c.nodes) for c in choices[1:]],
            "estimated_s": choices[0].estimated_s,
            "cached_tokens": choices[0].cached_tokens,
        }
        if self.signer is not None:
            extra["ticket"] = self.signer.sign(self._ticket({**session, "owner": _caller(request)}))
        return JSONResponse({**session, **extra}, status_code=201)

    def _check_quota(self, caller: str | None) -> None:
        limit = self.max_sessions_per_client
        if caller is None or limit is None:
            return
        held = self.db.open_sessions_of(caller)
        if held >= limit:
            raise RateLimited(
                f"member {caller!r} holds {held} open sessions on this tracker, its limit (--max-sessions-per-client "
                f"{limit}); close one (DELETE /v1/sessions/ID) or retry when one ends",
                retry_after_s=5,
            )

    def _eligible(self, trusted_only: bool, model: str) -> tuple[list[NodeRecord], str]:
        """The live nodes a session may use, and (for a trusted-only one) what to say when they cannot
        make its route: the tier is the one each node's certificate grants (``NodeRecord.trusted``).
        Each carries its observed speed floor (tracker.plausibility)."""
        live = self.speeds.apply(self.registry.live_nodes())
        if not trusted_only:
            return live, ""
        serving = [n for n in live if n.model == model]
        trusted = [n for n in live if n.trusted]
        why = (
            f"the session takes trusted nodes only (trusted_only): {sum(n.trusted for n in serving)} of the "
            f"{len(serving)} live nodes serving {model!r} are trusted (a node's tier is its certificate's: "
            "meshnet swarm invite --trusted)"
        )
        return trusted, why

    def _choose(self, req: SessionRequest, expected: RouteRequest, live: list[NodeRecord]) -> list[RouteChoice]:
        if req.like_session is not None:
            like = equivalent_nodes(pinned_hops(self.load(req.like_session)), live)
            why = (
                f"only nodes that compute bit-identically to session {req.like_session}'s route qualify (same "
                f"library, processor, threads and lossy seams): {len(like)} of {len(live)} live nodes do"
            )
            try:
                return select_routes(like, req.model, req.total_layers, request=expected, exclude=req.exclude)
            except Overloaded as exc:
                raise Overloaded(f"{exc.message}; {why}", retry_after_s=5) from None
        return select_routes(live, req.model, req.total_layers, request=expected, exclude=req.exclude)

    def _ticket(self, session: dict[str, Any], *, hops: list[dict[str, Any]] | None = None) -> RouteTicket:
        """The route ticket of ``session`` (on ``hops``, else its pinned ones): it names the gateway
        that opened it (only it drives the head) and, as its epoch, the repairs the route went through."""
        return route_ticket(
            SessionId(session["session_id"]), RouteId(session["route_id"]), session["model"],
            [TicketHop(h["node_id"], h["url"], h["layers"]) for h in (hops or session["hops"])], ttl_s=TICKET_TTL_S,
            owner=session.get("owner") or "", epoch=int(session.get("repairs") or 0),
        )  # fmt: skip

    async def list_sessions(self, request: Request) -> Response:
        """The open sessions: in a private swarm only the caller's own (an admin's: all), so a member
        cannot learn the ids, routes and nodes of another gateway's sessions."""
        self.db.expire_sessions(SESSION_IDLE_S)
        caller = scope_member(request.scope)
        mine = [s for s in self.db.open_sessions() if _may_see(caller, s)]
        sessions = [{k: v for k, v in s.items() if k != "owner"} for s in mine]
        return JSONResponse({"sessions": sessions})

    async def get_session(self, request: Request) -> Response:
        session = self.load(request.path_params["session_id"])
        if not _may_see(scope_member(request.scope), session):  # as if it did not exist: ids are no oracle
            raise NotFound(f"no session {session['session_id']} on this tracker")
        session.pop("owner", None)  # who drives it is the tracker's business
        return JSONResponse(session)

    async def close_session(self, request: Request) -> Response:
        sid = request.path_params["session_id"]
        session = self.load(sid)
        check_owner(request, session, "close")
        if not self.db.end_session(sid, "closed", "closed by the gateway"):
            raise NotFound(f"session {sid} is already {session['status']}")
        # The nodes cached its prompt blocks before they answered the gateway's own DELETE.
        self.hints.closed(sid, (h["node_id"] for h in session["hops"]))
        return JSONResponse({"deleted": sid})

    async def repair(self, request: Request) -> Response:
        self.limits.check(limited_caller(request), REPAIRS, time.time())
        sid = request.path_params["session_id"]
        req = parse_body(RepairRequest, await read_body(request, MAX_BODY_BYTES, "the tracker"))
        session = self.load(sid)
        check_owner(request, session, "repair")
        if session["status"] != "open":
            raise Conflict(f"session {sid} is {session['status']}; open a new one")
        pinned = pinned_hops(session)
        if req.failed_node not in {h.node_id for h in pinned}:  # checked first: nothing is recorded otherwise
            raise InvalidRequest(f"node {req.failed_node} is not on session {sid}'s route", param="failed_node")
        # Counted once per session and node: a member repairing its own session in a loop used to
        # record a failure each time (reliability 0.33 -> 0.0014 in 20 s).
        _, counts = self._count_failure(request, sid, req.failed_node, req.reason or "failed during decode")
        live, why_not = self._eligible(bool(session.get("trusted_only")), session["model"])
        fix = _preferred_repair(pinned, req.failed_node, req.prefer, live, session["model"])
        preferred = fix is not None
        if fix is None:
            # The replacements must hold what the session holds now, and the next step.
            expected = RouteRequest(req.position, 256, positions=req.position + 1)
            try:
                fix = plan_repair(pinned, req.failed_node, live, session["model"], request=expected)
            except Overloaded as exc:
                if not why_not:
                    raise
                raise Overloaded(f"{exc.message}; {why_not}", retry_after_s=5, code=NO_TRUSTED_ROUTE) from None
        hops = [*session["hops"][: fix.first], *hops_json(fix.nodes), *session["hops"][fix.first + fix.removed :]]
        self.db.repin_session(sid, hops)  # one more repair: the ticket's epoch (nodes refuse older ones)
        # Suspended only now that the repair proceeds: one that cannot (no replacement) used to take
        # the node off the live set each time, so a loop of them kept an honest node off every route.
        if counts:
            self.registry.suspend(req.failed_node)
        self.speeds.route_repaired(sid, [h["node_id"] for h in hops], live)
        replaced = {"first": fix.first, "count": len(fix.nodes), "removed": fix.removed}
        answer = {
            "session_id": sid,
            "route_id": session["route_id"],
            "hops": hops,
            "replaced": replaced,
            "preferred": preferred,  # the gateway's standby took the failed hop's place: it restores its snapshot
        }
        if self.signer is not None:  # the nodes before the replaced ones accept the reroute with it
            answer["ticket"] = self._repair_ticket(session, hops, fix.first, bump=True)
        return JSONResponse(answer)

    async def standbys(self, request: Request) -> Response:
        """Where each hop of an open session should keep a snapshot of its KV, so that when the hop
        fails its standby takes over from the snapshot and replays only the positions after it.

        A standby holds exactly the hop's layers, computes them bit-identically (``equivalent_nodes``:
        a restored snapshot must be the very KV the hop had, or the text changes), is off the route
        and is *trusted*: a snapshot is the session's whole KV for those layers, so it goes only to
        nodes whose certificate grants the trusted tier, which only a private swarm has. Two hops of
        one route never hold the same layers, so a node stands by for at most one hop. Nothing is
        stored: the answer is advice for the gateway, re-asked as the swarm changes; each standby
        carries the signed repair ticket of "this hop fails and the standby replaces it", which
        lets it take the snapshot (and, once that happens, the reroute).
        """
        sid = request.path_params["session_id"]
        parse_body(StandbyRequest, await read_body(request, MAX_BODY_BYTES, "the tracker") or b"{}")
        if self.signer is None:
            raise Conflict(
                "KV snapshots go only to trusted nodes, and only a private swarm has them: this tracker serves an "
                "open swarm; create one with meshnet swarm init, run the tracker with --swarm DIR and invite the "
                "standby nodes with meshnet swarm invite --trusted",
                code=NO_TRUSTED_NODES,
            )
        session = self.load(sid)
        check_owner(request, session, "plan standbys for")
        if session["status"] != "open":
            raise Conflict(f"session {sid} is {session['status']}; only an open session's KV has standbys")
        pinned = pinned_hops(session)
        on_route = {h.node_id for h in pinned}
        serving = [n for n in self.registry.live_nodes() if n.model == session["model"] and n.node_id not in on_route]
        chosen: list[dict[str, Any]] = []
        missing: list[str] = []
        for index, hop in enumerate(pinned):
            same = [n for n in serving if n.layers == hop.layers]
            trusted = [n for n in same if n.trusted]
            fits = sorted(equivalent_nodes([hop], trusted), key=lambda n: (-n.kv_bytes_free, n.node_id))
            if not fits:
                missing.append(_why_no_standby(hop, same, trusted))
                continue
            node = fits[0]
            hops = [*session["hops"][:index], *hops_json([node]), *session["hops"][index + 1 :]]
            chosen.append(
                {
                    "index": index,
                    "node_id": node.node_id,
                    "url": node.url,
                    "layers": str(node.layers),
                    "ticket": self._repair_ticket(session, hops, index, bump=False),
                }
            )
        why_not = f"{'; '.join(missing)}." if missing else None
        return JSONResponse({"standbys": chosen, "why_not": why_not})

    def _repair_ticket(self, session: dict[str, Any], hops: list[dict[str, Any]], first: int, *, bump: bool) -> str:
        """The signed repair ticket of ``session``'s route becoming ``hops`` from hop ``first`` on; of
        the next epoch for a repair (``bump``), of the current one for a standby's contingency (it
        only lets a snapshot travel and be restored: the repair that uses it issues its own)."""
        assert self.signer is not None
        old, new = self._ticket(session), self._ticket(session, hops=hops)
        epoch = old.epoch + 1 if bump else old.epoch
        return self.signer.sign(repair_ticket(old, new.hops, repair_from=first, ttl_s=TICKET_TTL_S, epoch=epoch))

    async def report_failure(self, request: Request) -> Response:
        """A hop failed outside a repair. Only a node on the named open session's route can be reported,
        and once per session: a report loop cannot push a node's reliability down, nor suspend a node
        that no session of the reporter uses."""
        self.limits.check(limited_caller(request), FAILURES, time.time())
        node_id = request.path_params["node_id"]
        req = parse_body(FailureReport, await read_body(request, MAX_BODY_BYTES, "the tracker"))
        session = self.load(req.session_id)
        check_owner(request, session, "report failures on")
        if session["status"] != "open":
            raise Conflict(f"session {req.session_id} is {session['status']}: report failures while it is open")
        if node_id not in {h["node_id"] for h in session["hops"]}:
            raise InvalidRequest(f"node {node_id} is not on session {req.session_id}'s route", param="session_id")
        counted = self.count_failed_hop(request, req.session_id, node_id, req.reason or "reported failed")
        return JSONResponse({"recorded": node_id, "duplicate": not counted})

    def count_failed_hop(self, request: Request, session_id: str, node_id: str, reason: str) -> bool:
        """A failure of ``node_id`` on ``session_id`` outside a repair (a failure report, a seam log an
        audited node withheld: tracker.audits): whether it counted (once per session and node, outside
        the reporter's window); then the node is suspended until its next heartbeat and floored."""
        first, counts = self._count_failure(request, session_id, node_id, reason)
        if not first or not counts:  # this member reported this node within the window: nothing more
            return False
        failed = next((n for n in self.registry.live_nodes() if n.node_id == node_id), None)
        self.registry.suspend(node_id)
        # A node that fails at prefill has seen the prompt: floored like an implausible report, it stops
        # winning the routes it could read prompts on and fail (the gateway retrying elsewhere). Not a
        # trusted one: the operator vouched for it, and a floor would hand its traffic to untrusted nodes.
        if failed is None or not failed.trusted:
            self.speeds.failed(node_id)
        return True

    def _count_failure(self, request: Request, session_id: str, node_id: str, reason: str) -> tuple[bool, bool]:
        """Record a failure of ``node_id`` on ``session_id``'s route when it counts (``FailureLedger``):
        whether this is the first word of it, and whether it counts (then the node may be suspended)."""
        first, counts = self.failures.count(session_id, node_id, limited_caller(request), time.time())
        if first and counts:
            self.registry.record_failure(node_id, reason)
        return first, counts

    async def record_billing(self, request: Request) -> Response:
        raw = await read_body(request, MAX_BODY_BYTES, "the tracker")
        req = parse_body(BillingReport, raw)
        session = self.load(req.session_id)
        check_owner(request, session, "bill")
        countersignature = _countersigned(session, raw)
        if session["route_id"] != req.route_id:
            raise Conflict(f"session {req.session_id} is on route {session['route_id']}, not {req.route_id}")
        ended_s = time.time() - float(session["updated"])
        if session["status"] != "open" and ended_s > BILLING_GRACE_S:
            raise Conflict(
                f"session {req.session_id} ended {ended_s:.0f}s ago; its work is billed within "
                f"{BILLING_GRACE_S:.0f}s of its end"
            )
        rows, total, members = [], total_layers(session), set(session["members"])
        for work in req.records:
            try:
                layers = LayerRange.parse(work.layers, total)
            except ValueError as exc:
                raise InvalidRequest(f"records: {exc}", param="records.layers") from None
            if member(work.node_id, str(layers)) not in members:
                raise InvalidRequest(
                    f"records: node {work.node_id} never served layers {layers} of session {req.session_id}",
                    param="records.node_id",
                )
            rows.append(BillingRow(work.node_id, str(layers), len(layers), work.prefill_tokens, work.decode_tokens))
        rows = [replace(row, countersignature=countersignature) for row in rows]
        if req.receipts is not None:
            proofs = check_receipts(session, rows, req.receipts)
            rows = [replace(row, receipt=proofs.get(row.node_id)) for row in rows]
        elif session.get("owner") is not None:  # a private swarm's gateway
            raise InvalidRequest(
                f"session {req.session_id} is billed without receipts: a private swarm bills only the work its "
                "nodes signed for (send each billed node's receipt; upgrade this gateway)",
                param="receipts",
            )
        fresh = self.db.record_billing(session, req.outcome, rows)
        self.db.end_session(req.session_id, "closed", f"billed ({req.outcome})")
        answer: dict[str, Any] = {"session_id": req.session_id, "duplicate": not fresh}
        # Judged once, on the report that was written: a resent one changes no floor.
        verdict = (
            None if not fresh or req.decode_s is None else self.speeds.judge(req.session_id, rows, total, req.decode_s)
        )
        if verdict is not None:
            answer["speed_check"] = verdict.as_json()
        return JSONResponse(answer, status_code=201 if fresh else 200)

    async def read_billing(self, request: Request) -> Response:
        q = request.query_params
        try:
            limit = min(1000, max(1, int(q.get("limit", "100"))))
            offset = max(0, int(q.get("offset", "0")))
        except ValueError:
            raise InvalidRequest("limit and offset must be integers", param="limit") from None
        records, totals = self.db.billing(
            session_id=q.get("session_id"), node_id=q.get("node_id"), limit=limit, offset=offset
        )
        return JSONResponse({"records": records, "totals": totals, "formula": FORMULA})

    def routes(self) -> list[Route]:
        return [
            Route("/v1/sessions", self.open_session, methods=["POST"]),
            Route("/v1/sessions", self.list_sessions, methods=["GET"]),
            Route("/v1/sessions/{session_id}", self.get_session, methods=["GET"]),
            Route("/v1/sessions/{session_id}", self.close_session, methods=["DELETE"]),
            Route("/v1/sessions/{session_id}/repair", self.repair, methods=["POST"]),
            Route("/v1/sessions/{session_id}/standbys", self.standbys, methods=["POST"]),
            Route("/v1/nodes/{node_id}/failures", self.report_failure, methods=["POST"]),
            Route("/v1/billing", self.record_billing, methods=["POST"]),
            Route("/v1/billing", self.read_billing, methods=["GET"]),
        ]


def _gateway_key(req: SessionRequest) -> str | None:
    if req.gateway_key is None:
        return None
    try:
        return check_public_key(req.gateway_key)
    except ValueError as exc:
        raise InvalidRequest(f"gateway_key: {exc}", param="gateway_key") from None


def _countersigned(session: dict[str, Any], raw: bytes) -> str | None:
    """The gateway's countersignature of a billing report, checked against the key pinned with the
    session (protocol.signing.countersign); ``None`` for a session pinned without one (an older gateway)."""
    key = session.get("gateway_key")
    if key is None:
        return None
    report = json.loads(raw)  # parse_body took it: a JSON object
    if not countersigned_by(key, report):
        raise InvalidRequest(
            f"the billing report of session {session['session_id']} does not carry the countersignature of the "
            "gateway key it was opened with: the gateway that opened the session bills it, signing what it sends",
            param=COUNTERSIGNATURE,
        )
    return str(report[COUNTERSIGNATURE])
