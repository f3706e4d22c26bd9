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


def plan_route(nodes: Sequence[NodeRecord], model: str) -> list[NodeRecord]:
    """The best chain of ``nodes`` covering every layer of ``model``; ``Overloaded`` if none exists."""
    candidates = [n for n in nodes if n.model == model]
    if not candidates:
        raise Overloaded(f"no node serves model {model!r} right now", retry_after_s=5)
    total = candidates[0].layers.total
    by_start: dict[int, list[NodeRecord]] = {}
    for node in candidates:
        if node.layers.total == total:
            by_start.setdefault(node.layers.start, []).append(node)
    # best[s] = the best chain covering [s, total): shortest, then most free KV at its weakest node.
    best: dict[int, tuple[int, int, list[NodeRecord]]] = {total: (0, 1 << 62, [])}
    for start in sorted(by_start, reverse=True):
        options = []
        for node in by_start[start]:
            rest = best.get(node.layers.stop)
            if rest is not None:
                hops, free, chain = rest
                options.append((hops + 1, min(free, node.kv_bytes_free), [node, *chain]))
        if options:
            best[start] = min(options, key=lambda o: (o[0], -o[1], [n.node_id for n in o[2]]))
    if 0 not in best:
        covered = sorted(str(n.layers) for n in candidates)
        raise Overloaded(
            f"the nodes serving {model!r} do not cover layers 0:{total} (have {', '.join(covered)})", retry_after_s=5
        )
    return best[0][2]
