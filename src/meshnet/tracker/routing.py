"""Route selection as a pure function over a snapshot of registered nodes.

A route is a chain of nodes serving one model whose layer ranges tile a span exactly (``[0,
total)`` for a fresh route, ``[a, b)`` when repairing a failed segment): the first node starts
at ``a``, each next node starts where the previous stopped, the last ends at ``b``.

Among the chains that exist, the one with the lowest *estimated time* for the request wins
(docs/tracker.md, "Route selection", derives every term)::

    cost = Σ_node [ (P - C)·prefill_s/token + D·decode_s/token    (the node's own work, "own")
                    + queue_depth · own                            (load: waits behind its queue)
                    + (1 - r)/r · (own + REPAIR_S)                 (expected retry cost, r = reliability)
                    + cold penalty + no-KV-room penalty ]
         + Σ_hop (D + 1) · RTT(upstream → downstream)

``decode_s/token`` is what the node's advertised speed implies (capped at its physical ceiling), or
the *observed floor* the tracker keeps for it when its routes decoded slower than their nodes claimed
(``tracker.plausibility``), whichever is larger; ``prefill_s/token`` is scaled by the same factor.

``C`` is the node's own *cached* positions: the leading blocks of the prompt it holds (its
advertised ``PrefixFilter`` or the tracker's ``prefix_held`` hint, protocol.prefix), at most
``P - 1`` (the last prompt position is always computed: its logits are needed). A chain reuses only
what every hop holds, so ``RouteChoice.cached_tokens`` is the minimum over its nodes; charging each
node its own ``C`` instead keeps the cost additive (the estimate is optimistic for a chain whose
nodes hold different amounts). A Bloom false positive only makes a route look warmer: the nodes'
own lookup finds the truth.

Every term is per node or per consecutive pair, so the cost is additive along the chain and a
dynamic programme over the nodes (state = a node: the hop cost depends on the pair) finds the
exact best chain and the exact ``k`` best alternatives. Costs are summed in integer nanoseconds,
so equal routes tie exactly and ties break deterministically: then by the most free KV at the
weakest hop, then by node ids.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from meshnet.errors import Overloaded
from meshnet.layers import LayerRange
from meshnet.protocol.prefix import PrefixFilter, matched_blocks

__all__ = [
    "COLD_READ_BYTES_PER_S",
    "COLD_START_S",
    "DEFAULT_DECODE_S_PER_LAYER",
    "DEFAULT_HOP_LATENCY_MS",
    "DEFAULT_PREFILL_S_PER_LAYER",
    "NO_KV_ROOM_PENALTY_S",
    "REPAIR_S",
    "Hardware",
    "NodeRecord",
    "RouteChoice",
    "RouteRequest",
    "claimed_decode_s",
    "hop_latency_s",
    "plan_route",
    "select_routes",
]

# -- defaults and penalties (docs/tracker.md explains each) ------------------------------------
# A hop nobody measured: a loopback-ish round trip. Pessimistic for one host, optimistic for a WAN,
# and the same for every unmeasured pair, so among unmeasured chains fewer hops still win.
DEFAULT_HOP_LATENCY_MS = 5.0
# A node that has not measured its speed yet (it self-benchmarks seconds after start): charged
# per layer it holds, as a slow CPU node would be (a 32-layer model at ~3 decode tokens/s), so a
# measured node is preferred and chains of unmeasured nodes cost the same whatever the split.
DEFAULT_PREFILL_S_PER_LAYER = 1e-3
DEFAULT_DECODE_S_PER_LAYER = 1e-2
# A node that has not computed anything lately pays for paging its weights back in: a fixed start
# plus its weight bytes at a modest disk read rate.
COLD_START_S = 0.25
COLD_READ_BYTES_PER_S = 1 << 30
# What a failure of one node costs besides redoing its work: noticing it, asking the tracker for a
# repair, re-prefilling the segment elsewhere.
REPAIR_S = 2.0
_MIN_RELIABILITY = 0.01  # caps the retry cost of a node that fails every time at 99 retries
# A node without KV room for the request would refuse it (StoreFull). It is not dropped: when every
# chain has such a node the best of them is still returned (its sessions may expire first), but one
# full node costs more than any plausible request, so any chain with room wins.
NO_KV_ROOM_PENALTY_S = 3600.0


@dataclass(frozen=True, slots=True)
class Hardware:
    """What a node says it runs on; informational (the route cost uses measured speeds instead)."""

    cpu: str | None = None
    logical_cores: int | None = None
    threads: int | None = None
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    gpu: str | None = None
    gpu_memory_bytes: int | None = None


_NO_LATENCY: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One live node as the tracker knows it (its latest heartbeat plus the tracker's own record).

    Speeds are positions per second of this node's layer range (0 = not measured yet);
    ``latency_ms`` maps the URLs of candidate next hops to the measured round trip.
    """

    node_id: str
    url: str
    model: str
    layers: LayerRange
    backend: str
    kv_bytes_free: int
    last_seen: float
    quantization: str | None = None
    hardware: Hardware = field(default_factory=Hardware)
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    queue_depth: int = 0
    kv_bytes_per_token: int = 0
    latency_ms: Mapping[str, float] = field(default_factory=lambda: _NO_LATENCY, hash=False)
    warm: bool = False
    weight_bytes: int = 0
    reliability: float = 1.0
    manifest: str | None = None
    files: tuple[str, ...] = ()
    bt_peer: str | None = None  # HOST:PORT where it seeds ``files`` over BitTorrent
    numerics: str | None = None  # what decides the low bits of its results (None: unknown)
    wire_dtype: str = "float32"  # the dtype of the activations it sends onward
    hop_key: str | None = None  # the key its answer entries are signed with (protocol.signing)
    architecture: str | None = None  # GGUF general.architecture (None: an older node did not say)
    seam: tuple[int, ...] | None = None  # per-position shape of what crosses its seams
    max_verify: int = 0  # drafted positions one verify chunk may add (speculative decoding)
    # What it runs (docs/tracker.md, "One model identity per route"): the manifest digest of a
    # published model, or a GGUF's content identity (artifacts.identity); None: an older node did not
    # say. A chain joins only nodes of one identity.
    identity: str | None = None
    max_positions: int = 0  # positions one session may hold on it (its context); 0: it did not say
    trained_context: int = 0  # the model's trained context (GGUF {arch}.context_length); 0: not said
    # The trust tier of its member certificate, read by a private swarm's tracker from the TLS
    # handshake of its registration (never from what it claims); a node of an open swarm is untrusted.
    trusted: bool = False
    # The prompt blocks in its prefix cache, as its latest heartbeat advertised them (None: none).
    prefix_filter: PrefixFilter | None = field(default=None, hash=False, compare=False)
    # Blocks the tracker knows it took since that heartbeat (a session through it closed): the
    # next turn of a conversation, asked for right after the previous answer, finds its warm route.
    prefix_held: frozenset[bytes] = field(default=frozenset(), hash=False, compare=False)
    # The fastest its weights allow (tracker.plausibility.speed_ceilings, set by the tracker at
    # registration): routes use the advertised speed capped at it. inf: no ceiling computed.
    prefill_tps_ceiling: float = math.inf
    decode_tps_ceiling: float = math.inf
    # Seconds per decode position its routes were observed to take, its layer share of them
    # (tracker.plausibility.SpeedChecks): routes charge at least this. 0: no floor.
    decode_floor_s: float = 0.0
    # Untrusted and not measured yet (tracker.plausibility, "Probation"): its claims buy nothing, and
    # it heads a route only when no other node can.
    probation: bool = False
    # An auditor (tracker.audits): it re-executes audited hops for gateways and never serves a route.
    auditor: bool = False
    # Why a failed audit suspended it (tracker.audits; None: it is not): listed, never routed.
    suspended: str | None = None

    @property
    def routable(self) -> bool:
        """Whether routes, repairs, standbys and placement may count on it: no auditor, not suspended."""
        return not self.auditor and self.suspended is None

    @property
    def prefill_tps_used(self) -> float:
        """The prefill speed routes use: the advertised one, capped at the physical ceiling (0: not measured)."""
        return min(self.prefill_tps, self.prefill_tps_ceiling)

    @property
    def decode_tps_used(self) -> float:
        """The decode speed routes use: the advertised one, capped at the physical ceiling (0: not measured)."""
        return min(self.decode_tps, self.decode_tps_ceiling)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request a route is chosen for: how many positions it prefills and decodes, and the chained
    hashes of its prompt's leading ``prefix_block``-token blocks (protocol.prefix; empty: not known)."""

    prefill_tokens: int = 512
    decode_tokens: int = 256
    prefix_block: int = 0
    prefix: tuple[bytes, ...] = ()
    # Positions every node of the route must hold for one session (prompt + max_tokens): a node whose
    # per-session context is smaller is never chosen. 0: the caller did not say, nothing is filtered.
    positions: int = 0


