"""Route selection as a pure function over a snapshot of registered nodes.

A route is a chain of nodes serving one model whose layer ranges tile ``[0, total)`` exactly:
the head starts at 0, each next node starts where the previous stopped, the tail ends at
``total``. Among the chains that exist, fewer hops win (each hop costs a network round trip per
decode step), then the nodes with the most free KV. Measured-speed scoring arrives with the
tracker issue; this function keeps the same signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.errors import Overloaded
from meshnet.layers import LayerRange

__all__ = ["NodeRecord", "plan_route"]


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node_id: str
    url: str
    model: str
    layers: LayerRange
    backend: str
    kv_bytes_free: int
    last_seen: float


def plan_route(nodes: Sequence[NodeRecord], model: str, total_layers: int | None = None) -> list[NodeRecord]:
    """The best chain of ``nodes`` covering every layer of ``model``; ``Overloaded`` if none exists.

    ``total_layers``, when the caller knows it (the gateway reads it from the GGUF), rules out nodes
    that registered the model with another layer count.
    """
    candidates = [n for n in nodes if n.model == model]
    if not candidates:
        raise Overloaded(f"no node serves model {model!r} right now", retry_after_s=5)
    if total_layers is not None:
        matching = [n for n in candidates if n.layers.total == total_layers]
        if not matching:
            counts = sorted({n.layers.total for n in candidates})
            raise Overloaded(
                f"the nodes serving {model!r} report {counts} layers, not the {total_layers} asked for",
                retry_after_s=5,
            )
        candidates = matching
    # A chain only joins nodes that agree on the layer count. Which count is "right" is not the
    # tracker's to know (one misconfigured node must not hide a complete chain that registered
    # after it), so every count is planned on its own and the best complete chain wins.
    totals = sorted({n.layers.total for n in candidates})
    chains = [c for c in (_best_chain(candidates, total) for total in totals) if c is not None]
    if not chains:
        raise Overloaded(_gap_message(candidates, model), retry_after_s=5)
    return min(chains, key=_rank)[2]


_Chain = tuple[int, int, list[NodeRecord]]  # (hops, free KV of its weakest node, nodes head first)


def _rank(chain: _Chain) -> tuple[int, int, list[str]]:
    hops, free, nodes = chain
    return hops, -free, [n.node_id for n in nodes]


def _best_chain(candidates: Sequence[NodeRecord], total: int) -> _Chain | None:
    by_start: dict[int, list[NodeRecord]] = {}
    for node in candidates:
        if node.layers.total == total:
            by_start.setdefault(node.layers.start, []).append(node)
    # best[s] = the best chain covering [s, total): shortest, then most free KV at its weakest node.
    best: dict[int, _Chain] = {total: (0, 1 << 62, [])}
    for start in sorted(by_start, reverse=True):
        options = []
        for node in by_start[start]:
            rest = best.get(node.layers.stop)
            if rest is not None:
                hops, free, chain = rest
                options.append((hops + 1, min(free, node.kv_bytes_free), [node, *chain]))
        if options:
            best[start] = min(options, key=_rank)
    return best.get(0)


def _gap_message(candidates: Sequence[NodeRecord], model: str) -> str:
    """Say where the chain breaks, for the layer count most of the model's nodes report."""
    counts: dict[int, int] = {}
    for node in candidates:
        counts[node.layers.total] = counts.get(node.layers.total, 0) + 1
    total = max(counts, key=lambda t: (counts[t], t))
    ranges = [n.layers for n in candidates if n.layers.total == total]
    gap = None
    covered = 0  # layers [0, covered) are served by some node (interval sweep: totals can be large)
    for r in sorted(ranges, key=lambda r: r.start):
        if r.start > covered:
            gap = (covered, r.start)
            break
        covered = max(covered, r.stop)
    if gap is None and covered < total:
        gap = (covered, total)
    if gap is not None:
        why = f"no node serves layers {gap[0]}:{gap[1]}"
    else:
        # Every layer is served, but the ranges do not tile: follow the chain from layer 0 to where it stops.
        reach, frontier = {0}, [0]
        while frontier:
            at = frontier.pop()
            for r in ranges:
                if r.start == at and r.stop not in reach:
                    reach.add(r.stop)
                    frontier.append(r.stop)
        why = f"no node starts at layer {max(reach)}, where the chain from layer 0 ends"
    have = ", ".join(str(r) for r in sorted(ranges, key=lambda r: (r.start, r.stop)))
    others = len(candidates) - len(ranges)
    ignored = f"; {others} node(s) reporting another layer count ignored" if others else ""
    return f"the nodes serving {model!r} do not cover layers 0:{total}: {why} (have {have}){ignored}"
