"""What an advertised speed may buy a node: physical ceilings, and floors from what its routes did.

Route selection (routing.py) ranks chains by the speeds their nodes advertise, and the nodes of the
winning chain see the prompt. A member that claims to be very fast (10⁶ decode positions/s) would
win every route: the registration's bounds ([0.001, 10⁷] positions/s, finite) keep the numbers
computable, not honest. Two checks bound what a claim buys (docs/tracker.md, "Plausible speeds").

**Physical ceilings** (``speed_ceilings``, at registration). A decode step reads the node's
weights at least once, so no node decodes faster than ``MAX_MEMORY_BANDWIDTH_BYTES_PER_S /
weight_bytes`` positions/s. A prefill position costs about 2 FLOPs per weight parameter, and no
format stores a parameter in more than ``MAX_BYTES_PER_PARAM`` bytes (fp32), so it costs at least
``2 · weight_bytes / 4`` FLOPs and no node prefills faster than ``MAX_FLOPS`` over that. The
advertised ``weight_bytes`` counts as at least ``MIN_WEIGHT_BYTES_PER_LAYER`` per layer (0 means
the node did not say). The constants are well above any single accelerator of 2026 and the work
is estimated low (bytes per parameter at their most; an embedding table in ``weight_bytes`` is
read one row per step), so an honest node is never capped: the ceilings turn impossible claims
into merely very fast ones. They cannot catch a node that also understates its weights; the
floors can.

**Observed floors** (``SpeedChecks``, from billing reports). The gateway times the decode steps it
drives and reports a session's total (``decode_s``) with its billing record. The tracker compares
the observed seconds per decode step with what the route's nodes claimed when the route was
chosen: the sum of their claimed seconds per position (``routing.claimed_decode_s``: capped, before
any floor) plus the hop latencies routing charged. A step slower than ``PLAUSIBLE_FACTOR`` times
that, plus ``PLAUSIBLE_MARGIN_S`` and ``PLAUSIBLE_NODE_MARGIN_S`` per node, means the claims were
implausible, and every node of the route that decoded gets an *observed floor*: its layer share
of the step's compute time (the observed step less the hop latencies). Routing charges a node at
least its floor per decode position, and
scales its prefill by the same factor. The liar, which claimed ~0 s per step, is charged about
its real share and stops winning every route; an honest node routed with it is charged too much
for a while, and recovers:

- a floor halves every ``FLOOR_HALF_LIFE_S`` and is forgotten ``FLOOR_TTL_S`` after it last
  changed (by then 1/64 of it is left);
- a plausible report of a route through the node halves it at once (its claim held up there);
- an implausible report raises it to at least the new share. Reports are judged against the claims,
  not the floors, so the liar is floored again every time it is used, however often.

Claims are snapshotted when the route is chosen (and when a repair adds nodes to it), not read when
the report arrives: a node that sees its session end (the gateway's ``DELETE``) could otherwise
advertise a slow speed for the moment the report takes to arrive. A report whose session the tracker
has no snapshot of (a tracker restart, or one of more than ``ROUTES_KEPT`` unreported sessions), or
with fewer than ``MIN_JUDGED_STEPS`` decode steps, is not judged.

A node's load is not part of its claim: a route through busy nodes is slower than claimed without
anyone lying. ``PLAUSIBLE_FACTOR`` leaves room for queues of about two requests; a floor from a
busy moment decays like any other. (Judging by the load a node advertises at report time would let
a liar advertise a long queue just then.)

What remains (docs/security.md): the gateway that owns a session chooses the ``decode_s`` it
reports, so it can floor the honest nodes of its own routes. Each floor is bounded (``MAX_FLOOR_S``),
decays, and comes only from the first report of a session that gateway opened and the tracker routed.

**Probation** (``SpeedChecks(probation=True)``: a private swarm's tracker, where certificates carry
trust tiers). A node that is neither trusted nor *measured* is on probation: routing believes none
of its speed claims (it is charged as a node that has not measured any) and makes it the head of a
route only when no other head can make one (``routing``, "Probation"). A node is **measured** once
judged billing reports credited it with ``MEASURED_STEPS`` gateway-observed decode steps, each on
a report whose steps took no longer than the route claimed (a *plausible* report). An implausible
report of a route through it, or a failure report about it, takes all its credit: it is on
probation again. So the largest speed claim a registration may make buys an unmeasured member
nothing, and the member that claims more than it does is never measured.

**A failed node is floored** (``failed``): an untrusted node reported failed during prefill (the
gateway's ``POST /v1/nodes/{id}/failures``) gets the floor of ``MAX_FLOOR_S``, as if an implausible report had
observed the slowest step one can, and loses its measured credit. A node that reads the prompt and
then fails, so that the gateway retries elsewhere, stops winning the routes it read prompts on.

Memory only (a restart forgets floors, credits and snapshots: every untrusted node is on probation
again), bounded (``MAX_FLOORS``, ``ROUTES_KEPT``); not thread-safe: the tracker calls it from its
event loop only.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from meshnet.tracker.routing import (
    DEFAULT_DECODE_S_PER_LAYER,
    DEFAULT_HOP_LATENCY_MS,
    NodeRecord,
    claimed_decode_s,
    hop_latency_s,
)

__all__ = [
    "FLOOR_HALF_LIFE_S",
    "FLOOR_TTL_S",
    "MAX_BYTES_PER_PARAM",
    "MAX_FLOORS",
    "MAX_FLOOR_S",
    "MAX_FLOPS",
    "MAX_MEMORY_BANDWIDTH_BYTES_PER_S",
    "MEASURED_STEPS",
    "MIN_JUDGED_STEPS",
    "MIN_WEIGHT_BYTES_PER_LAYER",
    "PLAUSIBLE_FACTOR",
    "PLAUSIBLE_MARGIN_S",
    "PLAUSIBLE_NODE_MARGIN_S",
    "ROUTES_KEPT",
    "SpeedChecks",
    "Verdict",
    "Work",
    "speed_ceilings",
]

# -- physical ceilings ---------------------------------------------------------------------------
# 50 TB/s: over twice the memory bandwidth of the fastest single accelerator of 2026 (~22 TB/s HBM4).
MAX_MEMORY_BANDWIDTH_BYTES_PER_S = 50e12
# 100 PFLOP/s: twice the 4-bit peak of the fastest single accelerator of 2026 (~50 PFLOP/s).
MAX_FLOPS = 100e15
MAX_BYTES_PER_PARAM = 4  # fp32: no weight format stores a parameter in more
# A transformer block of the smallest real models (~135M parameters in 30 blocks) holds ~1.7 MB at
# 4 bits: anything below this per layer is not a plausible weight size (0: the node did not say).
MIN_WEIGHT_BYTES_PER_LAYER = 1 << 20

# -- observed floors -----------------------------------------------------------------------------
PLAUSIBLE_FACTOR = 3.0  # observed steps up to 3x the claim are plausible (noise, load, verify chunks)
# Per step, on top: the gateway's own round trips to the head and from the tail, which no node
# measures and routing leaves out (they are the same for every route)...
PLAUSIBLE_MARGIN_S = 0.02
# ...and per node of the route: handling a step besides computing it (parsing, checking the ledger,
# forwarding), which a node's speed leaves out (it times compute calls only).
PLAUSIBLE_NODE_MARGIN_S = 0.01
MIN_JUDGED_STEPS = 8  # fewer decode steps time too noisily to judge anyone by
FLOOR_HALF_LIFE_S = 600.0
FLOOR_TTL_S = 6 * FLOOR_HALF_LIFE_S  # by then a floor is at 1/64 of its value: forgotten
# Seconds per decode position a report can floor one node at: a node this slow is already off every
# route that has an alternative, so a malicious gateway's report buys nothing more.
MAX_FLOOR_S = 10.0
MAX_FLOORS = 100_000  # nodes with a floor (and nodes with measured credit); the oldest go first
# Gateway-observed decode steps on plausible reports that end a node's probation: enough sessions
# (a chat answer is tens of steps) that one short lucky report does not do it.
MEASURED_STEPS = 64
ROUTES_KEPT = 100_000  # sessions whose route claims wait for their report; the oldest go first


class Work(Protocol):
    """One node's work for a session, as a billing report counts it (``db.BillingRow``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def decode_tokens(self) -> int: ...


