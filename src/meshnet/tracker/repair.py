"""Route repair as a pure function: which hops of a pinned route to replace, and with what.

A hop failed mid-decode. Every other hop still holds the session's KV, so the cheapest repair
replaces the smallest run of consecutive hops that contains the failed one and that live nodes
can cover exactly (same layer boundaries at both ends, so the surviving hops on either side keep
their KV and their seams). The node just upstream of the replaced run then replays its seam log
into the replacements (the gateway replays token ids when the run starts at the head), so a run
that leaves the head in place is preferred among runs of one length: it needs no token replay
and keeps the embedding lookup where it was.

Example, route A[0:10) → B[10:20) → C[20:30), C fails, spare S[10:30) is live and no other node
serves 20:30: the run {C} has no cover, the run {B, C} is covered by S → B and C are replaced by S,
A replays its log into S.

A repair must not change the text, so only *numerically equivalent* replacements qualify
(``equivalent_nodes``): every layer must be computed by a node with the same ``numerics`` as the
hop that computed it before (library, processor, threads: they decide the low bits of the KV and
of the activations), and a seam that rounded the activations (a bfloat16 or float16 wire) must stay
where it was, in the same dtype — only exact float32 seams may move or merge. Without an
equivalent node the repair is refused with the reason, never made inexact.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from meshnet.errors import Overloaded
from meshnet.layers import LayerRange
from meshnet.tracker.routing import NodeRecord, RouteRequest, select_routes

__all__ = ["EXACT_WIRE", "PinnedHop", "Repair", "equivalent_nodes", "plan_repair"]


EXACT_WIRE = "float32"


@dataclass(frozen=True, slots=True)
class PinnedHop:
    node_id: str
    layers: LayerRange
    numerics: str | None = None
    wire_dtype: str = EXACT_WIRE
    identity: str | None = None  # the model identity it runs: a replacement runs the same


@dataclass(frozen=True, slots=True)
class Repair:
    first: int  # index (in the old route) of the first replaced hop
    removed: int  # how many old hops the replacement takes the place of
    nodes: tuple[NodeRecord, ...]  # the replacement hops, in route order

    def apply(self, route: Sequence[PinnedHop]) -> list[PinnedHop | NodeRecord]:
        return [*route[: self.first], *self.nodes, *route[self.first + self.removed :]]


def plan_repair(
    route: Sequence[PinnedHop],
    failed: str,
    live: Sequence[NodeRecord],
    model: str,
    *,
    request: RouteRequest | None = None,
    exclude: Collection[str] = (),
) -> Repair:
    """The smallest run of hops around ``failed`` that live nodes (not in ``exclude``) can replace.

    Raises ``Overloaded`` naming the failed hop's layers when nothing can replace it.
    """
    index = next((i for i, hop in enumerate(route) if hop.node_id == failed), None)
    if index is None:
        raise ValueError(f"node {failed} is not on this route")
    total = route[0].layers.total
    runs = [(i, j) for i in range(index + 1) for j in range(index + 1, len(route) + 1)]
    runs.sort(key=lambda run: (run[1] - run[0], run[0] == 0, run[0]))
    first_error: Overloaded | None = None
    for i, j in runs:
        # The surviving hops keep their place; nothing on the route may serve twice.
        skip = {*exclude, failed, *(hop.node_id for hop in route)}
        span = (route[i].layers.start, route[j - 1].layers.stop)
        fits = equivalent_nodes(route[i:j], live)
        if not fits:
            first_error = first_error or Overloaded(
                f"no live node computes layers {span[0]}:{span[1]} bit-identically to the failed route "
                "(same library, processor, threads and lossy seams)"
            )
            continue
        try:
            choice = select_routes(fits, model, total, request=request or RouteRequest(), exclude=skip, span=span, k=1)[
                0
            ]
        except Overloaded as exc:
            first_error = first_error or exc
            continue
        return Repair(i, j - i, choice.nodes)
    why = first_error.message if first_error is not None else "no live node"
    raise Overloaded(
        f"no live node can take over layers {route[index].layers} from failed node {failed}: {why}",
        retry_after_s=5,
    )


def equivalent_nodes(run: Sequence[PinnedHop], live: Sequence[NodeRecord]) -> list[NodeRecord]:
    """The live nodes that could stand in for part of ``run`` (consecutive pinned hops) without
    changing a single bit of what the route computes: each layer they hold was computed by a hop
    with their ``numerics``, no lossy seam of ``run`` falls inside their range, and the seam they
    send on is the one the route had there (its lossy dtype, or exact float32 where there was none).
    A node or hop that does not say its numerics never qualifies."""
    if not run:
        return []
    total = run[0].layers.total
    lossy = {h.layers.stop: h.wire_dtype for h in run if h.wire_dtype != EXACT_WIRE and not h.layers.is_tail}
    fits = []
    for node in live:
        if not node.routable:
            continue  # an auditor or a suspended node takes over no hop
        start, stop = node.layers.start, node.layers.stop
        covered = [h for h in run if h.layers.start < stop and start < h.layers.stop]
        if not covered or node.numerics is None or any(h.numerics != node.numerics for h in covered):
            continue
        if any(h.identity is not None and h.identity != node.identity for h in covered):
            continue  # another model (a requantized copy under the same id) computes other bits
        if any(start < cut < stop for cut in lossy):
            continue  # it would drop a rounding the route did
        if stop < total and node.wire_dtype != lossy.get(stop, EXACT_WIRE):
            continue
        if node.layers.total == total:
            fits.append(node)
    return fits
