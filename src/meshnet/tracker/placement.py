"""Automatic placement as pure functions over a snapshot: which layer range a joining node should
serve, and whether a serving node should move to a hole (docs/tracker.md, "Placement").

The anchor is Petals' block selection: the throughput of a layer is the sum of the throughputs of
the nodes that serve it, and a node goes where the swarm is weakest. Meshnet adds two things Petals
does not need: layer ranges may only start and stop at allowed boundaries (a published manifest's
file boundaries, a model family's cut rules), and a node's size is its *memory*, so the layers it
can hold depend on where it starts (the head also holds the embedding table, the tail the lm_head).

``choose_range(ask, holders)``:

1. **Uncovered layers first.** The largest run of layers nobody serves (nor holds a reservation
   for), the lowest such run on a tie. A node that cannot hold the whole run takes an *even share*
   of it from its start: ``ceil(H / ceil(H / C))`` layers, ``H`` the run's length and ``C`` what
   the node can hold there, snapped to the nearest allowed boundary. Nodes of one size then split
   a hole evenly (``meshnet up``'s equal split) instead of leaving a sliver for the last one, and a
   route through the hole has hops of equal work. A node that can hold the whole run takes exactly
   the run: it restores coverage with the least to fetch and load.
2. **Then the span with the least throughput**: from every allowed start, the longest range the
   node can hold; the one whose layers' throughputs, sorted ascending, are lexicographically the
   smallest wins (the weakest layer first, then the next weakest), the longer one on a tie, then
   the lower start. Petals' rule, with ranges of different lengths compared as if the shorter one
   were padded with infinitely strong layers.

``choose_move(ask, me, holders)``: a node may leave its range for a hole only when every one of its
layers is also served by another live node (it takes no coverage away) and the range it would get
covers uncovered layers. Timing (how long a hole must last, one move at a time, cooldowns) is the
caller's: ``tracker.placement_api``.

A node's throughput is positions per second through its range, as routing charges it (its
measured decode speed capped at its ceiling, its observed floor, the unmeasured default otherwise);
a reservation counts as an unmeasured node of its range, so two nodes asking at the same moment do
not both take the same hole. Everything here is deterministic in its inputs: holders are summed in
node-id order, ties break by position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.errors import InvalidRequest
from meshnet.layers import LayerRange
from meshnet.tracker.routing import DEFAULT_DECODE_S_PER_LAYER, NodeRecord, claimed_decode_s

__all__ = [
    "LEAST_THROUGHPUT",
    "UNCOVERED",
    "Ask",
    "Holder",
    "Placement",
    "choose_move",
    "choose_range",
    "coverage",
    "holes",
    "layer_throughputs",
    "node_throughput",
    "reserved_throughput",
]

UNCOVERED = "uncovered"
LEAST_THROUGHPUT = "least_throughput"
PLACEMENT_DOES_NOT_FIT = "placement_does_not_fit"


@dataclass(frozen=True, slots=True)
class Ask:
    """What a node can hold: bytes per layer (weights plus the KV budget of its sessions), the extra
    bytes of the head (embedding table) and of the tail (final norm and lm_head), bytes any range
    costs, its memory budget, and where its ranges may start and stop."""

    total_layers: int
    layer_bytes: tuple[int, ...]
    budget_bytes: int
    boundaries: tuple[int, ...]  # sorted, unique, from 0 to total_layers
    head_bytes: int = 0
    tail_bytes: int = 0
    base_bytes: int = 0
    max_layers: int | None = None  # a cap besides memory (Petals' --num_blocks)

    def __post_init__(self) -> None:
        total = self.total_layers
        if total < 1 or len(self.layer_bytes) != total:
            raise InvalidRequest(
                f"layer_bytes has {len(self.layer_bytes)} entries for {total} layers", param="layer_bytes"
            )
        if min((*self.layer_bytes, self.head_bytes, self.tail_bytes, self.base_bytes, self.budget_bytes)) < 0:
            raise InvalidRequest("byte counts are 0 or more", param="layer_bytes")
        bounds = self.boundaries
        if list(bounds) != sorted(set(bounds)) or not bounds or bounds[0] != 0 or bounds[-1] != total:
            raise InvalidRequest(
                f"boundaries must rise strictly from 0 to {total}, got {list(bounds)[:8]}", param="boundaries"
            )
        if self.max_layers is not None and self.max_layers < 1:
            raise InvalidRequest("max_layers is at least 1", param="max_layers")

    def cost(self, start: int, stop: int) -> int:
        """Bytes the range ``[start, stop)`` takes on this node."""
        extra = (self.head_bytes if start == 0 else 0) + (self.tail_bytes if stop == self.total_layers else 0)
        return self.base_bytes + sum(self.layer_bytes[start:stop]) + extra

    def fits(self, start: int, stop: int) -> bool:
        if self.max_layers is not None and stop - start > self.max_layers:
            return False
        return self.cost(start, stop) <= self.budget_bytes

    def stops(self, start: int) -> list[int]:
        """The allowed stops of a range from ``start`` that this node can hold, ascending."""
        return [b for b in self.boundaries if b > start and self.fits(start, b)]


@dataclass(frozen=True, slots=True)
class Holder:
    """A node serving ``layers`` (or reserved to), at ``throughput`` positions/s through them."""

    node_id: str
    layers: LayerRange
    throughput: float
    live: bool = True  # False: a reservation, not serving yet


@dataclass(frozen=True, slots=True)
class Placement:
    layers: LayerRange
    reason: str  # UNCOVERED or LEAST_THROUGHPUT
    detail: str  # one sentence for logs and for the node's operator


# -- the snapshot ---------------------------------------------------------------------------------
def node_throughput(node: NodeRecord) -> float:
    """Positions/s through ``node``'s range as routing charges it: > 0 for every node."""
    return 1.0 / max(claimed_decode_s(node), node.decode_floor_s)