def speed_ceilings(weight_bytes: int, layers: int) -> tuple[float, float]:
    """The fastest ``(prefill, decode)`` positions/s a node holding ``layers`` layers in
    ``weight_bytes`` of weights can physically reach (module docstring): finite and > 0."""
    weights = max(weight_bytes, MIN_WEIGHT_BYTES_PER_LAYER * max(1, layers))
    flops_per_position = 2.0 * weights / MAX_BYTES_PER_PARAM
    return MAX_FLOPS / flops_per_position, MAX_MEMORY_BANDWIDTH_BYTES_PER_S / weights


@dataclass(frozen=True, slots=True)
class Verdict:
    """One billing report judged: seconds per decode step observed, claimed, and the most that is
    plausible for that claim, and the floors of the route's nodes after it (node id -> seconds per
    decode position; 0: none)."""

    steps: float
    observed_step_s: float
    claimed_step_s: float
    plausible_step_s: float
    floors: Mapping[str, float]

    @property
    def plausible(self) -> bool:
        return self.observed_step_s <= self.plausible_step_s

    def as_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "observed_step_s": self.observed_step_s,
            "claimed_step_s": self.claimed_step_s,
            "plausible_step_s": self.plausible_step_s,
            "plausible": self.plausible,
            "decode_floor_s": dict(self.floors),
        }


