"""A node's reliability record: heartbeats seen and missed, failures reported, as one number in [0, 1].

The tracker keeps one ``Reliability`` per node id (it outlives the node's registration, so a
node that crashes and comes back keeps its record). Counts decay with a half-life, so an old
outage is forgiven and a node recovers by serving well. Pure bookkeeping over a clock the caller
passes in; not thread-safe (the tracker touches it from its event loop only).

    reliability = (seen + 1) / (seen + missed + FAILURE_WEIGHT · failures + 1)

A failure report weighs as much as ``FAILURE_WEIGHT`` missed heartbeats: it is direct evidence
that a request broke, where a missed heartbeat may only be a slow network.

**Counted by time, not by heartbeats.** ``seen`` and ``missed`` are in units of
``UNIT_S`` (the default 5 s heartbeat): a counted heartbeat adds its interval's worth of time
seen, a silence the intervals it missed. And at most one heartbeat per interval counts, through a
bucket of ``HEARTBEAT_BURST`` beats that refills one per interval (floored at
``MIN_HEARTBEAT_S``): so ``seen`` grows by at most one unit per ``UNIT_S`` of wall time, whatever
rate a node heartbeats at or period it claims. A node that sent heartbeats every 50 ms used to
wash a failure out in seconds; now a failure costs ``FAILURE_WEIGHT · UNIT_S`` (about eight
minutes) of honest service, from every node alike. A heartbeat that does not count still keeps the
node alive (it refreshes its registration); it only adds nothing to its record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FAILURE_WEIGHT",
    "HALF_LIFE_S",
    "HEARTBEAT_BURST",
    "MAX_MISSED_PER_GAP",
    "MIN_HEARTBEAT_S",
    "UNIT_S",
    "Reliability",
]

HALF_LIFE_S = 3600.0
FAILURE_WEIGHT = 100.0  # ~8 minutes of 5 s heartbeats
MAX_MISSED_PER_GAP = 3.0  # an outage counts as at most the misses that expired it (NODE_TTL_S / 5 s)
UNIT_S = 5.0  # seconds of heartbeats one unit of ``seen`` or ``missed`` stands for
MIN_HEARTBEAT_S = 1.0  # a node claiming a shorter period is counted as if it beat this often
# Beats that may count back to back: a node re-registers at once when its self-benchmark ends.
HEARTBEAT_BURST = 2.0


@dataclass
class Reliability:
    seen: float = 0.0
    missed: float = 0.0
    failures: float = 0.0
    last_heartbeat: float | None = None
    last_update: float = 0.0
    last_failure: str | None = None
    interval_s: float = UNIT_S  # the node's heartbeat period, as it last reported it (floored)
    credit: float = HEARTBEAT_BURST  # heartbeats that may count now (the bucket)

    def heartbeat(self, now: float, interval_s: float) -> bool:
        """A heartbeat arrived; the silence since the previous one counts as missed beats. Whether
        it counted as time seen (at most one per interval does)."""
        self._decay(now)
        interval = max(interval_s, MIN_HEARTBEAT_S)
        if self.last_heartbeat is not None:
            self.missed += self.missed_since(self.last_heartbeat, now, self.interval_s)
            gap = max(0.0, now - self.last_heartbeat)
            self.credit = min(HEARTBEAT_BURST, self.credit + gap / self.interval_s)
        counted = self.credit >= 1.0
        if counted:
            self.credit -= 1.0
            self.seen += interval / UNIT_S
        self.last_heartbeat = now
        self.interval_s = interval
        return counted

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
        """Units of time missed between ``last`` and ``now``: whole heartbeats of ``interval_s``
        missed (one interval of slack for jitter), at most ``MAX_MISSED_PER_GAP`` units."""
        interval = max(interval_s, MIN_HEARTBEAT_S)
        beats = max(0.0, math.floor((now - last) / interval - 1.0))
        return min(MAX_MISSED_PER_GAP, beats * interval / UNIT_S)

    def _decay(self, now: float) -> None:
        if self.last_update and now > self.last_update:
            keep = 0.5 ** ((now - self.last_update) / HALF_LIFE_S)
            self.seen *= keep
            self.missed *= keep
            self.failures *= keep
        self.last_update = max(now, self.last_update)