def reserved_throughput(layers: LayerRange) -> float:
    """A reservation counts as a node that has not measured its speed yet (routing's default)."""
    return 1.0 / (DEFAULT_DECODE_S_PER_LAYER * len(layers))


def coverage(holders: Sequence[Holder], total: int, *, live_only: bool = False) -> list[int]:
    """How many holders serve each layer."""
    counts = [0] * total
    for h in holders:
        if h.live or not live_only:
            for i in range(h.layers.start, h.layers.stop):
                counts[i] += 1
    return counts


def layer_throughputs(holders: Sequence[Holder], total: int) -> list[float]:
    """Positions/s through each layer: the sum over its holders, added in node-id order so the
    same snapshot always gives the same floats (a different sum order could flip a near tie)."""
    out = [0.0] * total
    for h in sorted(holders, key=lambda h: (h.node_id, h.layers.start)):
        for i in range(h.layers.start, h.layers.stop):
            out[i] += h.throughput
    return out


def holes(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, stop)`` of layers with no holder, in layer order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, n in enumerate((*counts, 1)):
        if n == 0 and start is None:
            start = i
        elif n != 0 and start is not None:
            runs.append((start, i))
            start = None
    return runs


# -- the decisions --------------------------------------------------------------------------------
def choose_range(ask: Ask, holders: Sequence[Holder]) -> Placement:
    """The range a node that can hold ``ask`` should serve, given who serves what (``holders``:
    every live node and reservation of the model but the asking node's own)."""
    total = ask.total_layers
    if not any(ask.stops(a) for a in ask.boundaries[:-1]):
        smallest = min(ask.cost(a, b) for a, b in zip(ask.boundaries, ask.boundaries[1:], strict=False))
        raise InvalidRequest(
            f"no layer range fits this node: the smallest allowed range needs {smallest / 2**30:.3f} GiB "
            f"(weights and KV budget), the node offers {ask.budget_bytes / 2**30:.3f} GiB; give it more memory "
            "(--memory-gb), fewer sessions (--max-sessions) or a shorter context (--ctx)",
            param="budget_bytes",
            code=PLACEMENT_DOES_NOT_FIT,
        )
    counts, speeds = coverage(holders, total), layer_throughputs(holders, total)
    runs = holes(counts)
    if runs:
        return _fill_hole(ask, counts, speeds, max(runs, key=lambda r: (r[1] - r[0], -r[0])))
    return _least_throughput(ask, speeds)