@dataclass(frozen=True, slots=True)
class RouteChoice:
    nodes: tuple[NodeRecord, ...]
    estimated_s: float  # the estimated time of the request on this route
    breakdown: Mapping[str, float]  # prefill_s, decode_s, hop_latency_s and the penalties, summing to it
    cached_tokens: int  # prompt positions every node of it holds: what the route may reuse


def plan_route(nodes: Sequence[NodeRecord], model: str, total_layers: int | None = None) -> list[NodeRecord]:
    """The best chain of ``nodes`` covering every layer of ``model``; ``Overloaded`` if none exists."""
    return list(select_routes(nodes, model, total_layers, k=1)[0].nodes)


def select_routes(
    nodes: Sequence[NodeRecord],
    model: str,
    total_layers: int | None = None,
    *,
    request: RouteRequest = RouteRequest(),
    exclude: Collection[str] = (),
    span: tuple[int, int] | None = None,
    k: int = 3,
) -> list[RouteChoice]:
    """Up to ``k`` chains covering ``span`` (default: every layer), best first.

    ``total_layers``, when the caller knows it (the gateway reads it from the GGUF), rules out nodes
    that registered the model with another layer count. ``exclude`` names nodes to avoid (ones that
    just failed). Raises ``Overloaded`` saying where coverage breaks when no chain exists.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    serving = [n for n in nodes if n.model == model]
    candidates = [n for n in serving if n.routable]  # auditors and suspended nodes never serve a route
    if not candidates:
        held_back = f" ({len(serving)} auditor or suspended node(s) never serve routes)" if serving else ""
        raise Overloaded(f"no node serves model {model!r} right now{held_back}", retry_after_s=5)
    if total_layers is not None:
        matching = [n for n in candidates if n.layers.total == total_layers]
        if not matching:
            counts = sorted({n.layers.total for n in candidates})
            raise Overloaded(
                f"the nodes serving {model!r} report {counts} layers, not the {total_layers} asked for",
                retry_after_s=5,
            )
        candidates = matching
    if exclude:
        skip = set(exclude)
        kept = [n for n in candidates if n.node_id not in skip]
        if not kept:
            raise Overloaded(
                f"no node serves model {model!r} right now besides the {len(candidates)} excluded", retry_after_s=5
            )
        candidates = kept
    candidates, short = _with_room(candidates, request.positions)
    if not candidates:
        raise Overloaded(_room_message(short, model, request.positions), retry_after_s=5)
    # A chain only joins nodes that agree on the layer count and on the model identity. Which is
    # "right" is not the tracker's to know (one misconfigured node must not hide a complete chain
    # that registered after it), so every group is planned on its own and the best chains of all
    # groups compete: a requantized copy under the same model id is never chained into another's route.
    found: list[_Partial] = []
    for total, identity in sorted({_group(n) for n in candidates}, key=lambda g: (g[0], g[1] or "")):
        a, b = span if span is not None else (0, total)
        if 0 <= a < b <= total:
            inside = [n for n in candidates if a <= n.layers.start and n.layers.stop <= b]
            group = [n for n in inside if _group(n) == (total, identity)]
            found += _k_best(group, a, b, request, k)
    if not found:
        mixed = _identities_note(candidates)
        why = f"no nodes of one model identity cover {model!r}{mixed}" if mixed else ""
        why = why or _gap_message(candidates, model, span)
        if short:
            why += "; " + _room_message(short, model, request.positions)
        raise Overloaded(why, retry_after_s=5)
    return [_choice(_unlink(p), request) for p in heapq.nsmallest(k, found)]


def _group(node: NodeRecord) -> tuple[int, str | None]:
    return node.layers.total, node.identity


def _with_room(nodes: Sequence[NodeRecord], positions: int) -> tuple[list[NodeRecord], list[NodeRecord]]:
    """(the nodes whose per-session context holds ``positions``, the ones whose does not). A node
    that did not say its context (0) is kept: an older node refuses past its cap itself."""
    if positions <= 0:
        return list(nodes), []
    roomy = [n for n in nodes if n.max_positions <= 0 or n.max_positions >= positions]
    return roomy, [n for n in nodes if 0 < n.max_positions < positions]


def _room_message(short: Sequence[NodeRecord], model: str, positions: int) -> str:
    most = max(short, key=lambda n: (n.max_positions, n.node_id))
    return (
        f"no route of {model!r} has room for {positions:,} positions per session (prompt + max_tokens): "
        f"{len(short)} node(s) hold fewer (the most: {most.max_positions:,} on node {most.node_id}, layers "
        f"{most.layers}); lower max_tokens or shorten the prompt, or retry when a node with a larger context joins"
    )


def _identities_note(candidates: Sequence[NodeRecord]) -> str:
    """Why a complete cover may still be no route: nodes of different model identities never chain."""
    by_identity: dict[str | None, list[str]] = {}
    for node in sorted(candidates, key=lambda n: (n.layers.start, n.layers.stop, n.node_id)):
        by_identity.setdefault(node.identity, []).append(f"{node.node_id} [{node.layers}]")
    if len(by_identity) < 2:
        return ""
    groups = "; ".join(
        f"{_short(identity)} ({_quantizations(candidates, identity)}): {', '.join(held)}"
        for identity, held in sorted(by_identity.items(), key=lambda kv: kv[0] or "")
    )
    return f": nodes of different model identities are never chained into one route ({groups})"


def _short(identity: str | None) -> str:
    return "identity unknown" if identity is None else f"identity {identity[:28]}"


def _quantizations(candidates: Sequence[NodeRecord], identity: str | None) -> str:
    found = sorted({n.quantization or "?" for n in candidates if n.identity == identity})
    return "/".join(found)


# -- the dynamic programme ----------------------------------------------------------------------
# A partial route: a chain from some node to the span's end, as a linked list sharing suffixes.
# Ordered by (cost in ns, -(free KV at its weakest node), node ids head first as nested tuples):
# nested tuples compare like the flat id tuple but are built in O(1). Ids are unique, so the
# comparison never reaches the node itself.
_Partial = tuple[int, int, tuple[Any, ...], "NodeRecord", Any]


def _k_best(nodes: Sequence[NodeRecord], a: int, b: int, request: RouteRequest, k: int) -> list[_Partial]:
    """The ``k`` cheapest chains tiling ``[a, b)`` out of ``nodes`` (all of one layer count)."""
    by_start: dict[int, list[NodeRecord]] = {}
    for node in nodes:
        by_start.setdefault(node.layers.start, []).append(node)
    hop_runs = request.decode_tokens + 1  # every decode step and the final prefill chunk cross each hop
    default_hop = round(DEFAULT_HOP_LATENCY_MS * 1e6 * hop_runs)
    # suffixes[s]: the k best chains to b of every node starting at s, pooled and sorted, and the
    # same chains by the URL of their first node.
    suffixes: dict[int, _Suffixes] = {}
    for start in sorted(by_start, reverse=True):
        pooled: list[_Partial] = []
        by_url: dict[str, list[_Partial]] = {}
        for node in by_start[start]:
            own = _cost_ns(node, request)
            stop = node.layers.stop
            if stop == b:
                mine = [(own, -node.kv_bytes_free, (node.node_id, ()), node, None)]
            elif stop in suffixes:
                mine = _extend(node, own, suffixes[stop], hop_runs=hop_runs, default_hop=default_hop, k=k)
            else:
                continue  # nothing continues from where this node stops
            pooled += mine
            by_url.setdefault(node.url, []).extend(mine)
        if pooled:
            pooled.sort()
            suffixes[start] = _Suffixes(pooled, by_url)
    if a not in suffixes:
        return []
    chains = suffixes[a].pooled
    if a == 0:  # probation: a node on probation heads no route while another head can make one
        chains = [p for p in chains if not p[3].probation] or chains
    return chains[:k]


@dataclass(frozen=True, slots=True)
class _Suffixes:
    pooled: list[_Partial]
    by_url: dict[str, list[_Partial]]


def _extend(node: NodeRecord, own: int, after: _Suffixes, *, hop_runs: int, default_hop: int, k: int) -> list[_Partial]:
    """``node``'s k best chains: itself, one hop, then one of the chains in ``after``.

    Next hops this node has measured pay their measured latency; every other next hop pays the
    default, so the cheapest of those are simply the first chains of ``after.pooled`` (sorted)
    whose first node was not measured: O(k + measured) per node instead of O(next hops).
    """
    options: list[_Partial] = []
    measured: set[str] = set()
    for url, ms in node.latency_ms.items():
        found = after.by_url.get(url)
        if found:
            measured.add(url)
            hop = round(max(0.0, ms) * 1e6 * hop_runs)
            options += [_prepend(node, own + hop, p) for p in found]
    taken = 0
    for partial in after.pooled:
        if taken == k:
            break
        if partial[3].url in measured:
            continue
        options.append(_prepend(node, own + default_hop, partial))
        taken += 1
    return heapq.nsmallest(k, options)


def _prepend(node: NodeRecord, cost: int, rest: _Partial) -> _Partial:
    return (cost + rest[0], max(rest[1], -node.kv_bytes_free), (node.node_id, rest[2]), node, rest)


def _unlink(partial: _Partial) -> tuple[NodeRecord, ...]:
    chain = []
    at: _Partial | None = partial
    while at is not None:
        chain.append(at[3])
        at = at[4]
    return tuple(chain)


# -- the cost model -----------------------------------------------------------------------------
def claimed_decode_s(node: NodeRecord) -> float:
    """Seconds per decode position that ``node``'s advertisement implies, before any observed floor:
    its capped decode speed, or the per-layer default when it has not measured one. Always > 0."""
    tps = node.decode_tps_used
    return 1.0 / tps if tps > 0 else DEFAULT_DECODE_S_PER_LAYER * len(node.layers)


def _node_terms(node: NodeRecord, request: RouteRequest) -> dict[str, float]:
    """One node's share of the estimated time, by term, in seconds."""
    layers = len(node.layers)
    tps = node.prefill_tps_used
    prefill_per = 1.0 / tps if tps > 0 else DEFAULT_PREFILL_S_PER_LAYER * layers
    claimed = claimed_decode_s(node)
    if node.probation:  # its claims buy nothing until it is measured: charged as an unmeasured node at most
        prefill_per = max(prefill_per, DEFAULT_PREFILL_S_PER_LAYER * layers)
        claimed = max(claimed, DEFAULT_DECODE_S_PER_LAYER * layers)
    decode_per = max(claimed, node.decode_floor_s)
    # A node whose routes decoded slower than it claimed is taken to overstate its prefill speed by
    # the same factor (one self-benchmark measured both; the tracker observes only decode):
    # otherwise a liar's prefill claim would still win every prompt-heavy request once floored.
    prefill_per *= decode_per / claimed
    prefill_s = (request.prefill_tokens - _cached_tokens(node, request)) * prefill_per
    decode_s = request.decode_tokens * decode_per
    own = prefill_s + decode_s
    reliability = min(1.0, max(_MIN_RELIABILITY, node.reliability))
    need = (request.prefill_tokens + request.decode_tokens) * node.kv_bytes_per_token
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        # Compute is serialized per node: each request ahead of ours delays each of our steps by
        # about one of its own steps, so ``queue_depth`` requests stretch our work (1 + depth)-fold.
        "load_penalty_s": max(0, node.queue_depth) * own,
        # Geometric retries: a node that completes with probability r is tried 1/r times on
        # average; each extra try redoes its work and pays a repair.
        "reliability_penalty_s": (1.0 - reliability) / reliability * (own + REPAIR_S),
        "cold_penalty_s": 0.0 if node.warm else COLD_START_S + node.weight_bytes / COLD_READ_BYTES_PER_S,
        # kv_bytes_per_token 0 means the node did not say; it is not held against it.
        "kv_penalty_s": NO_KV_ROOM_PENALTY_S if node.kv_bytes_free < need else 0.0,
    }


