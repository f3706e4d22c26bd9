"""A route as every component sees it: the hops that cover a model's layers, pinned to a session."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.ids import RouteId, SessionId
from meshnet.layers import LayerRange

__all__ = ["Hop", "RoutePlan"]


@dataclass(frozen=True, slots=True)
class Hop:
    """One node of a route."""

    node: str
    url: str
    layers: LayerRange

    def as_json(self) -> dict[str, str]:
        return {"node": self.node, "url": self.url, "layers": str(self.layers)}


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The route a session is pinned to (sticky for its lifetime)."""

    session_id: SessionId
    route_id: RouteId
    hops: tuple[Hop, ...]

    @property
    def layers(self) -> int:
        return sum(len(h.layers) for h in self.hops)