def choose_move(ask: Ask, me: Holder, holders: Sequence[Holder]) -> Placement | None:
    """Where node ``me`` should move, or ``None``: only to a hole, and only when each of its layers
    is also served by another *live* node (``holders`` excludes ``me``; reservations do not count
    as serving, so two nodes never leave one range for the same reason)."""
    total = ask.total_layers
    others = [h for h in holders if h.node_id != me.node_id]
    live = coverage(others, total, live_only=True)
    if any(live[i] == 0 for i in range(me.layers.start, me.layers.stop)):
        return None
    if not holes(coverage(others, total)):
        return None
    try:
        target = choose_range(ask, others)
    except InvalidRequest:
        return None
    if target.reason != UNCOVERED or target.layers == me.layers:
        return None
    return Placement(target.layers, UNCOVERED, f"{target.detail}; its layers {me.layers} stay served by other nodes")


def _fill_hole(ask: Ask, counts: Sequence[int], speeds: Sequence[float], hole: tuple[int, int]) -> Placement:
    h0, h1 = hole
    total = ask.total_layers
    starts = [a for a in ask.boundaries[:-1] if a <= h0 and ask.stops(a) and ask.stops(a)[-1] > h0]
    if not starts:
        return _most_uncovered(ask, counts, speeds, hole)
    start = max(starts)  # the least overlap with layers already served
    stops = ask.stops(start)
    # Uncovered layers of this hole each stop would take; C = the most this node can take.
    taken = {b: min(b, h1) - h0 for b in stops if b > h0}
    size = h1 - h0
    capacity = max(taken.values())
    if capacity >= size:
        stop = min(b for b, n in taken.items() if n == size)
        share = f"all {size} of them"
    else:
        nodes = math.ceil(size / capacity)
        want = math.ceil(size / nodes)
        stop = min(taken, key=lambda b: (abs(taken[b] - want), b))
        share = f"{taken[stop]} of them (an even share: {nodes} nodes of this size cover {size} layers)"
    layers = LayerRange(start, stop, total)
    return Placement(layers, UNCOVERED, f"layers {h0}:{h1} are served by no node; this node takes {share}")


def _most_uncovered(ask: Ask, counts: Sequence[int], speeds: Sequence[float], hole: tuple[int, int]) -> Placement:
    """No range the node can hold covers the hole's first layer (the head's table is too big for it,
    say): the range covering the most uncovered layers anywhere, the lowest on a tie."""
    best: tuple[int, int, int] | None = None  # (-uncovered, start, stop)
    for a in ask.boundaries[:-1]:
        for b in ask.stops(a):
            key = (-sum(1 for i in range(a, b) if counts[i] == 0), a, b)
            best = key if best is None or key < best else best
    assert best is not None  # choose_range checked that some range fits
    uncovered, a, b = -best[0], best[1], best[2]
    if uncovered == 0:  # nothing it can hold touches a hole: help where the swarm is weakest instead
        return _least_throughput(ask, speeds)
    return Placement(
        LayerRange(a, b, ask.total_layers),
        UNCOVERED,
        f"layers {hole[0]}:{hole[1]} are served by no node; this node can hold none that starts at layer "
        f"{hole[0]}, so it takes the range covering the most uncovered layers ({uncovered})",
    )


def _least_throughput(ask: Ask, throughputs: Sequence[float]) -> Placement:
    total = ask.total_layers
    longest = max(b - a for a in ask.boundaries[:-1] for b in ask.stops(a)[-1:])
    best: tuple[tuple[float, ...], int, int] | None = None
    for a in ask.boundaries[:-1]:
        stops = ask.stops(a)
        if not stops:
            continue
        b = stops[-1]  # the longest range from a: more layers, more throughput added
        weakest = tuple(sorted(throughputs[a:b])) + (math.inf,) * (longest - (b - a))
        key = (weakest, -(b - a), a)
        if best is None or key < (best[0], -(best[2] - best[1]), best[1]):
            best = (weakest, a, b)
    assert best is not None
    _, a, b = best
    layers = LayerRange(a, b, total)
    low = min(throughputs[a:b])
    return Placement(
        layers,
        LEAST_THROUGHPUT,
        f"every layer is served; layers {layers} have the least throughput ({low:.3g} positions/s at the weakest)",
    )