def _cached_tokens(node: NodeRecord, request: RouteRequest) -> int:
    """The prompt positions ``node`` would not prefill: its leading blocks of the prompt, at most all
    but the last position. Held by its filter or by the tracker's hint, whichever reaches further
    (each is a run of leading blocks the node holds)."""
    if not request.prefix or request.prefix_block < 1 or request.prefill_tokens < 2:
        return 0
    blocks = matched_blocks(request.prefix, node.prefix_held)
    if node.prefix_filter is not None:
        blocks = max(blocks, matched_blocks(request.prefix, node.prefix_filter))
    return min(blocks * request.prefix_block, request.prefill_tokens - 1)


def _cost_ns(node: NodeRecord, request: RouteRequest) -> int:
    return round(sum(_node_terms(node, request).values()) * 1e9)


def _hop_ms(upstream: NodeRecord, downstream: NodeRecord) -> float:
    ms = upstream.latency_ms.get(downstream.url)
    return DEFAULT_HOP_LATENCY_MS if ms is None else max(0.0, ms)


def hop_latency_s(chain: Sequence[NodeRecord]) -> float:
    """Seconds one decode step spends crossing ``chain``'s hops, as routing estimates them."""
    return sum(_hop_ms(up, down) for up, down in itertools.pairwise(chain)) / 1e3