@dataclass(slots=True)
class _Claims:
    """What a session's route claimed when it was chosen: seconds per decode position by node id
    (a node's fastest claim, across repairs), and seconds per step crossing its hops."""

    per_position_s: dict[str, float] = field(default_factory=dict)
    hops_s: float = 0.0


@dataclass(slots=True)
class _Floor:
    seconds: float
    at: float  # when it last changed

    def value(self, now: float) -> float:
        return self.seconds * math.pow(0.5, max(0.0, now - self.at) / FLOOR_HALF_LIFE_S)


class SpeedChecks:
    """Per-session route claims waiting for their report, and per-node observed floors (module docstring)."""

    def __init__(self, *, probation: bool = False) -> None:
        self._routes: OrderedDict[str, _Claims] = OrderedDict()
        self._floors: OrderedDict[str, _Floor] = OrderedDict()  # ordered by when each last changed
        self.probation = probation  # untrusted nodes serve on probation until measured (module docstring)
        self._credit: OrderedDict[str, float] = OrderedDict()  # node id -> steps on plausible reports

    # -- claims ----------------------------------------------------------------------------------
    def route_chosen(self, session_id: str, chain: Sequence[NodeRecord]) -> None:
        """``chain`` was pinned for ``session_id``: remember what its nodes claim now."""
        claims = _Claims({n.node_id: claimed_decode_s(n) for n in chain}, hop_latency_s(chain))
        self._routes[session_id] = claims
        self._routes.move_to_end(session_id)
        while len(self._routes) > ROUTES_KEPT:
            self._routes.popitem(last=False)

    def route_repaired(self, session_id: str, hop_ids: Sequence[str], live: Sequence[NodeRecord]) -> None:
        """A repair re-pinned ``session_id`` to ``hop_ids``: the claims of its new nodes (as ``live``
        has them: the repair chose them by these) join the snapshot. Its hop latency is the larger
        of the old and new route's: a report covers steps on both, and a larger claim judges milder."""
        claims = self._routes.get(session_id)
        if claims is None:
            return
        by_id = {n.node_id: n for n in live}
        chain = [by_id.get(i) for i in hop_ids]
        for node in chain:
            if node is not None:
                claimed = claimed_decode_s(node)
                claims.per_position_s[node.node_id] = min(claims.per_position_s.get(node.node_id, claimed), claimed)
        hops = sum(
            DEFAULT_HOP_LATENCY_MS / 1e3 if up is None or down is None else hop_latency_s((up, down))
            for up, down in itertools.pairwise(chain)
        )
        claims.hops_s = max(claims.hops_s, hops)

    # -- judging ---------------------------------------------------------------------------------
    def judge(self, session_id: str, rows: Sequence[Work], total_layers: int, decode_s: float) -> Verdict | None:
        """Judge the first billing report of ``session_id`` (its per-node ``rows`` of a model of
        ``total_layers`` layers, and the ``decode_s`` the gateway observed); ``None`` when it cannot
        be judged (no snapshot of its route's claims, too few decode steps)."""
        claims = self._routes.pop(session_id, None)
        decoded = [r for r in rows if r.decode_tokens > 0]
        if claims is None or not decoded or total_layers < 1 or not math.isfinite(decode_s) or decode_s < 0:
            return None
        # Every step runs through every layer once; a repair splits the steps of a layer range
        # between the nodes that served it, so the layer-weighted count is the route's steps.
        steps = sum(r.decode_tokens * r.n_layers for r in decoded) / total_layers
        if steps < MIN_JUDGED_STEPS:
            return None
        claimed_compute = sum(
            r.decode_tokens * claims.per_position_s.get(r.node_id, DEFAULT_DECODE_S_PER_LAYER * r.n_layers)
            for r in decoded
        )
        claimed = claimed_compute / steps + claims.hops_s
        nodes = sum(r.decode_tokens for r in decoded) / steps  # per step, on average across repairs
        limit = PLAUSIBLE_FACTOR * claimed + PLAUSIBLE_MARGIN_S + PLAUSIBLE_NODE_MARGIN_S * nodes
        observed = decode_s / steps
        plausible = observed <= limit
        now = time.time()
        self._expire(now)
        shares: dict[str, float] = {}
        compute = max(0.0, observed - claims.hops_s)
        for row in decoded:
            share = min(MAX_FLOOR_S, compute * row.n_layers / total_layers)
            shares[row.node_id] = max(shares.get(row.node_id, 0.0), share)
        for node_id, share in shares.items():
            if plausible:
                self._relax(node_id, now)
            else:
                self._raise(node_id, share, now)
        for row in decoded:
            if plausible:
                self._earn(row.node_id, row.decode_tokens)
            else:
                self._credit.pop(row.node_id, None)
        floors = {node_id: self.floor_s(node_id, now) for node_id in shares}
        return Verdict(steps, observed, claimed, limit, MappingProxyType(floors))

    def _raise(self, node_id: str, share: float, now: float) -> None:
        held = self._floors.pop(node_id, None)
        seconds = max(share, held.value(now) if held is not None else 0.0)
        self._floors[node_id] = _Floor(seconds, now)
        while len(self._floors) > MAX_FLOORS:
            self._floors.popitem(last=False)

    def failed(self, node_id: str) -> None:
        """``node_id`` was reported failed on a session's route: floored at ``MAX_FLOOR_S`` and back on
        probation, as after an implausible report (module docstring)."""
        now = time.time()
        self._expire(now)
        self._raise(node_id, MAX_FLOOR_S, now)
        self._credit.pop(node_id, None)

    def _earn(self, node_id: str, steps: int) -> None:
        self._credit[node_id] = self._credit.pop(node_id, 0.0) + steps
        while len(self._credit) > MAX_FLOORS:
            self._credit.popitem(last=False)

    def measured(self, node_id: str) -> bool:
        """Whether plausible reports credited ``node_id`` with ``MEASURED_STEPS`` decode steps since its
        last implausible report or failure."""
        return self._credit.get(node_id, 0.0) >= MEASURED_STEPS

    def _relax(self, node_id: str, now: float) -> None:
        held = self._floors.pop(node_id, None)
        if held is not None:
            self._floors[node_id] = _Floor(held.value(now) / 2, now)

    # -- reading ---------------------------------------------------------------------------------
    def floor_s(self, node_id: str, now: float | None = None) -> float:
        """``node_id``'s observed floor in seconds per decode position now (0: none)."""
        held = self._floors.get(node_id)
        if held is None:
            return 0.0
        now = time.time() if now is None else now
        return 0.0 if now - held.at > FLOOR_TTL_S else held.value(now)

    def apply(self, nodes: Sequence[NodeRecord]) -> list[NodeRecord]:
        """``nodes``, each with ``decode_floor_s`` set to its observed floor now, and (with
        ``probation``) ``probation`` set on each untrusted node not measured yet."""
        now = time.time()
        self._expire(now)
        if not self._floors and not self.probation:
            return list(nodes)
        return [self._judged(node, now) for node in nodes]

    def _judged(self, node: NodeRecord, now: float) -> NodeRecord:
        floor = self.floor_s(node.node_id, now)
        on_probation = self.probation and not node.trusted and not self.measured(node.node_id)
        if floor <= 0 and not on_probation:
            return node
        return replace(node, decode_floor_s=max(floor, 0.0), probation=on_probation)

    def _expire(self, now: float) -> None:
        while self._floors:
            node_id, held = next(iter(self._floors.items()))
            if now - held.at <= FLOOR_TTL_S:
                break
            del self._floors[node_id]
