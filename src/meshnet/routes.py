"""A route as every component sees it: the hops that cover a model's layers, pinned to a session."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.ids import RouteId, SessionId
from meshnet.layers import LayerRange

__all__ = ["NESTED_TIMEOUT_MARGIN_S", "Hop", "RoutePlan", "hop_timeout_s"]

# Each hop waits this much longer for its next hop than that hop waits for the one after it.
NESTED_TIMEOUT_MARGIN_S = 10.0


def hop_timeout_s(base_s: float, hops_below: int) -> float:
    """How long to wait for an answer from a hop that has ``hops_below`` hops from itself to the tail.

    Timeouts nest: the innermost caller gives up first, so a hung node (alive, not answering) is
    named by the hop just above it, not blamed on an innocent hop further up that timed out first.
    """
    return base_s + NESTED_TIMEOUT_MARGIN_S * max(0, hops_below - 1)


@dataclass(frozen=True, slots=True)
class Hop:
    """One node of a route."""

    node: str
    url: str
    layers: LayerRange
    max_verify: int = 0  # drafted positions one verify chunk may add on this hop (speculative decoding)
    identity: str | None = None  # the model identity it runs (one per route; docs/tracker.md)
    quantization: str | None = None  # its weights' quantization, as it advertises it
    max_positions: int = 0  # positions one session may hold on it (0: it did not say)
    key: str | None = None  # its hop key, as the tracker pinned it (protocol.signing); None: not checked

    def as_json(self) -> dict[str, str]:
        """What telemetry and the swarm view show of the hop: where it is and what it runs."""
        shown = {"node": self.node, "url": self.url, "layers": str(self.layers)}
        if self.identity is not None:
            shown["identity"] = self.identity
        if self.quantization is not None:
            shown["quantization"] = self.quantization
        return shown


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The route a session is pinned to (sticky for its lifetime)."""

    session_id: SessionId
    route_id: RouteId
    hops: tuple[Hop, ...]
    ticket: str | None = None  # a private swarm's tracker-signed route (or repair) ticket for the hops
    trusted_only: bool = False  # pinned over trusted nodes only (and so is every route that replaces it)
    cached_tokens: int = 0  # the prompt positions the tracker expects the route's prefix caches to hold
    prefix_namespace: bytes = b""  # the prefix-cache namespace its prompt blocks are hashed in (the API key's)
    max_tokens: int = 0  # the most tokens the generation on it asked for (0: not said)

    @property
    def layers(self) -> int:
        return sum(len(h.layers) for h in self.hops)

    @property
    def max_positions(self) -> int:
        """Positions a session may hold on this route: its smallest hop's (0: no hop said)."""
        said = [h.max_positions for h in self.hops if h.max_positions > 0]
        return min(said) if said else 0