def _choice(chain: tuple[NodeRecord, ...], request: RouteRequest) -> RouteChoice:
    breakdown: dict[str, float] = {}
    total_ns = 0
    for node in chain:
        for term, seconds in _node_terms(node, request).items():
            breakdown[term] = breakdown.get(term, 0.0) + seconds
        total_ns += _cost_ns(node, request)
    hop_runs = request.decode_tokens + 1
    hops_ns = [round(_hop_ms(up, down) * 1e6 * hop_runs) for up, down in itertools.pairwise(chain)]
    breakdown["hop_latency_s"] = sum(hops_ns) / 1e9
    total_ns += sum(hops_ns)
    cached = min(_cached_tokens(node, request) for node in chain)
    return RouteChoice(chain, total_ns / 1e9, MappingProxyType(breakdown), cached)


def route_cost_ns(chain: Sequence[NodeRecord], request: RouteRequest = RouteRequest()) -> int:
    """The cost ``select_routes`` minimizes, of any chain, in integer nanoseconds (for tests and tools)."""
    hop_runs = request.decode_tokens + 1
    hops = sum(round(_hop_ms(up, down) * 1e6 * hop_runs) for up, down in itertools.pairwise(chain))
    return sum(_cost_ns(n, request) for n in chain) + hops


# -- explaining a failure -----------------------------------------------------------------------
def _gap_message(candidates: Sequence[NodeRecord], model: str, span: tuple[int, int] | None = None) -> str:
    """Say where the chain breaks, for the layer count most of the model's nodes report."""
    counts: dict[int, int] = {}
    for node in candidates:
        counts[node.layers.total] = counts.get(node.layers.total, 0) + 1
    total = max(counts, key=lambda t: (counts[t], t))
    a, b = span if span is not None else (0, total)
    ranges = [n.layers for n in candidates if n.layers.total == total and a <= n.layers.start and n.layers.stop <= b]
    gap = None
    covered = a  # layers [a, covered) are served by some node (interval sweep: totals can be large)
    for r in sorted(ranges, key=lambda r: r.start):
        if r.start > covered:
            gap = (covered, r.start)
            break
        covered = max(covered, r.stop)
    if gap is None and covered < b:
        gap = (covered, b)
    if gap is not None:
        why = f"no node serves layers {gap[0]}:{gap[1]}"
    else:
        # Every layer is served, but the ranges do not tile: follow the chain from layer a to where it stops.
        reach, frontier = {a}, [a]
        while frontier:
            at = frontier.pop()
            for r in ranges:
                if r.start == at and r.stop not in reach:
                    reach.add(r.stop)
                    frontier.append(r.stop)
        why = f"no node starts at layer {max(reach)}, where the chain from layer {a} ends"
    have = ", ".join(str(r) for r in sorted(ranges, key=lambda r: (r.start, r.stop))) or "none"
    others = sum(1 for n in candidates if n.layers.total != total)
    ignored = f"; {others} node(s) reporting another layer count ignored" if others else ""
    return f"the nodes serving {model!r} do not cover layers {a}:{b}: {why} (have {have}){ignored}"
