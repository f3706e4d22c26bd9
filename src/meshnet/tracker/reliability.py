"""A node's reliability record: heartbeats seen and missed, failures reported, as one number in [0, 1].

The tracker keeps one ``Reliability`` per node id (it outlives the node's registration, so a
node that crashes and comes back keeps its record). Counts decay with a half-life, so an old
outage is forgiven and a node recovers by serving well. Pure bookkeeping over a clock the caller
passes in; not thread-safe (the tracker touches it from its event loop only).

    reliability = (seen + 1) / (seen + missed + FAILURE_WEIGHT · failures + 1)

A failure report weighs as much as ``FAILURE_WEIGHT`` missed heartbeats: it is direct evidence
that a request broke, where a missed heartbeat may only be a slow network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FAILURE_WEIGHT", "HALF_LIFE_S", "MAX_MISSED_PER_GAP", "Reliability"]

HALF_LIFE_S = 3600.0
FAILURE_WEIGHT = 100.0  # ~8 minutes of 5 s heartbeats
MAX_MISSED_PER_GAP = 3.0  # an outage counts as at most the misses that expired it (NODE_TTL_S / 5 s)


@dataclass
class Reliability:
    seen: float = 0.0
    missed: float = 0.0
    failures: float = 0.0
    last_heartbeat: float | None = None
    last_update: float = 0.0
    last_failure: str | None = None
    interval_s: float = 5.0  # the node's heartbeat period, as it last reported it

    def heartbeat(self, now: float, interval_s: float) -> None:
        """A heartbeat arrived; the silence since the previous one counts as missed beats."""
        self._decay(now)
        if self.last_heartbeat is not None:
            self.missed += self.missed_since(self.last_heartbeat, now, self.interval_s)
        self.seen += 1.0
        self.last_heartbeat = now
        self.interval_s = interval_s

    def failure(self, now: float, reason: str) -> None:
        self._decay(now)
        self.failures += 1.0
        self.last_failure = reason[:500]

    def value(self, now: float | None = None) -> float:
        """In [0, 1]; with ``now``, the heartbeats overdue at ``now`` already count as missed."""
        missed = self.missed
        if now is not None and self.last_heartbeat is not None:
            missed += self.missed_since(self.last_heartbeat, now, self.interval_s)
        return (self.seen + 1.0) / (self.seen + missed + FAILURE_WEIGHT * self.failures + 1.0)

    @staticmethod
    def missed_since(last: float, now: float, interval_s: float) -> float:
        """Whole heartbeats missed between ``last`` and ``now`` (one interval of slack for jitter)."""
        interval = max(interval_s, 0.1)
        return min(MAX_MISSED_PER_GAP, max(0.0, math.floor((now - last) / interval - 1.0)))

    def _decay(self, now: float) -> None:
        if self.last_update and now > self.last_update:
            keep = 0.5 ** ((now - self.last_update) / HALF_LIFE_S)
            self.seen *= keep
            self.missed *= keep
            self.failures *= keep
        self.last_update = max(now, self.last_update)
